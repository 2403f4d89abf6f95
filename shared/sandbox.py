"""Run untrusted (model-written) Python in a sandboxed subprocess.

Layers, outermost first; each holds without the ones inside it:

1. **Namespaces** (when `unshare` can make them, probed once): `unshare --map-root-user --net
   --pid --fork --kill-child`. A fresh network namespace has only a loopback that is down, so no
   connection to anything (Redis on 127.0.0.1 included) is possible; the program is PID 1 of its own
   PID namespace, so when it ends or is killed every process it forked dies with it, even one that
   left its process group.
2. **An unprivileged user**: a root caller runs the program as `uid`/`gid` (default nobody), so it
   can write only into its own temp dir and world-writable places, and RLIMIT_NPROC applies (root
   is exempt from it). In the user namespace the count starts at zero, so the limit is the
   program's own process budget whoever the caller is.
3. **rlimits**, set in `preexec_fn` before anything runs: CPU seconds (SIGXCPU, then SIGKILL one
   second later), address space (a memory bomb gets MemoryError), file size (a big write gets
   SIGXFSZ / EFBIG; stdout and stderr are files, so endless output stops there too), open files,
   processes/threads.
4. **A wall-clock timeout**: the process group is SIGKILLed (sleeping or blocked code uses no CPU).
5. **An in-process audit hook** (PEP 578, installed before the program is compiled): no sockets,
   no new processes (fork, exec, spawn, subprocess), no ctypes, and no writes, renames, deletes or
   permission changes outside the temp dir. Audit hooks are not a security boundary on their own
   (C code could get round them); here they are the innermost layer and the only one that keeps
   the program out of world-writable directories such as /tmp, and the only network block where
   namespaces are unavailable.

The interpreter runs as `python -I -S` (isolated: no environment variables, no user site, no
site-packages: the standard library only) with an empty environment, in a fresh temp dir that is
deleted afterwards. Nothing is unpickled or imported back: the caller gets the exit status and the
bounded tails of stdout and stderr as text.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_NOBODY = 65534

# Runs inside the sandbox before the program: read the program, install the audit hook, run it.
# A string, not a module: with -I -S nothing of this project is importable there.
_RUNNER = r"""
import os, sys
ROOT = os.getcwd()
SRC = open("main.py", encoding="utf-8").read()
GUARD = sys.argv[1] == "1"
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
DENY = {
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
    "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
    "sys.remote_exec",
}
PATH_EVENTS = {  # event -> indices of path arguments that must stay inside ROOT
    "os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "os.chmod": (0,), "os.chown": (0,),
    "os.truncate": (0,), "os.utime": (0,), "os.chflags": (0,), "os.lchflags": (0,),
    "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,), "os.mkfifo": (0,), "os.mknod": (0,),
    "shutil.chown": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
}
realpath, join, commonpath, fsdecode = os.path.realpath, os.path.join, os.path.commonpath, os.fsdecode

def inside(p):
    if isinstance(p, int):
        return True  # an already open descriptor
    p = realpath(join(ROOT, fsdecode(p)))
    return p == "/dev/null" or commonpath([p, ROOT]) == ROOT

