"""A watchdog for the training loops: what the run is waiting on, and for how long.

The loops mark each blocking phase (`with dog.waiting("rollouts and rewards for step 12"):`).
A background thread checks once a second: a phase that has lasted `warn_after_s` is reported
on stderr (again each time its duration doubles), naming what it waits on; one that has lasted
`abort_after_s` ends the process with exit status 1 and a one-line error, because a run that
cannot make progress must not sit on its accelerators forever. The process is ended from the
watchdog's thread (`os._exit`): the stuck call (a collective, a `ray.get`, a device transfer)
cannot be interrupted from Python. Nothing is lost that a restart needs: checkpoints are
committed atomically, and an unfinished one is discarded on resume.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator


class Watchdog:
    def __init__(self, warn_after_s: float, abort_after_s: float,
                 resume_hint: Callable[[], str] | None = None, poll_s: float = 1.0):
        self.warn_after_s, self.abort_after_s = warn_after_s, abort_after_s
        self.resume_hint = resume_hint
        self._what: str | None = None
        self._since = 0.0
        self._next_warn = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if warn_after_s > 0 or abort_after_s > 0:
            self._thread = threading.Thread(target=self._watch, args=(poll_s,), daemon=True,
                                            name="posttrain-watchdog")
            self._thread.start()

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        with self._lock:
            outer = (self._what, self._since, self._next_warn)
            self._what, self._since = what, time.monotonic()
            self._next_warn = self.warn_after_s
        try:
            yield
        finally:
            with self._lock:
                self._what, self._since, self._next_warn = outer

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            with self._lock:
                what, waited = self._what, time.monotonic() - self._since
                if what is None:
                    continue
                if self.abort_after_s > 0 and waited >= self.abort_after_s:
                    hint = self.resume_hint() if self.resume_hint else ""
                    print(f"posttrain: error: no progress for {waited:.0f} s: waiting on {what} "
                          f"(watchdog.abort_after_s = {self.abort_after_s:g}); ending the run"
                          + (f"; {hint}" if hint else ""), file=sys.stderr, flush=True)
                    os._exit(1)
                if self.warn_after_s > 0 and waited >= self._next_warn:
                    print(f"posttrain: warning: waiting {waited:.0f} s on {what}",
                          file=sys.stderr, flush=True)
                    self._next_warn *= 2

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def for_run(cfg, run_dir) -> Watchdog:
    """The recipe's watchdog; its abort message names the checkpoint a restart resumes from
    (read from the directory: the trainer itself may be what hangs)."""
    from pathlib import Path

    ckpt = Path(run_dir) / "checkpoints"

    def hint() -> str:
        steps = [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] if ckpt.is_dir() else []
        return (f"run the same command again to resume from checkpoint {max(steps)}" if steps
                else "no checkpoint was written yet")

    return Watchdog(cfg.watchdog.warn_after_s, cfg.watchdog.abort_after_s, hint)
