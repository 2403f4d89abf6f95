"""The code-execution sandbox and the `python_exec` reward: hostile programs end within their limits
and score 0.0; each OS layer is also checked with the in-process audit hook switched off. The
escapes a security review found are in tests/test_sandbox_hostile.py."""

from __future__ import annotations

import os
import struct
import subprocess
import time

import pytest

from shared import sandbox
from shared.rewards import extract_program, python_exec
from shared.sandbox import Limits, SandboxUnavailable, run_python, seccomp_filter

# A uid nothing else on the machine runs as, so leftovers are attributable (root callers only).
TEST_UID = 2_000_000_123
FAST = Limits(wall_s=3.0, cpu_s=1)


def leftovers(uid: int = TEST_UID) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=,cmd=", "-u", str(uid)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def run(code: str, limits: Limits = FAST, **kw) -> sandbox.Result:
    res = run_python(code, limits, uid=TEST_UID, **kw)
    assert res.wall_s < limits.wall_s + 2.0, res  # killed on time, whatever the program did
    assert leftovers() == []  # nothing it started outlives it
    return res


def test_isolation_in_use() -> None:
    # Kernel confinement or nothing: without bwrap run_python raises unless told otherwise.
    res = run("print('hi')")
    assert res.ok and res.stdout == "hi\n"
    assert res.isolation == "bwrap"


def test_without_kernel_confinement_it_refuses_unless_told(monkeypatch) -> None:
    monkeypatch.setattr(sandbox, "_BWRAP", "/nonexistent/bwrap")
    sandbox._confinement_error.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="bubblewrap.*ASYNCRL_SANDBOX_UNCONFINED=1"):
            run_python("print(1)")
        monkeypatch.setenv(sandbox.UNCONFINED_ENV, "1")
        res = run("print(open('main.py').read())")
        assert res.ok and res.isolation == "audit-hook" and "main.py" in res.stdout
        assert "sandbox: os.fork" in run("import os\nos.fork()\n").stderr  # the hook still holds
    finally:
        sandbox._confinement_error.cache_clear()


def bpf_action(prog: bytes, arch: int, nr: int) -> int:
    """A reference interpreter for the few classic-BPF instructions the filter uses."""
    ins = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    data = struct.pack("=iI", nr, arch)
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = ins[pc]
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x15:  # BPF_JMP | BPF_JEQ | BPF_K
            pc += jt if acc == k else jf
        elif code == 0x35:  # BPF_JMP | BPF_JGE | BPF_K
            pc += jt if acc >= k else jf
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        pc += 1


def test_seccomp_filter_denies_exec_and_foreign_abis() -> None:
    eperm, allow, kill = 0x00050001, 0x7FFF0000, 0x80000000
    x86 = seccomp_filter("x86_64")
    assert bpf_action(x86, 0xC000003E, 59) == eperm  # execve
    assert bpf_action(x86, 0xC000003E, 322) == eperm  # execveat
    assert bpf_action(x86, 0xC000003E, 250) == eperm  # keyctl
    assert bpf_action(x86, 0xC000003E, 0x40000000 + 59) == eperm  # x32 ABI
    assert bpf_action(x86, 0xC000003E, 57) == allow  # fork
    assert bpf_action(x86, 0xC000003E, 0) == allow  # read
    assert bpf_action(x86, 0x40000003, 11) == kill  # i386 execve
    arm = seccomp_filter("aarch64")
    assert bpf_action(arm, 0xC00000B7, 221) == eperm and bpf_action(arm, 0xC00000B7, 59) == allow
    with pytest.raises(SandboxUnavailable, match="known: \\['aarch64', 'x86_64'\\]"):
        seccomp_filter("riscv64")


def test_exec_is_refused_by_the_kernel() -> None:
    res = run("import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'print(1)'])\n", guard=False)
    assert not res.ok and "PermissionError: [Errno 1] Operation not permitted" in res.stderr


def test_correct_and_wrong_programs() -> None:
    prog = "```python\ndef f(n):\n    return sum(range(n + 1))\nprint('working...')\nprint(f(10))\n```"
    assert python_exec(prog, "55") == 1.0
    assert python_exec(prog, "56") == 0.0
    assert python_exec("print(2 + 2)", "4") == 1.0  # no fence: the whole completion is the program
    assert python_exec("Let me think.\n```py\nprint(3)\n```\nThen:\n```\nprint(4.0)\n```", "4") == 1.0
    assert python_exec("print(4); raise SystemExit(1)", "4") == 0.0  # must exit normally
    assert python_exec("```python\nprint(4\n```", "4") == 0.0  # syntax error
    assert python_exec("", "4") == 0.0


def test_extract_program_takes_the_last_block() -> None:
    assert extract_program("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_program("no code here") == "no code here"


@pytest.mark.parametrize("guard", [True, False])
def test_infinite_loop_is_killed(guard: bool) -> None:
    t0 = time.monotonic()
    res = run("while True:\n    pass\n", Limits(wall_s=3.0, cpu_s=1), guard=guard)
    assert not res.ok
    # RLIMIT_CPU (1 s of CPU) or the wall clock (3 s), whichever comes first on a busy machine.
    assert time.monotonic() - t0 < 5.0
    assert python_exec("while True: pass", "1") == 0.0


@pytest.mark.parametrize("guard", [True, False])
def test_sleeping_program_is_killed_at_the_wall_clock(guard: bool) -> None:
    res = run("import time\ntime.sleep(60)\n", Limits(wall_s=1.0), guard=guard)
    assert res.timed_out and not res.ok
    assert 1.0 <= res.wall_s < 5.0  # killed at 1 s, not at the program's 60 s (room for a loaded box)


@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(10 ** 10)\n",  # one huge allocation
        "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n",  # creeping growth
    ],
)
def test_memory_bomb_is_stopped(code: str) -> None:
    res = run(code, Limits(wall_s=30.0, memory_bytes=256 * 1024 * 1024), guard=False)
    assert not res.ok and not res.timed_out
    assert "MemoryError" in res.stderr
    assert python_exec(code + "print(1)\n", "1") == 0.0


