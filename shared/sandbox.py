"""Run untrusted (model-written) Python in a sandboxed subprocess.

Layers, outermost first; each holds without the ones inside it:

1. **Kernel namespaces** via bubblewrap (`bwrap`), as an unprivileged user:
   - *mount*: the root is an empty read-only tmpfs holding only the interpreter binary, its
     `lib/` (standard library) and the system's `/usr/lib*` (shared libraries), all bound
     read-only. No project, ledger, home, `/etc` or env file exists in there, whatever its mode on
     the host. The program's directory `/sandbox`, `/tmp` and `/dev/shm` are private tmpfs mounts
     of `Limits.tmpfs_bytes` each, gone when the run ends. `/proc` is a fresh, read-only procfs
     (no writing `/proc/self/mem`).
   - *PID*: the program is PID 1 of its own namespace, so `/proc` shows only its processes, and
     when it ends or is killed everything it forked dies with it, even a process that left its
     session.
   - *network*: only a private loopback; nothing on the host (Redis on 127.0.0.1 included) can
     be reached. Also IPC and UTS; nested user namespaces are disabled.
   - *user*: a root caller drops to a uid of its own for each concurrent run (`_UidPool`), so two
     runs share nothing, not even a kernel keyring; a non-root caller's runs share its uid and are
     kept apart by the namespaces alone. The program's output comes back through pipes, never a
     file another run could reach.
2. **seccomp** (classic BPF, installed by the runner before the program is compiled; inherited by
   every thread and child): no execve/execveat (no other program can start, whatever path it is
   reached by), no ptrace or process_vm_*, keyrings, bpf, perf_event_open, userfaultfd or
   io_uring (kernel attack surface the programs have no use for).
3. **rlimits**, set before bwrap starts: CPU seconds (SIGXCPU, then SIGKILL one second later),
   address space (a memory bomb gets MemoryError), file size (a big write gets EFBIG), open files,
   processes/threads (only with a uid of the run's own, where the count is the run's alone).
4. **A wall-clock timeout and an output cap**: the sandbox is SIGKILLed when the wall clock runs
   out (sleeping or blocked code uses no CPU) or when stdout or stderr passes `file_bytes`.
5. **An in-process audit hook** (PEP 578): no sockets, no new processes, no ctypes, and no writes
   outside the program's directory. Audit hooks are not a security boundary (C code, relative
   paths through a directory fd and the like get round them); here it is the innermost layer, a
   clear error message for ordinary programs.

The interpreter runs as `python -I -S` (isolated: no environment variables, no user site, no
site-packages: the standard library only) with an empty environment. Nothing is unpickled or
imported back: the caller gets the exit status and the bounded tails of stdout and stderr as text.

Without kernel confinement (no `bwrap`, or user namespaces disabled) `run_python` raises
`SandboxUnavailable`, unless the environment variable `ASYNCRL_SANDBOX_UNCONFINED=1` is set; then
programs run with layers 2-5 only (as a uid of their own when the caller is root), which is fit
for trusted code, not for a model's.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import platform
import resource
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

UNCONFINED_ENV = "ASYNCRL_SANDBOX_UNCONFINED"
"""Set to 1 to run without kernel confinement where it is unavailable (trusted code only)."""

_BWRAP = "bwrap"
_WORKDIR = "/sandbox"  # the program's directory inside the sandbox

# Runs inside the sandbox before the program: close stray descriptors, install the seccomp filter,
# then the audit hook, then run the program. A string, not a module: with -I -S nothing of this
# project is importable there.
_RUNNER = r"""
import os, sys
os.closerange(3, os.sysconf("SC_OPEN_MAX"))
ROOT = os.getcwd()
SRC = open("main.py", encoding="utf-8").read()
GUARD = sys.argv[1] == "1"
FILTER = bytes.fromhex(sys.argv[2])
if FILTER:
    import ctypes
    class _FProg(ctypes.Structure):  # struct sock_fprog
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
    _libc = ctypes.CDLL(None, use_errno=True)
    _prog = _FProg(len(FILTER) // 8, FILTER)
    # prctl(PR_SET_NO_NEW_PRIVS, 1), prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)
    if _libc.prctl(38, 1, 0, 0, 0) != 0 or _libc.prctl(22, 2, ctypes.byref(_prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "sandbox: the kernel refused the seccomp filter")
    del ctypes, _FProg, _libc, _prog
    for _m in [m for m in sys.modules if m.startswith(("ctypes", "_ctypes"))]:
        del sys.modules[_m]
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
DENY = {
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
    "subprocess.Popen", "pty.spawn", "sys.remote_exec",
}
PATH_EVENTS = {  # event -> indices of path arguments that must stay inside ROOT
    "os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "os.chmod": (0,), "os.chown": (0,),
    "os.truncate": (0,), "os.utime": (0,), "os.chflags": (0,), "os.lchflags": (0,),
    "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,), "os.mkfifo": (0,), "os.mknod": (0,),
    "shutil.chown": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
}
realpath, join, commonpath, fsdecode, getcwd = (
    os.path.realpath, os.path.join, os.path.commonpath, os.fsdecode, os.getcwd)

def inside(p):
    if isinstance(p, int):
        return True  # an already open descriptor
    p = realpath(join(getcwd(), fsdecode(p)))  # relative to where the program is now
    return p == "/dev/null" or commonpath([p, ROOT]) == ROOT

def hook(event, args):
    if event in DENY or event.startswith("ctypes."):
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
del GUARD, FILTER
exec(compile(SRC, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up on this machine (no kernel confinement, no usable interpreter)."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. Worst-case memory of one run is about `processes * memory_bytes` plus three
    tmpfs mounts of `tmpfs_bytes`."""

    wall_s: float = 5.0  # wall clock, then SIGKILL of everything
    cpu_s: int = 2  # RLIMIT_CPU seconds, per process
    memory_bytes: int = 256 * 1024 * 1024  # RLIMIT_AS, per process
    file_bytes: int = 1024 * 1024  # RLIMIT_FSIZE, and the most stdout or stderr may carry
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 8  # RLIMIT_NPROC (processes and threads), where it can be enforced
    output_bytes: int = 64 * 1024  # how much of the end of stdout/stderr is returned
    tmpfs_bytes: int = 16 * 1024 * 1024  # size of each of /sandbox, /tmp and /dev/shm


@dataclass(frozen=True)
class Result:
    # The program's exit status; non-zero on any failure. Confined, a signal death (the wall-clock
    # or output-cap SIGKILL, RLIMIT_CPU's) reads as 128 + signal (bwrap's); unconfined as -signal.
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool  # killed at the wall-clock limit
    wall_s: float
    isolation: str  # "bwrap" (kernel confinement) or "audit-hook" (the unconfined opt-out)

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
    """The interpreter for sandboxed code (a resolved path): this one if an unprivileged user can
    run it, else the system's (only its standard library is used: -S)."""
    candidates = [os.path.realpath(sys.executable)]
    if os.geteuid() == 0:  # the program runs as a uid of its own; a venv under /root is out of reach
        candidates += [os.path.realpath(p) for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)]
        candidates = [c for c in candidates if _world_executable(c)]
    if not candidates:
        raise SandboxUnavailable(
            f"no Python interpreter that an unprivileged user may run: {sys.executable} is not "
            "reachable by another uid and there is no /usr/bin/python3"
        )
    return candidates[0]


# seccomp: classic BPF over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}
# (linux/seccomp.h, linux/filter.h). Syscall numbers from the kernel's unistd tables.
_DENIED_SYSCALLS = (
    "execve",
    "execveat",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "add_key",
    "request_key",
    "keyctl",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
)
_SECCOMP_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {  # AUDIT_ARCH_X86_64, arch/x86/entry/syscalls/syscall_64.tbl
            "execve": 59,
            "execveat": 322,
            "ptrace": 101,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "bpf": 321,
            "perf_event_open": 298,
            "userfaultfd": 323,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {  # AUDIT_ARCH_AARCH64, include/uapi/asm-generic/unistd.h
            "execve": 221,
            "execveat": 281,
            "ptrace": 117,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "bpf": 280,
            "perf_event_open": 241,
            "userfaultfd": 282,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
        },
    ),
}
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_X32_SYSCALL_BIT = 0x40000000


def seccomp_filter(machine: str | None = None) -> bytes:
    """The seccomp filter of the sandbox as a `struct sock_filter[]` (8 bytes an instruction).

    A foreign syscall ABI (i386 on x86_64) kills the process; x32 syscalls and the denied ones
    fail with EPERM (a Python exception, not a crash); everything else is allowed.

    Raises:
        SandboxUnavailable: no syscall table for this machine (the message lists the known ones).
    """
    machine = machine or platform.machine()
    if machine not in _SECCOMP_ARCHES:
        raise SandboxUnavailable(f"no seccomp syscall table for {machine!r}; known: {sorted(_SECCOMP_ARCHES)}")
    arch, numbers = _SECCOMP_ARCHES[machine]
    checks = [(_BPF_JGE_K, _X32_SYSCALL_BIT)] if machine == "x86_64" else []
    checks += [(_BPF_JEQ_K, numbers[name]) for name in _DENIED_SYSCALLS]
    prog = [
        (_BPF_LD_W_ABS, 0, 0, 4),  # A = arch
        (_BPF_JEQ_K, 1, 0, arch),
        (_BPF_RET_K, 0, 0, _RET_KILL_PROCESS),
        (_BPF_LD_W_ABS, 0, 0, 0),  # A = nr
    ]
    # Check j jumps over the remaining checks and the allow, onto the deny: k - j instructions.
    prog += [(code, len(checks) - j, 0, k) for j, (code, k) in enumerate(checks)]
    prog += [(_BPF_RET_K, 0, 0, _RET_ALLOW), (_BPF_RET_K, 0, 0, _RET_ERRNO | errno.EPERM)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


class _UidPool:
    """A uid of its own for each concurrent run of a root caller, unique across processes.

    uid = base + pid * slots + slot: live processes have distinct pids (< 2**22, the kernel's
    PID_MAX_LIMIT) and a sandbox never outlives the process that started it (bwrap
    --die-with-parent), so no two live runs share a uid without any file or lock between processes.
    """

    BASE = 1_100_000_000  # far above any uid a distribution hands out; base + 2**28 < 2**32 - 1
    SLOTS = 64  # concurrent runs per process; more wait for a free slot

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """All slots free; also in a forked child, where the parent's leases are not ours (and its
        lock may be held)."""
        self._cond = threading.Condition()
        self._free = list(range(self.SLOTS))

    @contextlib.contextmanager
    def lease(self) -> Iterator[int]:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free))
            slot = self._free.pop()
        try:
            yield self.BASE + (os.getpid() % (1 << 22)) * self.SLOTS + slot
        finally:
            with self._cond:
                self._free.append(slot)
                self._cond.notify()


_UIDS = _UidPool()
os.register_at_fork(after_in_child=_UIDS.reset)


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


def _bwrap_argv(python: str, limits: Limits, code_fd: int) -> list[str]:
    """bwrap's command line: namespaces, the read-only binds the interpreter needs, private tmpfs."""
    prefix = os.path.dirname(os.path.dirname(python))  # <prefix>/bin/python3.X
    argv = [
        _BWRAP,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--as-pid-1",
        "--new-session",
        "--clearenv",
        "--cap-drop",
        "ALL",
    ]
    binds = [python, *(d for d in (f"{prefix}/lib", "/usr/lib", "/usr/lib64") if os.path.isdir(d))]
    for src in dict.fromkeys(binds):
        argv += ["--ro-bind", src, src]
    for top in ("/lib", "/lib64"):  # the ELF interpreter's path; a merged-/usr link or a real dir
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    size = str(limits.tmpfs_bytes)
    argv += [
        "--proc",
        "/proc",
        "--remount-ro",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        size,
        "--tmpfs",
        "/dev/shm",
        "--size",
        size,
        "--tmpfs",
        "/tmp",
        "--size",
        size,
        "--tmpfs",
        _WORKDIR,
        "--perms",
        "0444",
        "--file",
        str(code_fd),
        f"{_WORKDIR}/main.py",
        "--chdir",
        _WORKDIR,
        "--remount-ro",
        "/",
    ]
    return argv


def _read_outputs(
    proc: subprocess.Popen, limits: Limits, deadline: float, confined: bool
) -> tuple[bytes, bytes, str | None]:
    """Drain stdout and stderr together until both close, keeping each one's last `output_bytes`.

    Returns (stdout tail, stderr tail, why the sandbox was killed or None): "timeout" at the
    deadline, "output" when a stream passes `file_bytes`.
    """
    assert proc.stdout is not None and proc.stderr is not None
    tails = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    totals = dict.fromkeys(tails, 0)
    killed: str | None = None
    with selectors.DefaultSelector() as sel:
        for fd in tails:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0 and killed is None:
                killed = "timeout"
                _kill(proc, confined)
                deadline = time.monotonic() + 2.0  # the pipes close as soon as the kill lands
            elif left <= 0:
                break
            for key, _ in sel.select(timeout=max(left, 0.0)):
                fd = key.fd
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                totals[fd] += len(chunk)
                buf = tails[fd]
                buf += chunk
                del buf[: -limits.output_bytes]
                if totals[fd] > limits.file_bytes and killed is None:
                    killed = "output"
                    _kill(proc, confined)
    return bytes(tails[proc.stdout.fileno()]), bytes(tails[proc.stderr.fileno()]), killed


def _kill(proc: subprocess.Popen, confined: bool) -> None:
    """SIGKILL the sandbox, everything in it gone by the time `proc` can be reaped.

    Confined, the program is PID 1 of its namespace and a child of bwrap (`proc`): killing it
    makes the kernel kill the rest of the namespace before bwrap can reap it, and bwrap then exits.
    Killing bwrap first would leave the namespace to die a moment later (--die-with-parent), after
    its uid could already be handed to the next run. Unconfined, the process group is all there is.
    """
    if confined:
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


def _run(code: str, limits: Limits, uid: int | None, guard: bool, confined: bool) -> Result:
    """One run, confined by bwrap or (the opt-out) not; `uid` is None for a non-root caller."""
    python = sandbox_python()
    filter_hex = seccomp_filter().hex()
    runner = [python, "-I", "-S", "-c", _RUNNER, "1" if guard else "0", filter_hex]
    pass_fds: tuple[int, ...] = ()
    with contextlib.ExitStack() as stack:
        if confined:
            code_fd = os.memfd_create("asyncrl-sandbox-main")
            stack.callback(os.close, code_fd)
            os.write(code_fd, code.encode("utf-8"))
            os.lseek(code_fd, 0, os.SEEK_SET)
            argv, cwd, pass_fds = [*_bwrap_argv(python, limits, code_fd), *runner], "/", (code_fd,)
        else:
            workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
            stack.callback(shutil.rmtree, workdir, ignore_errors=True)
            Path(workdir, "main.py").write_text(code, encoding="utf-8")
            if uid is not None:
                os.chown(workdir, uid, uid)
            argv, cwd = runner, workdir
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            start_new_session=True,
            # RLIMIT_NPROC counts every process of the uid: only safe for a uid of the run's own.
            preexec_fn=_preexec(limits, uid, nproc=uid is not None),
        )
        with proc:
            out, err, killed = _read_outputs(proc, limits, t0 + limits.wall_s, confined)
            if killed is None:  # both pipes closed; the program may still be running without them
                try:
                    proc.wait(timeout=max(0.0, t0 + limits.wall_s - time.monotonic()))
                except subprocess.TimeoutExpired:
                    killed = "timeout"
                    _kill(proc, confined)
            if not confined:  # confined, the PID namespace is gone once bwrap has exited
                _kill(proc, confined)  # nothing the program started may outlive it
            proc.wait()
    if killed == "output":
        err += f"\nsandbox: killed, stdout or stderr passed {limits.file_bytes} bytes\n".encode()
    return Result(
        returncode=proc.returncode,
        stdout=out.decode("utf-8", errors="replace"),
        stderr=err.decode("utf-8", errors="replace"),
        timed_out=killed == "timeout",
        wall_s=time.monotonic() - t0,
        isolation="bwrap" if confined else "audit-hook",
    )


