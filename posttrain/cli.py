"""`posttrain` command line: run, validate, convert, plan, generate, eval.

User mistakes (`UserError`) print one line `posttrain: error: ...` and exit 2; bugs keep their
traceback.
"""

from __future__ import annotations

import argparse
import sys

from posttrain.errors import UserError


def _cmd_run(args: argparse.Namespace) -> int:
    from posttrain.config import check_recipe, load_recipe
    from posttrain.runner import run_stages

    stages = load_recipe(args.recipe, args.overrides)
    import jax

    check_recipe(stages, jax.device_count())
    run_stages(stages)
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from posttrain.config import check_recipe, load_recipe

    if args.devices is None:
        import jax

        devices = jax.device_count()
    else:
        devices = args.devices
    failed = 0
    for recipe in args.recipes:
        try:
            stages = load_recipe(recipe, args.overrides)
            check_recipe(stages, devices)
        except UserError as e:
            print(f"{recipe}: error: {e}", file=sys.stderr)
            failed += 1
            continue
        names = ", ".join(f"{c.name} ({c.algorithm})" for c in stages)
        print(f"{recipe}: ok: {names}")
    return 2 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a recipe (all its stages)")
    run.add_argument("recipe")
    run.add_argument("overrides", nargs="*", metavar="key.sub=value")
    run.set_defaults(fn=_cmd_run)

    val = sub.add_parser("validate", help="parse and cross-check recipes without running them")
    val.add_argument("recipes", nargs="+")
    val.add_argument("--set", dest="overrides", action="append", default=[], metavar="key=value")
    val.add_argument("--devices", type=int, default=None,
                     help="device count to check the mesh against (default: this machine's)")
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
    args = build_parser().parse_args(argv)
    try:
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