def hook(event, args):
    if event in DENY:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0] in ("ctypes", "_ctypes"):
        raise PermissionError("sandbox: ctypes is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
        if writes and path is not None and not inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
    elif event in PATH_EVENTS:
        for i in PATH_EVENTS[event]:
            if i < len(args) and args[i] is not None and not inside(args[i]):
                raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the sandbox directory")

if GUARD:
    sys.addaudithook(hook)
del GUARD
exec(compile(SRC, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up on this machine (no usable interpreter)."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. Worst-case memory of one run is about `processes * memory_bytes`."""

    wall_s: float = 5.0  # wall clock, then SIGKILL of everything
    cpu_s: int = 2  # RLIMIT_CPU seconds, per process
    memory_bytes: int = 256 * 1024 * 1024  # RLIMIT_AS, per process
    file_bytes: int = 1024 * 1024  # RLIMIT_FSIZE: the largest file (stdout/stderr too)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 8  # RLIMIT_NPROC (processes and threads), where it can be enforced
    output_bytes: int = 64 * 1024  # how much of the end of stdout/stderr is returned


@dataclass(frozen=True)
class Result:
    # The program's exit status; non-zero on any failure. A signal death (the wall-clock SIGKILL,
    # RLIMIT_CPU's SIGXCPU) reads as -signal without namespaces and as 1 with them (unshare's).
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool  # killed at the wall-clock limit
    wall_s: float
    isolation: str  # "namespaces" or "audit-hook": what enforced the network block

    @property
    def ok(self) -> bool:
        """Ran to completion and exited 0."""
        return self.returncode == 0 and not self.timed_out


def _world_executable(path: str) -> bool:
    """Whether a user with no rights of its own can run `path` (every parent searchable)."""
    p = Path(path).resolve()
    try:
        if not p.stat().st_mode & stat.S_IXOTH:
            return False
        return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)
    except OSError:
        return False


@functools.cache
def sandbox_python() -> str:
    """The interpreter for sandboxed code: this one if an unprivileged user can run it, else the
    system's (only its standard library is used: -S)."""
    candidates = [os.path.realpath(sys.executable)]
    if os.geteuid() == 0:  # the program runs as nobody; a venv under /root is out of its reach
        candidates += [p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)]
        candidates = [c for c in candidates if _world_executable(c)]
    if not candidates:
        raise SandboxUnavailable(
            f"no Python interpreter that an unprivileged user may run: {sys.executable} is not "
            "reachable by uid nobody and there is no /usr/bin/python3"
        )
    return candidates[0]


def _preexec(limits: Limits, uid: int | None, nproc: bool):
    def apply() -> None:
        # In the child between fork and exec: only async-signal-safe work, no logging.
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return apply


_UNSHARE = ["unshare", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"]


@functools.cache
def _namespaces_work(uid: int | None) -> bool:
    """Whether this user (after dropping to `uid`) can create the namespaces; probed once."""
    if shutil.which("unshare") is None:
        return False
    probe = Limits()
    try:
        res = subprocess.run(
            [*_UNSHARE, sandbox_python(), "-I", "-S", "-c", "pass"],
            preexec_fn=_preexec(probe, uid, nproc=False), env={}, cwd="/",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


def _kill(proc: subprocess.Popen, namespaces: bool) -> None:
    """Kill a sandbox that ran out of time, leaving no zombie behind.

    With namespaces the program is PID 1 of its PID namespace, a child of `unshare`: killing it
    makes the kernel kill everything else in the namespace, and `unshare` reaps it and exits.
    Killing `unshare` first would orphan the program (and its zombie) to our own init.
    """
    if namespaces:
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        if children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2.0)
                return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        return f.read().decode("utf-8", errors="replace")


def run_python(code: str, limits: Limits = Limits(), *, uid: int = _NOBODY, guard: bool = True) -> Result:
    """Run `code` as a Python program in the sandbox and return how it ended.

    Args:
        code: program source (the program's own failures are results, never exceptions here).
        limits: resource limits.
        uid: the user (and group) the program runs as when the caller is root.
        guard: install the in-process audit hook (tests switch it off to check the OS layers).

    Raises:
        SandboxUnavailable: no interpreter an unprivileged user can run.
    """
    run_as = uid if os.geteuid() == 0 else None
    namespaces = _namespaces_work(run_as)
    # Without a user namespace RLIMIT_NPROC would count every process of the calling user (the
    # service's own included), so it is only safe for a dropped, dedicated uid.
    nproc = namespaces or run_as is not None
    python = sandbox_python()
    workdir = Path(tempfile.mkdtemp(prefix="asyncrl-sandbox-"))
    try:
        (workdir / "main.py").write_text(code, encoding="utf-8")
        out, err = workdir / ".stdout", workdir / ".stderr"
        if run_as is not None:
            for p in (workdir, workdir / "main.py"):
                os.chown(p, run_as, run_as)
        argv = [python, "-I", "-S", "-c", _RUNNER, "1" if guard else "0"]
        if namespaces:
            argv = [*_UNSHARE, *argv]
        t0 = time.monotonic()
        timed_out = False
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(
                argv, cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                preexec_fn=_preexec(limits, run_as, nproc), start_new_session=True,
            )
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(proc, namespaces)
            # Also after a normal exit: nothing the program started may outlive it.
            with contextlib.suppress(ProcessLookupError):  # the group is already gone
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        wall = time.monotonic() - t0
        return Result(
            returncode=proc.returncode,
            stdout=_tail(out, limits.output_bytes),
            stderr=_tail(err, limits.output_bytes),
            timed_out=timed_out,
            wall_s=wall,
            isolation="namespaces" if namespaces else "audit-hook",
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