@functools.cache
def _confinement_error() -> str | None:
    """Why bwrap cannot confine a run here (probed once, with a real run), or None if it can."""
    if shutil.which(_BWRAP) is None:
        return f"{_BWRAP} (bubblewrap) is not installed; scripts/setup.sh installs it"
    try:
        with _UIDS.lease() as uid:
            res = _run("print('ok')", Limits(wall_s=20.0), uid if os.geteuid() == 0 else None, True, True)
    except (OSError, SandboxUnavailable) as exc:
        return f"{type(exc).__name__}: {exc}"
    if res.ok and res.stdout == "ok\n":
        return None
    return f"a probe run exited {res.returncode}: {res.stderr.strip()[-500:]}"


def run_python(code: str, limits: Limits = Limits(), *, uid: int | None = None, guard: bool = True) -> Result:
    """Run `code` as a Python program in the sandbox and return how it ended.

    Args:
        code: program source (the program's own failures are results, never exceptions here).
        limits: resource limits.
        uid: when the caller is root, the user (and group) the program runs as; None (the default)
            takes a uid no other live run has. Ignored for a non-root caller.
        guard: install the in-process audit hook (tests switch it off to check the OS layers).

    Raises:
        SandboxUnavailable: no kernel confinement here (the message says why) and
            ASYNCRL_SANDBOX_UNCONFINED=1 is not set, or no interpreter an unprivileged user can run.
    """
    why = _confinement_error()
    confined = why is None
    if not confined and os.environ.get(UNCONFINED_ENV) != "1":
        raise SandboxUnavailable(
            f"cannot confine untrusted code: {why}. Install bubblewrap and allow unprivileged user "
            f"namespaces (sysctl user.max_user_namespaces > 0), or set {UNCONFINED_ENV}=1 to run "
            "trusted code with rlimits and the audit hook only"
        )
    if os.geteuid() != 0:
        return _run(code, limits, None, guard, confined)
    if uid is not None:
        return _run(code, limits, uid, guard, confined)
    with _UIDS.lease() as leased:
        return _run(code, limits, leased, guard, confined)
