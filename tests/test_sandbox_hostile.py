"""Hostile programs against the `python_exec` sandbox: each escape a security review found, tried
with the audit hook on (as the reward runs it) and off (the kernel layers alone), asserting the host
is untouched and nothing of it was read. The last test records the tally in results/hostile.json."""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostile_results import record_hostile

from shared.rewards import python_exec
from shared.sandbox import Limits, Result, run_python, sandbox_python

pytestmark = [pytest.mark.hostile]

REPO = Path(__file__).resolve().parent.parent
GUARDS = pytest.mark.parametrize("guard", [True, False], ids=["hook", "kernel-only"])
BLOCKED: dict[str, bool] = {}  # bypass -> blocked; filled by each test, tallied by the last one


@contextlib.contextmanager
def bypass(name: str) -> Iterator[None]:
    """Counts as blocked only if the block runs to its end (every assertion held)."""
    BLOCKED[name] = False
    yield
    BLOCKED[name] = True


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A world-writable directory on the host, as /tmp is: anyone may write there, except a sandbox."""
    d = Path(tempfile.mkdtemp(prefix="asyncrl-hostile-", dir="/tmp"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def sandboxed(code: str, guard: bool = True) -> Result:
    res = run_python(code, Limits(), guard=guard)
    assert not res.timed_out, res
    return res


@GUARDS
def test_chdir_then_relative_write(host_dir: Path, guard: bool) -> None:
    # The hook resolved relative paths against the starting directory, not the current one.
    code = f"import os\nos.chdir({str(host_dir)!r})\nopen('owned.txt', 'w').write('owned')\nprint('wrote')\n"
    with bypass(f"chdir-relative-open[{guard}]"):
        res = sandboxed(code, guard)
        assert "wrote" not in res.stdout and not res.ok
        assert list(host_dir.iterdir()) == []


@GUARDS
def test_write_through_a_directory_fd(host_dir: Path, guard: bool) -> None:
    # The open audit event carries no dir_fd: a relative name looks like one inside the sandbox.
    code = (
        "import os\n"
        f"fd = os.open({str(host_dir)!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
        "w = os.open('owned.txt', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)\n"
        "os.write(w, b'owned')\nprint('wrote')\n"
    )
    with bypass(f"dir-fd-open[{guard}]"):
        res = sandboxed(code, guard)
        assert "wrote" not in res.stdout and not res.ok
        assert list(host_dir.iterdir()) == []


@GUARDS
def test_proc_self_mem_is_not_writable(guard: bool) -> None:
    # Writing its own memory would let a program patch the audit hook (or anything) away. Here it
    # overwrites a bytes object's payload: PyBytesObject is refcnt, type, size, hash (4 x 8 bytes
    # on 64-bit CPython), then the bytes.
    code = (
        "import os\n"
        "s = bytes(bytearray(b'intact'))\n"
        "os.chdir('/proc/self')\n"
        "with open('mem', 'r+b', buffering=0) as f:\n"
        "    f.seek(id(s) + 32)\n"
        "    f.write(b'owned!')\n"
        "print(s)\n"
    )
    with bypass(f"proc-self-mem[{guard}]"):
        res = sandboxed(code, guard)
        assert "owned" not in res.stdout and not res.ok
        # The kernel refuses (a read-only procfs); the hook, which now resolves a relative name
        # against the current directory, refuses first when it is on.
        assert "Read-only file system" in res.stderr or (guard and "sandbox: writing" in res.stderr), res.stderr


@GUARDS
def test_posixsubprocess_fork_exec_of_a_shell(host_dir: Path, guard: bool) -> None:
    # _posixsubprocess.fork_exec raises no audit event: the hook never sees this process start.
    target = host_dir / "owned.txt"
    code = (
        "import os, _posixsubprocess\n"
        f"args = [b'/bin/sh', b'-c', b'id > {target}']\n"
        "errr, errw = os.pipe()\n"
        "head = (args, [b'/bin/sh'], True, (errw,), None, None, -1, -1, -1, -1, -1, -1, errr, errw, True, False)\n"
        "try:  # 3.11/3.12: process_group, gid, gids, uid, umask, preexec_fn, allow_vfork\n"
        "    pid = _posixsubprocess.fork_exec(*head, -1, None, None, None, -1, None, False)\n"
        "except TypeError:  # without allow_vfork\n"
        "    pid = _posixsubprocess.fork_exec(*head, -1, None, None, None, -1, None)\n"
        "os.close(errw)\n"
        "err = b''\n"
        "while chunk := os.read(errr, 1000):  # the child writes 'OSError:', the errno and the text in pieces\n"
        "    err += chunk\n"
        "os.waitpid(pid, 0)\n"
        "print('exec failed' if err else 'exec ran', err)\n"
    )
    with bypass(f"posixsubprocess-fork-exec[{guard}]"):
        res = sandboxed(code, guard)
        assert "exec ran" not in res.stdout, res
        assert not target.exists()
        if "exec failed" in res.stdout:  # it got as far as the exec: the kernel refused it
            assert "OSError:1:" in res.stdout, res.stdout  # EPERM (seccomp), not a missing /bin/sh


@GUARDS
def test_world_readable_host_files_are_not_there(guard: bool) -> None:
    secret, tag = f"hostile-secret-{uuid.uuid4().hex}", uuid.uuid4().hex[:8]
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-hostile-", dir="/tmp"))
    tmp.chmod(0o755)
    planted = [
        REPO / f".hostile-ledger-{tag}.sqlite",  # a ledger file in the project directory
        REPO / f".hostile-{tag}.env",  # an env file with a token
        tmp / "ledger.db",
        tmp / "service.env",
    ]
    try:
        for p in planted:
            p.write_text(f"SQLite format 3\nASYNCRL_TOKEN={secret}\n")
            p.chmod(0o644)
        others = [REPO / "pyproject.toml", Path.home() / ".bashrc", Path("/etc/passwd"), Path("/etc/hostname")]
        paths = [str(p) for p in planted + others]
        code = (
            f"for p in {paths!r}:\n"
            "    try:\n"
            "        print('READ', p, open(p).read()[:200])\n"
            "    except OSError as exc:\n"
            "        print('refused', p, type(exc).__name__)\n"
        )
        with bypass(f"world-readable-files[{guard}]"):
            res = sandboxed(code, guard)
            assert res.ok and res.stdout.count("refused") == len(paths), res.stdout
            assert "READ" not in res.stdout and secret not in res.stdout + res.stderr
    finally:
        for p in planted:
            p.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)


@GUARDS
def test_other_processes_command_lines_are_not_visible(guard: bool) -> None:
    token = f"hostile-token-{uuid.uuid4().hex}"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", token])
    try:
        code = (
            "import os\n"
            f"token = {token.encode()!r}\n"
            "hits = []\n"
            "try:\n"
            f"    hits.append(open('/proc/{other.pid}/cmdline', 'rb').read())\n"
            "except OSError as exc:\n"
            "    print('direct', type(exc).__name__)\n"
            "pids = [d for d in os.listdir('/proc') if d.isdigit()]\n"
            "for pid in pids:\n"
            "    try:\n"
            "        c = open(f'/proc/{pid}/cmdline', 'rb').read()\n"
            "    except OSError:\n"
            "        continue\n"
            "    if token in c:\n"
            "        hits.append(c)\n"
            "print('pids', len(pids), 'hits', len(hits))\n"
        )
        with bypass(f"proc-cmdline[{guard}]"):
            res = sandboxed(code, guard)
            assert res.ok and "hits 0" in res.stdout, res.stdout
            assert "direct FileNotFoundError" in res.stdout
            assert int(res.stdout.split()[-3]) <= 2  # its own processes only (fresh PID namespace)
    finally:
        other.kill()
        other.wait()


@GUARDS
def test_no_connection_to_the_hosts_services(guard: bool) -> None:
    sockets = [p for p in ("/var/run/postgresql/.s.PGSQL.5432", "/run/redis/redis-server.sock") if os.path.exists(p)]
    code = (
        "import socket\n"
        "for addr in [('127.0.0.1', 6379), ('127.0.0.1', 5432)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=2)\n"
        "        print('connected', addr)\n"
        "    except OSError as exc:\n"
        "        print('refused', addr, type(exc).__name__)\n"
        f"for path in {sockets!r}:\n"
        "    try:\n"
        "        s = socket.socket(socket.AF_UNIX)\n"
        "        s.connect(path)\n"
        "        print('connected', path)\n"
        "    except OSError as exc:\n"
        "        print('refused', path, type(exc).__name__)\n"
    )
    with bypass(f"network[{guard}]"):
        res = sandboxed(code, guard)
        assert "connected" not in res.stdout
        assert res.stdout.count("refused") == 2 + len(sockets), res


def test_only_the_interpreter_is_mounted() -> None:
    # No descriptor from the host is left open, and nothing but the interpreter, its libraries and
    # the sandbox's own tmpfs/proc/dev is mounted (no project, home, /etc or /var).
    code = (
        "import os\n"
        "print(sorted(int(f) for f in os.listdir('/proc/self/fd')))\n"
        "print(sorted({line.split()[4] for line in open('/proc/self/mountinfo')}))\n"
    )
    python = sandbox_python()
    allowed = (
        "/usr/lib",
        "/proc",
        "/dev",
        "/tmp",
        "/sandbox",
        python,
        f"{os.path.dirname(os.path.dirname(python))}/lib",
    )
    with bypass("mounts-and-fds"):
        res = sandboxed(code, guard=False)
        fds, mounts = (ast.literal_eval(line) for line in res.stdout.splitlines())
        assert fds == [0, 1, 2, 3]  # stdio and the listdir itself
        assert [m for m in mounts if m != "/" and not m.startswith(allowed)] == [], mounts
        assert not any(m.startswith((str(REPO), "/etc", "/var", "/run")) for m in mounts), mounts


ATTACKER = r"""
import glob, os, time
me, mypid = os.getcwd(), str(os.getpid())
seen, forged = set(), []

