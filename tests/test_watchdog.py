"""The watchdog: a phase that waits too long is reported, naming what it waits on, and a run
that cannot make progress ends with exit status 1 and one error line instead of hanging."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUCK = textwrap.dedent("""
    import threading, time
    from posttrain.watchdog import Watchdog
    dog = Watchdog(warn_after_s=0.5, abort_after_s=2.5, resume_hint=lambda: "resume from 40",
                   poll_s=0.1)
    with dog.waiting("the quick phase"):
        time.sleep(0.2)
    with dog.waiting("rollouts and rewards for step 41"):
        threading.Event().wait()  # a call that never returns
""")


def test_a_stuck_phase_is_reported_then_ends_the_run():
    r = subprocess.run([sys.executable, "-c", STUCK], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr
    # warned at 0.5 s, 1 s and 2 s (each time the wait doubles), then the error
    assert [ln.split(" s on ")[1] for ln in lines[:-1]] == ["rollouts and rewards for step 41"] * 3
    assert all(ln.startswith("posttrain: warning: waiting ") for ln in lines[:-1])
    assert lines[-1].startswith("posttrain: error: no progress for ")
    assert "waiting on rollouts and rewards for step 41 (watchdog.abort_after_s = 2.5)" in lines[-1]
    assert lines[-1].endswith("ending the run; resume from 40")
    assert "quick phase" not in r.stderr


def test_nested_phases_restore_the_outer_one():
    from posttrain.watchdog import Watchdog

    dog = Watchdog(0, 0)
    with dog.waiting("outer"):
        with dog.waiting("inner"):
            assert dog._what == "inner"
        assert dog._what == "outer"
    assert dog._what is None and dog._thread is None
