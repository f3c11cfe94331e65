"""Where a TPU train step's time would go, without the chip: XLA's own per-op cost model.

    python -m benchmarks.tpu.hlo_cost RECIPE [key=value ...] [--topology v5e-1] [--top 30]
    python -m benchmarks.tpu.hlo_cost --hlo PROGRAM.txt [--profile train_step.json] [--top 30]

The first form compiles the recipe's real train step for a TPU topology on this CPU (libtpu, as
`posttrain plan --topology` does) and reads the compiled program's text; the second reads a
program saved elsewhere (`benchmarks.tpu.train_step`'s `+profile` writes the one the chip ran).
The TPU compiler annotates each op with `estimated_cycles`; this sums them per loop (a scanned
model's forward and backward layer loops, the LM head's chunks: an op's estimate times its
loop's trip count; of a conditional's branches, the costliest) and lists the costliest ops with
the JAX operation they come from.

How far to trust it (checked against the chip's profile of the same program, BENCHMARKS.md):
the matmul fusions' estimates are within 0.8-1.2x of the chip; element-wise, copy and
reduction ops are estimated 2-8x too slow; Pallas kernels (splash) are not estimated at all.
It ranks changes to the matmuls and to layouts; the chip measures. `--profile` puts the chip's
milliseconds per op beside the estimate. Cycles are converted at the v5e's 1.5 GHz.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field

CLOCK_HZ = 1.5e9  # TPU v5e TensorCore


@dataclass
class Op:
    name: str
    opcode: str
    shape: str
    cycles: int  # one execution
    runs: int  # its loops' trip counts multiplied
    source: str  # the JAX operation (op_name metadata)

    @property
    def ms(self) -> float:
        return self.cycles * self.runs / CLOCK_HZ * 1e3


@dataclass
class Program:
    ops: list[Op] = field(default_factory=list)
    loops: list[tuple[str, int, float]] = field(default_factory=list)  # (while op, trips, ms)

    @property
    def ms(self) -> float:
        return sum(o.ms for o in self.ops)


_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\(")


def computations(text: str) -> dict[str, list[str]]:
    """HLO text -> {computation name: its instruction lines} (the entry is named `main...`)."""
    comps, cur, body = {}, None, []
    for line in text.split("\n"):
        if cur is None:
            m = _COMP.match(line)
            if m:
                cur, body = m.group(1), []
            continue
        if line == "}":
            comps[cur] = body
            cur = None
        else:
            body.append(line)
    return comps


def trip_count(comps: dict, condition: str) -> int:
    """A scan's loop runs to the s32 constant its condition compares the counter with."""
    for line in comps.get(condition, ()):
        m = re.search(r"s32\[\](?:\{[^}]*\})? constant\((\d+)\)", line)
        if m:
            return int(m.group(1))
    return 1


def read_program(text: str) -> Program:
    comps = computations(text)
    entry = next(c for c in reversed(list(comps)) if c.startswith("main"))
    prog = Program()

    def walk(comp: str, runs: int):
        for line in comps[comp]:
            m = _INSTR.match(line)
            if not m:
                continue
            name, shape, opcode = m.groups()
            if opcode == "while":
                body = re.search(r"body=%([\w.\-]+)", line).group(1)
                trips = trip_count(comps, re.search(r"condition=%([\w.\-]+)", line).group(1))
                before = len(prog.ops)
                walk(body, runs * trips)
                prog.loops.append((name, trips, sum(o.ms for o in prog.ops[before:])))
                continue
            if opcode == "conditional":  # the costliest branch (a sampler's cond: greedy or not)
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches
                         else [re.search(k + r"_computation=%([\w.\-]+)", line).group(1)
                               for k in ("true", "false")])
                before, costs = len(prog.ops), []
                for b in names:
                    start = len(prog.ops)
                    walk(b, runs)
                    costs.append((sum(o.ms for o in prog.ops[start:]), prog.ops[start:]))
                    del prog.ops[start:]
                prog.ops[before:] = max(costs, key=lambda c: c[0])[1]
                continue
            c = re.search(r'"estimated_cycles":"(\d+)"', line)
            src = re.search(r'op_name="([^"]*)"', line)
            prog.ops.append(Op(name, opcode, re.sub(r"\{[^}]*\}", "", shape), int(c.group(1)) if c else 0,
                               runs, src.group(1) if src else ""))

    walk(entry, 1)
    return prog


