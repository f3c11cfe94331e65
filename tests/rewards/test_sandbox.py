"""The code sandbox tried as an attacker would.

Every attack is written so that its test passes only if the attack worked (the test asserts the
escape, or a stdin/stdout test expects the stolen secret as output): a contained attack scores 0.
Each one also checks the host side: the victim files are intact, the secret was not read, the
trainer (this process) is alive, and no process of the attack is left running.

Attacks run twice, with the inner Python audit hook and without it: the operating-system layers
(namespaces, read-only binds, seccomp, rlimits) must hold on their own.
"""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest

from posttrain.errors import UserError
from posttrain.sandbox import (DENIED, SYSCALLS, Limits, SandboxUnavailable, SandboxWarning,
                             check_isolation, run_many, run_tests, seccomp_filter)

# Linux is all this needs (bubblewrap ships with the package); where it cannot start, these fail
# with the reason rather than skip.
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the OS sandbox is Linux-only")
HOOK = pytest.mark.parametrize("hook", [True, False], ids=["with_hook", "os_only"])
SECRET = "posttrain-fake-credential-" + uuid.uuid4().hex


def attack(code: str, test: str = "assert escaped", *, hook: bool, **kw):
    """Run `code` (which sets `escaped`) and a test that passes only when the attack succeeded."""
    r = run_tests(textwrap.dedent(code), [textwrap.dedent(test)], audit_hook=hook, **kw)
    assert r.fraction_passed == 0.0, f"attack succeeded: {r}"
    return r


