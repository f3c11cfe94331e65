"""Per-call overhead and throughput of the `code` reward's sandbox, before and after OS isolation.

Three contenders, alternating in one process on the same workload (a correct `add` with 3 assert
tests, and a stdin/stdout program with 2 cases):
- `before`: the sandbox as it was before OS isolation (one plain child process, rlimits, audit
  hook, all tests in one interpreter), loaded from git at BEFORE_REV;
- `process`: today's weaker fallback (`isolation="process"`: the fork-per-test harness, no
  namespaces);
- `os`: the default (`isolation="os"`: bubblewrap namespaces, seccomp, the same harness).

Per-call latency is the median of serial calls; throughput is calls/s of `code_reward`'s pool
(`run_many`, one sandbox per core by default) over a batch of completions.

    python -m benchmarks.sandbox_throughput [--calls 40] [--batch 64]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE_REV = "56b775c"  # the last commit with the audit-hook sandbox
ASSERT_CODE = "def add(a, b):\n    return a + b\n"
ASSERT_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]
IO_CODE = "n = int(input())\nprint(n * 2)\n"
IO_TESTS = [{"input": "3\n", "output": "6"}, {"input": "5\n", "output": "10"}]


def load_before():
    """The pre-OS-isolation sandbox module from git, or None outside a git checkout."""
    try:
        src = subprocess.run(["git", "show", f"{BEFORE_REV}:posttrain/sandbox.py"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    path = Path(tempfile.mkdtemp()) / "sandbox_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("sandbox_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sandbox_before"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=40, help="serial calls per contender and workload")
    ap.add_argument("--batch", type=int, default=64, help="completions per pool batch")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from rewards import sandbox

    before = load_before()
    contenders = {"os": lambda c, t: sandbox.run_tests(c, t, isolation="os"),
                  "process": lambda c, t: sandbox.run_tests(c, t, isolation="process")}
    if before is not None:
        contenders["before"] = lambda c, t: before.run_tests(c, t)
    for run in contenders.values():  # warm-up (the prepared root, the availability probe)
        assert run(ASSERT_CODE, ASSERT_TESTS).fraction_passed == 1.0
        assert run(IO_CODE, IO_TESTS).fraction_passed == 1.0

    lat = {(name, w): [] for name in contenders for w in ("assert", "io")}
    for _ in range(args.calls):  # alternate so that machine load hits every contender alike
        for name, run in contenders.items():
            for w, (code, tests) in {"assert": (ASSERT_CODE, ASSERT_TESTS),
                                     "io": (IO_CODE, IO_TESTS)}.items():
                t0 = time.perf_counter()
                run(code, tests)
                lat[(name, w)].append(time.perf_counter() - t0)

    workers = os.cpu_count() or 1
    thr = {}
    for name, run in contenders.items():
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:  # as run_many does
            results = list(pool.map(lambda _: run(ASSERT_CODE, ASSERT_TESTS), range(args.batch)))
        thr[name] = args.batch / (time.perf_counter() - t0)
        assert all(r.fraction_passed == 1.0 for r in results)

    ref = "before" if before is not None else "process"
    print(f"{os.cpu_count()} cores; {args.calls} serial calls per cell (median), pool of {workers} "
          f"over {args.batch} completions")
    print(f"{'contender':<10} {'assert x3 (ms)':>15} {'stdin/out x2 (ms)':>18} {'pool calls/s':>13} "
          f"{'calls/s vs ' + ref:>16}")
    for name in contenders:
        a = statistics.median(lat[(name, "assert")]) * 1e3
        b = statistics.median(lat[(name, "io")]) * 1e3
        print(f"{name:<10} {a:>15.1f} {b:>18.1f} {thr[name]:>13.1f} {thr[name] / thr[ref]:>15.2f}x")


if __name__ == "__main__":
    main()
