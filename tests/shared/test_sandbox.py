"""The code-execution sandbox and the `python_exec` reward: hostile programs end within their limits
and score 0.0; each OS layer is also checked with the in-process audit hook switched off."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from shared import sandbox
from shared.rewards import extract_program, python_exec
from shared.sandbox import Limits, run_python

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
    # In CI (root, util-linux unshare) the network block must be the namespace, not the hook.
    res = run("print('hi')")
    assert res.ok and res.stdout == "hi\n"
    if os.geteuid() == 0:
        assert res.isolation == "namespaces"


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
    assert 1.0 <= res.wall_s < 2.5


@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(10 ** 10)\n",  # one huge allocation
        "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n",  # creeping growth
    ],
)
def test_memory_bomb_is_stopped(code: str) -> None:
    res = run(code, Limits(wall_s=5.0, memory_bytes=256 * 1024 * 1024), guard=False)
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
    else:  # the namespace alone: its loopback is down, nothing to connect to
        assert res.isolation == "namespaces" and "Network is unreachable" in res.stderr
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
    if os.geteuid() == 0:
        # Without the hook the unprivileged uid still cannot touch root's files.
        res = run(f"open({str(victim)!r}, 'w').write('owned')\n", guard=False)
        assert "PermissionError" in res.stderr and victim.read_text() == "intact"


def test_own_directory_is_writable_but_files_are_capped() -> None:
    ok = run("open('scratch.txt', 'w').write('x' * 1000)\nprint(len(open('scratch.txt').read()))\n")
    assert ok.ok and ok.stdout.strip() == "1000"
    big = run("open('big.bin', 'wb').write(b'x' * (10 * 1024 * 1024))\n", Limits(file_bytes=1024 * 1024))
    assert not big.ok and "File too large" in big.stderr
    # Endless output stops at the same cap (stdout is a file) and only its tail comes back.
    flood = run("while True:\n    print('y' * 1000)\n", Limits(wall_s=3.0, file_bytes=1024 * 1024))
    assert not flood.ok and len(flood.stdout) <= Limits().output_bytes


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