def host_processes_with(marker: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker.encode() in (p / "cmdline").read_bytes():
                found.append(int(p.name))
        except OSError:
            pass
    return found


@pytest.fixture
def victim(tmp_path):
    """A directory of the host with a file in it, as a checkpoint or config would be."""
    d = tmp_path / "run"
    d.mkdir()
    f = d / "checkpoint.txt"
    f.write_text("original")
    os.chmod(f, 0o644)
    yield f
    assert f.read_text() == "original" and oct(f.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in d.iterdir()) == ["checkpoint.txt"]


@pytest.fixture
def credentials(tmp_path):
    """A fake credential in the user's home and one in a run directory (both readable by the user)."""
    home = Path.home() / f".posttrain-test-credential-{uuid.uuid4().hex[:8]}"
    run = tmp_path / "runs" / "exp" / "credential"
    run.parent.mkdir(parents=True)
    for f in (home, run):
        f.write_text(SECRET)
    yield [str(home), str(run)]
    home.unlink()


# ---- identity and view --------------------------------------------------------------------
def test_the_child_sees_a_minimal_unprivileged_world():
    checks = """
    import os, socket
    assert os.getuid() == 65534 and os.getgid() == 65534 and os.geteuid() == 65534
    status = open('/proc/self/status').read()
    for cap in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb'):
        assert f'{cap}:\\t0000000000000000' in status, cap
    assert 'NoNewPrivs:\\t1' in status and 'Seccomp:\\t2' in status
    assert socket.gethostname() == 'sandbox'
    assert [n for _, n in socket.if_nameindex()] == ['lo']
    assert os.getcwd() == '/work' and os.listdir('/work') == []
    assert set(os.listdir('/')) <= {'bin', 'dev', 'etc', 'lib', 'lib32', 'lib64', 'libx32',
                                    'proc', 'root', 'sbin', 'tmp', 'usr', 'work'}, os.listdir('/')
    pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
    assert pids[0] == 1 and len(pids) <= 4, pids   # bwrap's init, the harness, this test
    try:  # a new session without a controlling terminal (no TIOCSTI into the trainer's tty)
        open('/dev/tty').close()
        assert False, 'has a controlling terminal'
    except OSError:
        pass
    assert set(os.environ) <= {'PATH', 'HOME', 'LANG', 'PYTHONHASHSEED', 'PWD'}, os.environ
    """
    r = run_tests("", [textwrap.dedent(checks)], audit_hook=False)
    assert r.fraction_passed == 1.0, r.errors


def test_seccomp_filter_denies_each_listed_syscall_in_the_kernel():
    arch = os.uname().machine
    nums = {name: SYSCALLS[arch][name] for name in DENIED if name in SYSCALLS[arch]}
    test = f"""
    import ctypes, errno
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def call(nr, *args):
        ctypes.set_errno(0)
        rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
        return rc, ctypes.get_errno()
    for name, nr in {nums!r}.items():
        assert call(nr) == (-1, errno.EPERM), (name, call(nr))
    assert call({SYSCALLS[arch]['clone3']}) == (-1, errno.ENOSYS)
    for flag in (0x10000000, 0x40000000, 0x20000, 0x20000000):  # NEWUSER, NEWNET, NEWNS, NEWPID
        assert call({SYSCALLS[arch]['clone']}, flag | 17) == (-1, errno.EPERM)
    """
    r = run_tests("", [textwrap.dedent(test)], audit_hook=False)
    assert r.fraction_passed == 1.0, r.errors


def test_seccomp_program_shape():
    prog = seccomp_filter("x86_64")
    assert len(prog) % 8 == 0 and len(prog) // 8 < 4096  # BPF_MAXINSNS
    assert seccomp_filter("aarch64") != prog
    with pytest.raises(SandboxUnavailable, match="riscv"):
        seccomp_filter("riscv64")


# ---- the filesystem ---------------------------------------------------------------------------
WRITES = {
    "open": "open(V, 'w').write('pwned')",
    "os_open_trunc": "os.close(os.open(V, os.O_WRONLY | os.O_TRUNC))",
    "truncate": "os.truncate(V, 0)",
    "remove": "os.remove(V)",
    "rename": "os.rename(V, V + '.moved')",
    "rename_dir": "os.rename(os.path.dirname(V), os.path.dirname(V) + '.moved')",
    "hardlink": "os.link(V, V + '.link')",
    "symlink_write": "os.symlink(V, 'l'); open('l', 'w').write('pwned')",
    "chmod": "os.chmod(V, 0o777)",
    "utime": "os.utime(V, (0, 0))",
    "rmtree": "import shutil; shutil.rmtree(os.path.dirname(V))",
    "subprocess_sh": "import subprocess; subprocess.run(['/bin/sh', '-c', f'echo pwned > {V}'], check=True)",
    "posixsubprocess": """
        import _posixsubprocess, os
        pid = _posixsubprocess.fork_exec(['/bin/sh', '-c', f'echo pwned > {V}'], [b'/bin/sh'],
            True, (), None, None, -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, -1, None,
            None, None, -1, None, False)
        os.waitpid(pid, 0)""",
    "ctypes_syscalls": """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.truncate(V.encode(), 0) == 0 or libc.unlink(V.encode()) == 0 \\
            or libc.rename(V.encode(), (V + '.x').encode()) == 0, ctypes.get_errno()""",
}


@HOOK
@pytest.mark.parametrize("route", sorted(WRITES))
def test_host_files_cannot_be_modified(route, hook, victim):
    code = f"import os\nV = {str(victim)!r}\nescaped = False\n" + textwrap.dedent(WRITES[route]) \
        + "\nescaped = True"
    attack(code, "assert escaped and open(V).read() != 'original'", hook=hook)


@pytest.mark.skipif(not os.path.exists("/usr/bin/gcc"), reason="no compiler on this machine")
def test_native_binary_built_inside_cannot_modify_host_files(victim):
    """Native code compiled in the sandbox (gcc is under /usr, bound read-only) gets no further."""
    c = f'#include <unistd.h>\\nint main(){{return unlink("{victim}") || truncate("{victim}", 0);}}'
    code = f"""
    import subprocess
    open('x.c', 'w').write('{c}')
    subprocess.run(['gcc', 'x.c', '-o', 'x'], check=True)
    escaped = subprocess.run(['./x']).returncode == 0
    """
    attack(code, hook=False, timeout_s=20)


@HOOK
@pytest.mark.parametrize("target", ["interpreter", "usr"])
def test_read_only_binds_stay_read_only(target, hook):
    path = os.path.join(os.path.dirname(os.__file__), "os.py") if target == "interpreter" \
        else "/usr/bin/env"
    before = Path(path).read_bytes()
    attack(f"escaped = False\nopen({path!r}, 'ab').write(b'pwned')\nescaped = True", hook=hook)
    attack(f"import os\nescaped = False\nos.chmod({path!r}, 0o777)\nescaped = True", hook=hook)
    assert Path(path).read_bytes() == before


@HOOK
@pytest.mark.parametrize("route", ["open", "subprocess_cat", "ctypes", "proc_environ"])
def test_host_files_and_secrets_cannot_be_read(route, hook, credentials, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", SECRET)  # in the trainer's environment
    read = {
        "open": "print(open(p).read())",
        "subprocess_cat": "import subprocess; print(subprocess.run(['cat', p], capture_output=True, text=True).stdout)",
        "ctypes": """
            import ctypes
            libc = ctypes.CDLL(None)
            buf = ctypes.create_string_buffer(4096)
            fd = libc.open(p.encode(), 0)
            libc.read(fd, buf, 4096)
            print(buf.value.decode())""",
        "proc_environ": """
            import os
            for pid in os.listdir('/proc'):
                try:
                    print(open(f'/proc/{pid}/environ').read())
                except OSError:
                    pass
            print(os.environ.get('POSTTRAIN_TEST_SECRET', ''))""",
    }[route]
    code = f"for p in {credentials!r}:\n" + textwrap.indent(
        "try:\n" + textwrap.indent(textwrap.dedent(read), "    ") + "\nexcept Exception:\n    pass",
        "    ")
    r = run_tests(code, [{"input": "", "output": SECRET}], audit_hook=hook)
    assert r.fraction_passed == 0.0, "secret leaked"


def test_disk_fill_stops_at_the_cap():
    code = """
    import os
    written = 0
    for d in ('/work', '/tmp', '/dev/shm', '/dev'):
        try:
            with open(f'{d}/fill', 'wb') as f:
                for _ in range(1000):
                    f.write(b'x' * 1024 * 1024)
                    written += 1024 * 1024
        except OSError:
            pass
    escaped = written > 3 * 8 * 1024 * 1024
    """
    attack(code, hook=False, limits=Limits(disk_mb=8, file_mb=100))


# ---- network ----------------------------------------------------------------------------------
@HOOK
@pytest.mark.parametrize("family", ["tcp_loopback", "abstract_unix", "udp_internet", "tcp_internet"])
def test_network_is_unreachable(family, hook):
    token = uuid.uuid4().hex
    accepted = []
    server = None
    if family == "tcp_loopback":
        server = socket.create_server(("127.0.0.1", 0))
        target = f"socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)"
    elif family == "abstract_unix":
        server = socket.socket(socket.AF_UNIX)
        name = "\0posttrain-test-" + token
        server.bind(name)
        server.listen()
        target = f"(lambda s: (s.connect({name!r}), s)[1])(socket.socket(socket.AF_UNIX))"
    elif family == "udp_internet":
        target = "(lambda s: (s.sendto(b'x', ('8.8.8.8', 53)), s)[1])(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))"
    else:
        target = "socket.create_connection(('1.1.1.1', 80), timeout=2)"
    if server is not None:
        server.settimeout(0.2)

        def serve():
            end = time.monotonic() + 8
            while time.monotonic() < end:
                try:
                    conn, _ = server.accept()
                    accepted.append(conn)
                    conn.sendall(token.encode())
                except OSError:
                    pass
        t = threading.Thread(target=serve, daemon=True)
        t.start()
    code = f"import socket\nescaped = False\ns = {target}\nescaped = True"
    attack(code, hook=hook)
    if server is not None:
        server.close()
    assert not accepted


# ---- processes, signals, limits ---------------------------------------------------------------
SPAWNS = {
    "subprocess": "import subprocess; subprocess.Popen(['/bin/sh', '-c', CMD])",
    "os_system": "import os; os.system(CMD + ' &')",
    "os_fork_exec": "import os\nif os.fork() == 0:\n    os.execv('/bin/sh', ['/bin/sh', '-c', CMD])",
    "posix_spawn": "import os; os.posix_spawn('/bin/sh', ['/bin/sh', '-c', CMD], {})",
    "posixsubprocess": """
        import _posixsubprocess, os
        _posixsubprocess.fork_exec(['/bin/sh', '-c', CMD], [b'/bin/sh'], True, (), None, None,
            -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, -1, None, None, None, -1, None, False)""",
    "ctypes_fork": """
        import ctypes, os
        libc = ctypes.CDLL(None)
        if libc.fork() == 0:
            libc.execv(b'/bin/sh', (ctypes.c_char_p * 4)(b'/bin/sh', b'-c', CMD.encode(), None))""",
}


@HOOK
@pytest.mark.parametrize("route", sorted(SPAWNS))
def test_spawned_processes_stay_inside_and_die_with_the_call(route, hook, victim, credentials):
    """A process created by any route (some raise no audit event) is a daemon that ignores SIGTERM,
    tries to leave the session, read the home credential and overwrite the host file for 3 s; it
    gets none of that and is gone when the call returns."""
    marker = "posttrain-marker-" + uuid.uuid4().hex[:8]
    cmd = (f"trap '' TERM HUP; for i in 1 2 3 4 5 6; do cat {credentials[0]} > /work/got; "
           f"echo pwned > {victim}; sleep 0.5; done; : {marker}")
    code = f"CMD = {cmd!r}\n" + textwrap.dedent(SPAWNS[route]) + "\nimport time; time.sleep(0.3)"
    test = f"import os\nassert open({str(victim)!r}).read() == 'pwned\\n' or " \
           f"open('/work/got').read() == {SECRET!r}"
    attack(code, test, hook=hook)
    assert not host_processes_with(marker)
    time.sleep(1.0)  # had anything survived, it would write again
    assert not host_processes_with(marker)


def test_a_killed_trainer_leaves_nothing_running(tmp_path):
    """SIGKILL the process that runs the sandbox (a trainer dying mid-call): the sandbox and the
    SIGTERM-ignoring daemon it started die with it."""
    marker = "posttrain-marker-" + uuid.uuid4().hex[:8]
    code = ("import subprocess, time\n"
            f"subprocess.Popen(['/bin/sh', '-c', \"trap '' TERM HUP; sleep 60; : {marker}\"], "
            "start_new_session=True)\ntime.sleep(60)")
    script = tmp_path / "trainer.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
                      "from posttrain.sandbox import run_tests\n"
                      f"run_tests({code!r}, ['assert True'], timeout_s=60, audit_hook=False)\n")
    trainer = subprocess.Popen([sys.executable, str(script)])
    for _ in range(100):
        if host_processes_with(marker):
            break
        time.sleep(0.1)
    assert host_processes_with(marker), "the daemon never started"
    trainer.kill()
    trainer.wait()
    for _ in range(50):
        if not host_processes_with(marker):
            break
        time.sleep(0.1)
    assert not host_processes_with(marker)


@HOOK
def test_double_forked_daemon_cannot_outlive_its_test(hook):
    """A setsid'd grandchild that ignores SIGTERM is killed between tests, so it cannot do the next
    test's work for it (here: create the file the second test checks for)."""
    first = """
    import ctypes, os, signal, time
    libc = ctypes.CDLL(None)
    if libc.fork() == 0:
        os.setsid()
        if libc.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(0.5)
            open('/tmp/daemon-was-here', 'w').close()
            os._exit(0)
        os._exit(0)
    assert False
    """
    second = "import os, time; time.sleep(1.0); assert os.path.exists('/tmp/daemon-was-here')"
    r = run_tests("", [textwrap.dedent(first), second], audit_hook=hook)
    assert r.fraction_passed == 0.0, r


@HOOK
def test_fork_bomb_is_contained(hook):
    before = len([p for p in os.listdir("/proc") if p.isdigit()])
    t = time.monotonic()
    code = "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()" if not hook \
        else "import os\nwhile True:\n    os.fork()"
    attack(code, "assert True", hook=hook, timeout_s=3)
    assert time.monotonic() - t < 10
    for _ in range(50):  # the kernel tears the namespace down asynchronously
        if len([p for p in os.listdir("/proc") if p.isdigit()]) < before + 5:
            break
        time.sleep(0.1)
    assert len([p for p in os.listdir("/proc") if p.isdigit()]) < before + 5


@HOOK
def test_memory_bomb_is_contained(hook):
    code = """
    import ctypes, os
    libc = ctypes.CDLL(None)
    for _ in range(4):  # several processes, each capped
        libc.fork()
    x = bytearray(2 * 1024 ** 3)
    escaped = True
    """
    r = attack(code, hook=hook, memory_mb=256)
    assert any("MemoryError" in e or "not allowed" in e for e in r.errors), r.errors


@pytest.mark.parametrize("stream", ["print", "stderr", "raw_fd", "subprocess"])
def test_output_flood_is_cut_off(stream):
    flood = {
        "print": "while True:\n    print('x' * 65536)",
        "stderr": "import sys\nwhile True:\n    sys.stderr.write('x' * 65536)",
        "raw_fd": "import os\nwhile True:\n    os.write(1, b'x' * 65536)",
        "subprocess": "import subprocess\nsubprocess.run(['/bin/sh', '-c', 'yes xxxxxxxxxxxxxxxx'])",
    }[stream]
    t = time.monotonic()
    r = run_tests(flood, [{"input": "", "output": "x"}], audit_hook=False,
                  limits=Limits(wall_s=20, output_kb=256))
    assert r.fraction_passed == 0.0 and r.errors == ["output_limit"]
    assert time.monotonic() - t < 10  # cut at the cap, not at the wall limit


@HOOK
@pytest.mark.parametrize("target", ["trainer_pid", "everyone", "parent", "process_group"])
def test_signals_cannot_reach_the_trainer(target, hook):
    me = os.getpid()
    kill = {"trainer_pid": f"os.kill({me}, signal.SIGKILL)", "everyone": "os.kill(-1, signal.SIGKILL)",
            "parent": "os.kill(os.getppid(), signal.SIGKILL)",
            "process_group": f"os.killpg({os.getpgid(0)}, signal.SIGKILL)"}[target]
    code = f"import ctypes, os, signal\nescaped = False\n{kill}\nimport time; time.sleep(0.2)"
    attack(code, hook=hook)
    assert os.getpid() == me  # still here: a SIGKILL would have ended this test run


@HOOK
def test_cpu_spin_is_stopped_at_the_limit(hook):
    t = time.monotonic()
    r = attack("while True:\n    pass", "assert True", hook=hook,
               limits=Limits(wall_s=30, cpu_s=1))
    assert time.monotonic() - t < 5, "stopped by RLIMIT_CPU, not by the 30 s wall limit"
    assert r.status == "ok"
    r = attack("import time\ntime.sleep(60)", "assert True", hook=hook, timeout_s=1)
    assert r.status == "timeout"


def test_forging_the_result_does_not_score():
    """The harness alone counts passes: printing a fake result, exiting early with status 0, or
    reading the expected output out of the harness's memory earns nothing."""
    forgeries = [
        "import os\nos._exit(0)",
        "import sys\nsys.exit(0)",
        "import json, os\nos.write(1, json.dumps([[None, None]] * 5).encode())\nos._exit(0)",
        "import sys, gc\nfor o in gc.get_objects():\n    if isinstance(o, dict) and 'output' in o:"
        "\n        print(o['output'])",
        "import sys\nf = sys._getframe()\nwhile f:\n    for v in f.f_globals.values():\n"
        "        if isinstance(v, list):\n            print(v)\n    f = f.f_back",
    ]
    for code in forgeries:
        assert run_tests(code, ["assert False"], audit_hook=False).fraction_passed == 0.0, code
        r = run_tests(code, [{"input": "", "output": "the-expected-answer"}], audit_hook=False)
        assert r.fraction_passed == 0.0, code


# ---- legitimate solutions, the fallback, the pool ---------------------------------------------
LEGIT = [
    ("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]),
    ("import sys\nn = int(sys.stdin.readline())\nprint(sum(range(n + 1)))",
     [{"input": "10\n", "output": "55"}, {"input": "3\n", "output": "6\n"}]),
    ("import sys\nprint(input()[::-1])\nsys.exit(0)", [{"input": "abc", "output": "cba"}]),
    ("import math, itertools, collections, re, json, functools, heapq, bisect, tempfile\n"
     "def f(xs):\n    with tempfile.TemporaryFile() as t:\n        t.write(b'x')\n"
     "    return sorted(collections.Counter(xs).most_common(1))[0][0]",
     ["assert f([1, 2, 2, 3]) == 2"]),
    ("import threading\nout = []\nt = threading.Thread(target=lambda: out.append(1))\n"
     "t.start(); t.join()", ["assert out == [1]"]),
    ("open('scratch.txt', 'w').write('42')", ["assert open('scratch.txt').read() == '42'"]),
]


@pytest.mark.parametrize("isolation", ["os", "process"])
@pytest.mark.parametrize("i", range(len(LEGIT)))
def test_legitimate_solutions_pass(i, isolation):
    code, tests = LEGIT[i]
    r = run_tests(code, tests, isolation=isolation)
    assert r.fraction_passed == 1.0, r.errors


def test_tests_are_independent_processes():
    """One test's crash or state does not decide another's."""
    code = "import os\nN = int(os.environ.get('X', '1'))"
    r = run_tests(code, ["import os; os._exit(3)", "assert N == 1", "import os; os.environ['X'] = '2'",
                         "assert N == 1"])
    assert (r.passed, r.total) == (2, 4)


def test_process_isolation_keeps_its_audit_hook_and_cleans_up(tmp_path):
    """The weaker fallback: the audit hook is its guard (with a readable error), its temp dir goes."""
    target = tmp_path / "escaped.txt"
    r = run_tests(f"open({str(target)!r}, 'w').write('x')", ["assert True"], isolation="process")
    assert r.fraction_passed == 0.0 and not target.exists()
    assert "outside the working directory" in r.errors[0]
    r = run_tests("import socket\nsocket.socket().connect(('127.0.0.1', 22))", ["assert True"],
                  isolation="process")
    assert r.fraction_passed == 0.0 and "not allowed" in r.errors[0]
    assert not list(Path(tempfile.gettempdir()).glob("posttrain-sandbox-[!r]*"))


def test_run_many_in_parallel_keeps_order():
    codes = [f"def f():\n    return {i}" for i in range(6)]
    results = run_many(codes, [[f"assert f() == {i}"] for i in [0, 1, 9, 3, 4, 9]], parallel=3)
    assert [r.fraction_passed for r in results] == [1, 1, 0, 1, 1, 0]


def test_process_isolation_warns_and_unknown_isolation_fails():
    with pytest.warns(SandboxWarning, match="isolation=process"):
        check_isolation("process")
    with pytest.raises(UserError, match="expected one of"):
        check_isolation("none")
    with pytest.raises(UserError, match="expected one of"):  # no silent fallback to the weak mode
        run_tests("pass", ["assert True"], isolation="OS")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_isolation("os")


def test_refuses_with_the_cause_and_fix_when_bubblewrap_cannot_start(monkeypatch, tmp_path):
    """A machine without unprivileged user namespaces, simulated by a bwrap that fails the way the
    real one does there; the code reward then refuses to run (exit 2 from the CLI: a UserError)."""
    import posttrain.sandbox as sb

    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace, likely because "
                    "the kernel does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    fake.chmod(0o755)
    real = sb.runtime()
    monkeypatch.setattr(sb, "runtime", lambda: dataclasses.replace(real, bwrap=str(fake), run_as=None))
    sb.unavailable_reason.cache_clear()
    try:
        reason = sb.unavailable_reason()
        assert "user namespaces" in reason and "max_user_namespaces" in reason
        assert "isolation: process" in reason
        with pytest.raises(SandboxUnavailable, match="No permissions to create new namespace"):
            run_tests("pass", ["assert True"])
        from posttrain.config import RewardsSection
        from rewards.pool import RewardPool

        with pytest.raises(SandboxUnavailable):
            RewardPool(RewardsSection(functions=[{"fn": "code"}]))
        with pytest.warns(SandboxWarning):
            RewardPool(RewardsSection(functions=[{"fn": "code", "kwargs": {"isolation": "process"}}])).close()
    finally:
        sb.unavailable_reason.cache_clear()


def test_a_sandbox_that_stops_starting_mid_run_is_an_error_not_a_zero(monkeypatch, tmp_path):
    """Availability was checked at start-up; if bwrap later fails (a changed sysctl, a removed
    binary), every completion scoring 0 would look like a slow learner: it raises instead, which
    the reward pool counts as an error."""
    import posttrain.sandbox as sb

    assert sb.unavailable_reason() is None
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    real = sb.runtime()
    monkeypatch.setattr(sb, "runtime", lambda: dataclasses.replace(real, bwrap=str(fake), run_as=None))
    with pytest.raises(RuntimeError, match="failed to start: bwrap: setting up uid map"):
        run_tests("pass", ["assert True"])


def test_reward_pool_scores_hostile_and_honest_code_side_by_side(victim):
    from posttrain.config import RewardsSection
    from rewards.pool import RewardPool

    honest = "```python\ndef add(a, b):\n    return a + b\n```"
    hostile = f"```python\nimport os\nos.remove({str(victim)!r})\ndef add(a, b):\n    return a + b\n```"
    bomb = "```python\nimport os\nwhile True:\n    os.fork()\n```"
    tests = [["assert add(1, 2) == 3"]] * 3
    with RewardPool(RewardsSection(functions=[{"fn": "code", "kwargs": {"timeout_s": 2}}])) as pool:
        scores = pool.score(["q"] * 3, [honest, hostile, bomb], {"tests": tests})
    assert scores.totals.tolist() == [1.0, 0.0, 0.0]
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0  # the host still forks
    assert signal.getsignal(signal.SIGTERM) is not None
