"""Run untrusted code (a model's completion) against test cases in a contained child process.

Containment, layer by layer:
- a separate process (its crash, hang or exit cannot touch the trainer), in its own session so the
  whole process group is killed on wall-time expiry;
- resource limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size, no core dumps;
- a fresh temporary working directory, removed afterwards, and an environment holding only PATH,
  HOME (the temp dir) and LANG: none of the parent's secrets (API keys, tokens);
- no network: a new network namespace when the kernel allows it (unprivileged user namespaces),
  and in any case a Python audit hook (which user code cannot remove) that refuses sockets;
- the same audit hook refuses process creation (fork, exec, spawn, subprocess) -- a fork bomb
  fails at its first fork -- and file writes outside the working directory, and ctypes loading.

Known limit: a determined adversary with native code execution is beyond an audit hook; run the
trainer in a container for hostile workloads. For RL reward hacking by a policy model, these layers
are what verl/TRL-style sandboxes provide.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

HARNESS = r'''
import ctypes, io, json, os, resource, sys
payload = json.loads(sys.stdin.read())
# Limits are set here, in the child, before any user code: no preexec_fn (unsafe to run in a
# multi-threaded parent such as a JAX trainer).
cpu, mem = payload["cpu_s"], payload["memory_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 * 1024,) * 2)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
try:  # a private, empty network namespace when the kernel allows unprivileged user namespaces
    ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000)
except Exception:
    pass
nonce, code, tests = payload["nonce"], payload["code"], payload["tests"]
root = os.path.realpath(os.getcwd())
real_stdout = os.dup(1)

def _hook(event, args):
    if event.startswith("socket.") or event in ("os.fork", "os.forkpty", "os.posix_spawn",
            "os.spawn", "os.system", "os.exec", "subprocess.Popen", "ctypes.dlopen",
            "ctypes.dlsym", "os.kill", "os.putenv"):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and len(args) >= 2 and isinstance(args[0], (str, bytes)):
        mode, flags = args[1], (args[2] if len(args) > 2 else 0) or 0
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags & 3) != 0
        if writing:
            p = args[0].decode() if isinstance(args[0], bytes) else args[0]
            full = os.path.realpath(os.path.join(root, p))
            if not (full == root or full.startswith(root + os.sep)):
                raise PermissionError(f"sandbox: writing {p} outside the working directory")
    if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.chmod"):
        p = args[0]
        if isinstance(p, (str, bytes)):
            p = p.decode() if isinstance(p, bytes) else p
            full = os.path.realpath(os.path.join(root, p))
            if not (full == root or full.startswith(root + os.sep)):
                raise PermissionError(f"sandbox: {event} on {p} outside the working directory")

sys.addaudithook(_hook)
passed, errors = 0, []
for t in tests:
    ns = {"__name__": "__main__"}
    out = io.StringIO()
    old_in, old_out = sys.stdin, sys.stdout
    try:
        if isinstance(t, dict):
            sys.stdin, sys.stdout = io.StringIO(t.get("input", "")), out
            exec(compile(code, "<completion>", "exec"), ns)
            sys.stdin, sys.stdout = old_in, old_out
            ok = out.getvalue().strip() == str(t.get("output", "")).strip()
        else:
            sys.stdout = out
            exec(compile(code, "<completion>", "exec"), ns)
            exec(compile(t, "<test>", "exec"), ns)
            ok = True
    except BaseException as e:  # SystemExit, MemoryError, PermissionError from the hook, ...
        ok = False
        errors.append(f"{type(e).__name__}: {e}"[:200])
    finally:
        sys.stdin, sys.stdout = old_in, old_out
    passed += ok
os.write(real_stdout, ("\n" + nonce + json.dumps({"passed": passed, "errors": errors[:5]}) + "\n").encode())
'''


@dataclass
class SandboxResult:
    passed: int
    total: int
    status: str  # ok | timeout | crashed
    errors: list[str] = field(default_factory=list)

    @property
    def fraction_passed(self) -> float:
        return self.passed / self.total if self.total else 0.0


def run_tests(code: str, tests: list, *, timeout_s: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    tests = list(tests or [])
    if not tests:
        return SandboxResult(0, 0, "ok", ["no tests"])
    workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    nonce = "@@" + secrets.token_hex(16) + "@@"
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    payload = json.dumps({"nonce": nonce, "code": code, "tests": tests,
                          "cpu_s": max(1, int(timeout_s)), "memory_mb": memory_mb})
    proc = subprocess.Popen([sys.executable, "-I", "-c", HARNESS], cwd=workdir, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(payload.encode(), timeout=timeout_s + 2)
        status = "ok"
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        status = "timeout"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = out.decode(errors="replace")
    idx = text.rfind(nonce)
    if idx < 0:
        status = "timeout" if status == "timeout" or proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL) \
            else "crashed"
        return SandboxResult(0, len(tests), status, [err.decode(errors="replace")[-300:]])
    result = json.loads(text[idx + len(nonce):].splitlines()[0])
    return SandboxResult(int(result["passed"]), len(tests), status, result["errors"])