def overwrite(path):
    # chdir + a relative name, so the audit hook's path check sees a name inside the sandbox
    d, name = os.path.split(path)
    try:
        os.chdir(d)
        try:
            os.remove(name)
        except OSError:
            pass
        with open(name, "w") as f:
            f.write("42\n")
        forged.append(path)
    except OSError:
        pass
    finally:
        os.chdir(me)

end = time.monotonic() + 3.0
while time.monotonic() < end:
    for top in ("/tmp", "/dev/shm"):
        for dirpath, _, files in os.walk(top):
            for f in files:
                p = os.path.join(dirpath, f)
                seen.add(p)
                if not p.startswith(me) and f == ".stdout":
                    overwrite(p)
    for pid in [d for d in os.listdir("/proc") if d.isdigit()]:
        seen.add("/proc/" + pid)
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if pid != mypid and b"-I\0-S" in cmd:  # another sandbox's runner: write into its stdout
            overwrite(f"/proc/{pid}/fd/1")
    time.sleep(0.05)
print("uid", os.getuid(), "seen", len(seen), "forged", len(forged), sorted(set(forged))[:5])
"""
VICTIM = "import os, time\nprint(os.getuid(), flush=True)\ntime.sleep(1.5)\nprint(41)\n"


def test_one_run_cannot_forge_another_runs_output() -> None:
    # Two python_exec rewards at once on one host: the attacker looks for the victim's output by
    # every means (its files in /tmp or /dev/shm, its stdout through /proc) and writes the right
    # answer (42) over it; the victim's own answer (41) must be what is scored.
    results: dict[str, object] = {}

    def go(name: str, fn) -> None:
        results[name] = fn()

    threads = [
        threading.Thread(target=go, args=("attacker", lambda: run_python(ATTACKER))),
        threading.Thread(target=go, args=("victim", lambda: run_python(VICTIM))),
        threading.Thread(target=go, args=("reward", lambda: python_exec(f"```python\n{VICTIM}```", "42"))),
    ]
    threads[0].start()
    time.sleep(0.3)  # the attacker is already scanning when the victims start
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(30)
    attacker, victim = results["attacker"], results["victim"]
    assert isinstance(attacker, Result) and isinstance(victim, Result)
    with bypass("cross-sandbox-forgery"):
        assert victim.ok and victim.stdout.splitlines()[-1] == "41", victim
        assert results["reward"] == 0.0  # the victim's wrong answer scores as wrong
        assert attacker.ok and " forged 0 " in attacker.stdout, attacker
        if os.geteuid() == 0:  # each concurrent run has a uid of its own
            assert attacker.stdout.split()[1] != victim.stdout.split()[0]


def test_record_tally() -> None:
    blocked = sum(BLOCKED.values())
    record_hostile(sandbox_bypasses_blocked=blocked, sandbox_bypasses_tried=len(BLOCKED))
    assert blocked == len(BLOCKED) > 0, {k: v for k, v in BLOCKED.items() if not v}