def test_fork_bomb_is_contained() -> None:
    # Without the hook (which refuses os.fork outright) RLIMIT_NPROC caps the bomb; the PID
    # namespace takes every fork down with the program.
    bomb = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as exc:\n"
        "    print('forks', n, type(exc).__name__, flush=True)\n"
        "time.sleep(60)\n"
    )
    limits = Limits(wall_s=2.0, processes=8)
    res = run(bomb, limits, guard=False)
    assert res.timed_out
    forks = int(res.stdout.split()[1])
    assert 0 < forks < limits.processes, res.stdout
    guarded = run(bomb, limits)
    assert "forks 0 PermissionError" in guarded.stdout
    assert python_exec("import os\nwhile True:\n    os.fork()\n", "1") == 0.0


def test_escaping_the_process_group_does_not_survive() -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')\n"
    res = run(code, guard=False)  # `run` asserts no process of the uid is left
    assert res.ok and "parent done" in res.stdout


@pytest.mark.parametrize("guard", [True, False])
def test_no_network(guard: bool) -> None:
    code = "import socket\nsocket.create_connection(('127.0.0.1', 6379), timeout=2)\nprint('connected')\n"
    res = run(code, guard=guard)
    assert not res.ok and "connected" not in res.stdout
    if guard:
        assert "sandbox: socket" in res.stderr
    else:  # the namespace alone: a loopback of its own, nothing listening on it
        assert res.isolation == "bwrap" and "Connection refused" in res.stderr
    assert python_exec(code.replace("print('connected')", "print(1)"), "1") == 0.0


def test_writes_outside_the_sandbox_fail(tmp_path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("intact")
    os.chmod(tmp_path, 0o755)
    for code in [
        f"open({str(victim)!r}, 'w').write('owned')\n",
        "open('/etc/asyncrl-sandbox-test', 'w').write('x')\n",
        "import os\nos.remove('/etc/hostname')\n",
        "open('/tmp/asyncrl-sandbox-escape', 'w').write('x')\n",
        "import os\nos.mkdir('/tmp/asyncrl-sandbox-escape-dir')\n",
    ]:
        res = run(code)
        assert not res.ok, code
        assert "PermissionError" in res.stderr, (code, res.stderr)
    assert victim.read_text() == "intact"
    assert not os.path.exists("/etc/asyncrl-sandbox-test")
    assert not os.path.exists("/tmp/asyncrl-sandbox-escape")
    assert not os.path.exists("/tmp/asyncrl-sandbox-escape-dir")
    # Without the hook the host's files are not even there (a mount namespace of the sandbox's own).
    res = run(f"open({str(victim)!r}, 'w').write('owned')\n", guard=False)
    assert "FileNotFoundError" in res.stderr and victim.read_text() == "intact"


def test_own_directory_is_writable_but_files_are_capped() -> None:
    ok = run("open('scratch.txt', 'w').write('x' * 1000)\nprint(len(open('scratch.txt').read()))\n")
    assert ok.ok and ok.stdout.strip() == "1000"
    big = run("open('big.bin', 'wb').write(b'x' * (10 * 1024 * 1024))\n", Limits(file_bytes=1024 * 1024))
    assert not big.ok and "File too large" in big.stderr
    # Endless output is killed at the same cap and only its tail comes back.
    flood = run("while True:\n    print('y' * 1000)\n", Limits(wall_s=3.0, file_bytes=1024 * 1024))
    assert not flood.ok and not flood.timed_out and len(flood.stdout) <= Limits().output_bytes
    assert "passed 1048576 bytes" in flood.stderr
    # Both streams at once, more than a pipe buffer each: drained together, no deadlock.
    both = run("import sys\nfor _ in range(2000):\n    print('o' * 100)\n    print('e' * 100, file=sys.stderr)\n")
    assert both.ok and len(both.stdout) == len(both.stderr) == Limits().output_bytes
    assert both.stdout.endswith("o" * 100 + "\n") and both.stderr.endswith("e" * 100 + "\n")


def test_tmpfs_is_capped() -> None:
    res = run(
        "import errno\nn = 0\ntry:\n    for i in range(100):\n"
        "        open(f'/tmp/f{i}', 'wb').write(b'x' * 900_000)\n        n += 1\n"
        "except OSError as exc:\n    print(n, errno.errorcode[exc.errno])\n",
        Limits(tmpfs_bytes=4 * 1024 * 1024),
        guard=False,
    )
    assert res.ok and res.stdout.split()[1] == "ENOSPC" and int(res.stdout.split()[0]) <= 5


def test_closing_its_output_does_not_escape_the_wall_clock() -> None:
    res = run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)\n", Limits(wall_s=1.0), guard=False)
    assert res.timed_out and not res.ok


def test_environment_is_empty() -> None:
    os.environ["ASYNCRL_SANDBOX_SECRET"] = "s3cret"
    try:
        res = run("import os, sys\nprint(dict(os.environ))\nprint(sys.flags.isolated, sys.flags.no_site)\n")
    finally:
        del os.environ["ASYNCRL_SANDBOX_SECRET"]
    assert "s3cret" not in res.stdout
    assert res.stdout.splitlines()[-1] == "1 1"


def test_ctypes_is_refused() -> None:
    res = run("import ctypes\n")
    assert not res.ok and "ctypes is not allowed" in res.stderr