_ASYNC_TO_VMEM = re.compile(r"%[\w.\-]+ = \(+([a-z0-9]+\[[\d,]*\])\{[^}]*\}\)?, "
                            r"[a-z0-9]+\[[\d,]*\]\{[^}]*S\(1\)\}[^\n]*? (copy-start|slice-start)\(")


def loop_vmem_copies(text: str, shape: str) -> dict[str, int]:
    """{while-loop body: copies per iteration} of a compiled TPU program, for the bodies where
    memory-space assignment copies buffers whose shape matches the regex `shape` into VMEM
    (memory space S(1)), whole (`copy-start`) or in slices (`slice-start`, each slice counted).
    A decode loop that copies its KV cache this way waits on the copies (BENCHMARKS.md)."""
    comps = computations(text)
    bodies = {m.group(1) for lines in comps.values() for line in lines
              for m in [re.search(r" while\(.*body=%([\w.\-]+)", line)] if m}
    counts = {b: sum(1 for line in comps[b] for m in [_ASYNC_TO_VMEM.search(line)]
                     if m and re.fullmatch(shape, m.group(1))) for b in bodies if b in comps}
    return {b: n for b, n in counts.items() if n}


def report(prog: Program, top: int, chip: dict | None = None) -> None:
    for name, trips, ms in prog.loops:
        print(f"loop {name} x{trips}: {ms:.1f} ms")
    print(f"step, estimated: {prog.ms:.1f} ms (Pallas kernels not counted)")
    cols = "  chip ms" if chip else ""
    print(f"{'est ms':>8}{cols}  {'op':36} {'shape':48} JAX source")
    for o in sorted(prog.ops, key=lambda o: -o.ms)[:top]:
        c = f"{chip[o.name]:9.2f}" if chip and o.name in chip else (" " * 9 if chip else "")
        print(f"{o.ms:8.2f}{c}  {o.name[:36]:36} {o.shape[:48]:48} {o.source[-60:]}")


def chip_profile(path: str) -> dict:
    """{op name: ms per step} from `benchmarks.tpu.train_step`'s JSON (its first profiled run)."""
    runs = json.load(open(path))["runs"]
    prof = next(r["profile"] for r in runs if "profile" in r)
    return {o["op"].lstrip("%"): o["ms"] for o in prof["top_ops"]}


def compile_recipe(recipe: str, overrides: list[str], topology: str) -> str:
    from posttrain.plan import _prepare_devices, compile_train_step, model_config_for_plan, \
        target_devices

    _prepare_devices(argparse.Namespace(topology=topology, no_compile=False))
    from posttrain.config import load_recipe

    cfg = load_recipe(recipe, overrides)[-1]
    x = compile_train_step(cfg, model_config_for_plan(cfg), target_devices(topology, None),
                           keep_hlo=True)
    if "oom" in x:
        raise SystemExit(f"{recipe}: the step does not fit {topology}: {x['oom']}")
    print(f"XLA's program for {topology}: {x['total'] / 1e9:.2f} GB per device "
          f"({x['temp'] / 1e9:.2f} of temporaries)")
    return x["hlo"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe", nargs="*", help="RECIPE [key=value ...]")
    ap.add_argument("--topology", default="v5e-1")
    ap.add_argument("--hlo", help="a compiled program's text instead of a recipe")
    ap.add_argument("--save", help="write the compiled program's text here")
    ap.add_argument("--profile", help="train_step.json with a chip profile of the same program")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    if bool(args.hlo) == bool(args.recipe):
        ap.error("give a recipe or --hlo")
    text = open(args.hlo).read() if args.hlo else compile_recipe(args.recipe[0], args.recipe[1:],
                                                                  args.topology)
    if args.save:
        open(args.save, "w").write(text)
    report(read_program(text), args.top, chip_profile(args.profile) if args.profile else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
