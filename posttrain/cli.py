"""`posttrain` command line: run, validate, convert, plan, generate, eval.

User mistakes (`UserError`) print one line `posttrain: error: ...` and exit 2; bugs keep their
traceback.
"""

from __future__ import annotations

import argparse
import sys

from posttrain.config import add_recipe_arguments, recipes_and_overrides
from posttrain.errors import UserError


def _cmd_run(args: argparse.Namespace) -> int:
    from posttrain.config import apply_memory_split, check_recipe, load_recipe
    from posttrain.runner import run_stages

    (recipe,), overrides = recipes_and_overrides(args)
    stages = load_recipe(recipe, overrides)
    apply_memory_split(stages)  # before JAX starts
    import jax

    check_recipe(stages, jax.device_count())
    run_stages(stages, args.stages.split(",") if args.stages else None)
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from posttrain.config import check_recipe, load_recipe, validation_devices

    recipes, overrides = recipes_and_overrides(args)
    if args.devices is None:
        import jax

        local = jax.device_count()
    failed = 0
    for recipe in recipes:
        note = ""
        try:
            stages = load_recipe(recipe, overrides)
            if args.devices is None:
                devices, why = validation_devices(stages, local)
                note = f" (checked against {devices} devices: {why})" if why else ""
            else:
                devices = args.devices
            check_recipe(stages, devices)
        except UserError as e:
            print(f"{recipe}: error: {e}{note}", file=sys.stderr)
            failed += 1
            continue
        names = ", ".join(f"{c.name} ({c.algorithm})" for c in stages)
        print(f"{recipe}: ok: {names}{note}")
    return 2 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a recipe (all its stages)")
    add_recipe_arguments(run)
    run.add_argument("--stages", metavar="NAME[,NAME...]", help="run only these stages; one "
                     "left out still hands its run directory's checkpoint to the next")
    run.set_defaults(fn=_cmd_run, trains=True)

    val = sub.add_parser("validate", help="parse and cross-check recipes without running them")
    add_recipe_arguments(val, many=True)
    val.add_argument("--devices", type=int, default=None,
                     help="device count to check the mesh against (default: the count a fixed "
                     "mesh names, else this machine's)")
    val.set_defaults(fn=_cmd_validate)

    from converters.convert import add_parser as add_convert

    add_convert(sub)
    from posttrain.plan import add_parser as add_plan

    add_plan(sub)
    from rollout.cli_generate import add_parser as add_generate

    add_generate(sub)
    from posttrain.evaluate import add_parser as add_eval

    add_eval(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "items") and not any(a.startswith("-") for a in extra):
        args.items += extra  # positional overrides after an option: `run R --set a=1 b=2`
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from posttrain import compile_cache, host_memory

    compile_cache.enable()  # before anything compiles; children inherit it
    try:
        if getattr(args, "trains", False):  # before JAX's threads allocate (host_memory.py)
            host_memory.keep_freed_memory()
        if getattr(args, "early", None):  # e.g. device flags that must precede JAX's start
            args.early(args)
        return args.fn(args)
    except UserError as e:
        print(f"posttrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("posttrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
