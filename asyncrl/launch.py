"""One-box launcher: the broker API and every service as supervised OS processes, each with its log.

Processes only talk through Redis and the ledger; this module just starts them with the right
environment, watches them, and stops them (SIGTERM, then SIGKILL after a grace period).

`python -m asyncrl.launch --generators 2` starts the broker API, two generators, the reward
service and the trainer (`--admin` adds the Celery admin worker) as a standing fleet: they serve
the queue of jobs submitted to the API, one after another, until stopped (`--exit-when-idle`:
until nothing is queued or running, for scripts). `--spec FILE` runs that one job and exits;
`--roles` picks a subset for one node of a multi-node layout. A process that fails is restarted (`--restart on-failure`,
the default, as compose's `restart: on-failure` and systemd's `Restart=on-failure` do) after a
back-off, at most `--max-restarts` times within `--restart-window` seconds, each time with the
exit code and the log tail logged; past that budget, or with `--restart no`, the first failure
stops the rest and the launcher exits 1. Each service gets its share of the box's cores and its thread
counts (shared.placement, the rule a service started on its own applies to itself; with `--spec`,
the job's `placement`; `--no-placement` turns that off). See docs/deployment.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from shared.placement import cpuset, gpu_count, plan_placement

log = logging.getLogger("asyncrl.launch")  # also under `python -m`


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    # how it was started, so that it can be started again
    module: str = ""
    env: dict[str, str] = field(default_factory=dict)
    cpus: set[int] | None = None
    args: tuple[str, ...] = ()
    restarts: list[float] = field(default_factory=list)  # monotonic times of its restarts


@dataclass(frozen=True)
class RestartPolicy:
    """What `supervise` does when a process fails: `on_failure` restarts it after `backoff_s`
    (doubling per restart within the window, capped at 30 s), at most `max_restarts` times in
    `window_s` seconds; otherwise, or past that budget, the failure ends the run."""

    on_failure: bool = False
    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0

    def delay(self, p: Proc, now: float) -> float | None:
        """Seconds to wait before restarting `p`, or None when its budget is spent."""
        if not self.on_failure:
            return None
        recent = [t for t in p.restarts if now - t < self.window_s]
        if len(recent) >= self.max_restarts:
            return None
        return min(30.0, self.backoff_s * 2 ** len(recent))


class Supervisor:
    def __init__(self, logdir: str | Path, env: dict[str, str]):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.procs: list[Proc] = []

    def start(
        self,
        name: str,
        module: str,
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
        args: Sequence[str] = (),
    ) -> Proc:
        """Start `python -m module *args` with the supervisor's env plus `env`, optionally pinned
        to `cpus`, in its own process group, stdout and stderr appended to `<logdir>/<name>.log`."""
        log_path = self.logdir / f"{name}.log"
        fh = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        full_env = {**os.environ, **self.env, **(env or {})}
        available = os.sched_getaffinity(0)
        pin = (cpus & available) if cpus else None

        def preexec() -> None:
            os.setpgrp()  # our Ctrl-C goes to us; we stop children in order
            if pin:
                os.sched_setaffinity(0, pin)

        popen = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=full_env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
        )
        fh.close()
        p = Proc(name, popen, log_path, module, dict(env or {}), cpus, tuple(args))
        self.procs.append(p)
        log.info("started %s (pid %d), log %s", name, popen.pid, log_path)
        return p

    def restart(self, p: Proc) -> Proc:
        """Start `p` again as it was started (its log is appended to); it replaces `p`."""
        _killpg(p.popen.pid)  # whatever it left in its group (an engine core) goes first
        self.procs.remove(p)
        q = self.start(p.name, p.module, p.env, p.cpus, p.args)
        q.restarts = [*p.restarts, time.monotonic()]
        return q

    def failed(self) -> list[Proc]:
        """Processes that exited with a non-zero code."""
        return [p for p in self.procs if p.popen.poll() not in (None, 0)]

    def wait(self, name: str, timeout: float) -> int | None:
        for p in self.procs:
            if p.name == name:
                try:
                    return p.popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    return None
        raise KeyError(name)

    def wait_all(self, timeout_s: float, exclude: tuple[str, ...] = ()) -> bool:
        """Wait for every process (but `exclude`) to exit on its own; True if they all did."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            if p.name in exclude:
                continue
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop_all(self, grace_s: float = 20.0) -> None:
        """SIGTERM every running process, wait up to `grace_s` in all, then SIGKILL the process
        groups of those still running. Children a stopped process left behind in its group (an
        engine core, a process pool) are killed too, so nothing outlives the supervisor."""
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing", p.name, grace_s)
                _killpg(p.popen.pid)
                p.popen.wait()
        for p in self.procs:
            _killpg(p.popen.pid)  # leftovers only: every leader has exited by now

    def kill_all(self) -> None:
        """SIGKILL every process group now (a second Ctrl-C while stopping)."""
        for p in self.procs:
            _killpg(p.popen.pid)

    def dump_stacks(self, wait_s: float = 1.0) -> None:
        """Have every running process write its threads' stacks to its log (SIGUSR1, see
        shared.logs.setup_logging): where a stuck service is stuck."""
        for p in self.procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.popen.send_signal(signal.SIGUSR1)
        time.sleep(wait_s)

    def tail(self, name: str, lines: int = 30) -> str:
        for p in self.procs:
            if p.name == name and p.log_path.exists():
                return "\n".join(p.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stuck_report(self, names: Sequence[str], lines: int = 25) -> str:
        """Where each of `names` is: its last `lines` log lines (stack dumps left out) and, after
        `dump_stacks`, its threads' stacks through this project's code (`project_stacks`). Short
        enough to survive a CI log's truncation."""
        out = []
        for name in names:
            text = self.tail(name, 100_000)
            log_lines, stacks = split_stack_dump(text)
            # the engine's own chatter and progress bars say nothing of where a service is
            log_lines = [ln for ln in log_lines if ln.strip() and not ln.startswith("(") and "it/s]" not in ln]
            out += [f"--- {name}:", *log_lines[-lines:], *project_stacks(stacks)]
        return "\n".join(out)


_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)$')


def split_stack_dump(text: str) -> tuple[list[str], list[list[str]]]:
    """A log's own lines, and the threads of the last faulthandler dump in it (each its header
    line and frame lines, most recent first)."""
    lines: list[str] = []
    threads: list[list[str]] = []
    current: list[str] | None = None
    in_dump = False  # inside a dump: thread blocks separated by blank lines
    for line in text.splitlines():
        if _THREAD.match(line):
            if not in_dump:
                threads = []  # a later dump replaces an earlier one
            current, in_dump = [line], True
            threads.append(current)
        elif current is not None and _FRAME.match(line):
            current.append(line)
        elif in_dump and not line.strip():
            current = None
        else:
            current, in_dump = None, False
            lines.append(line)
    return lines, threads


def project_stacks(threads: list[list[str]]) -> list[str]:
    """Each thread that runs this project's code, one line: its innermost frames of ours
    (func@module:line, most recent first), after the library frame it is in."""
    root = str(Path(__file__).resolve().parent.parent)
    out = []
    for t in threads:
        frames = [m.groupdict() for m in map(_FRAME.match, t[1:]) if m]
        ours = [f for f in frames if f["path"].startswith(root) and "/.venv/" not in f["path"]]
        if not ours:
            continue
        inner = frames[0]
        where = f"{Path(inner['path']).name}:{inner['line']} {inner['func']}"
        chain = " <- ".join(f"{f['func']}@{Path(f['path']).stem}:{f['line']}" for f in ours[:8])
        out.append(f"  [{t[0].split(' (')[0]}] in {where}: {chain}")
    return out


def _killpg(pgid: int) -> None:
    # ProcessLookupError: the group is gone; PermissionError: only zombies are left in it (macOS).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# --- the `python -m asyncrl.launch` command ---------------------------------------------------

ROLES = ("broker", "generator", "reward", "trainer", "admin")
DEFAULT_ROLES = ("broker", "generator", "reward", "trainer")
# Processes that serve until they are stopped; with one job (--spec, --job-id) the others exit
# when their job ends, and in a fleet every process is long-lived.
LONG_LIVED = ("broker", "admin")


@dataclass(frozen=True)
class Service:
    """One process the launcher starts: `python -m module *args` with `env` on top of its own."""

    name: str
    module: str
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()


def plan(
    roles: Sequence[str],
    generators: int,
    env: dict[str, str],
    host: str | None = None,
    trainers: int = 1,
) -> list[Service]:
    """The processes for `roles` on this box, broker first.

    Args:
        roles: names from `ROLES`.
        generators: generator replicas (when "generator" is in `roles`).
        trainers: trainer processes (when "trainer" is in `roles`): each trains one job at a time,
            so a fleet runs this many jobs at once. Each has a stable id (`<host>-trainer-<i>`):
            restarted, it takes its job's lease back at once (broker/fleet.py `JobLease`).
        env: the environment the services will see (for GEN_METRICS_PORT, ADMIN_QUEUE, LOG_LEVEL).
        host: consumer-name prefix; default this machine's hostname, so names stay unique when
            other nodes run replicas of the same job.

    Raises:
        ValueError: an unknown role, or several generators asked to share one metrics port.
    """
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown role(s) {', '.join(unknown)}; valid: {', '.join(ROLES)}")
    host = host or socket.gethostname()
    out: list[Service] = []
    if "broker" in roles:
        out.append(Service("broker", "broker"))
    if "generator" in roles:
        base_port = int(env.get("GEN_METRICS_PORT", "0") or 0)
        for i in range(generators):
            gen_env = {"GEN_GENERATOR_ID": f"{host}-gen-{i}"}
            if base_port:  # one port per replica: GEN_METRICS_PORT, +1, +2, ...
                gen_env["GEN_METRICS_PORT"] = str(base_port + i)
            out.append(Service(f"generator-{i}", "generator_svc", gen_env))
    if "reward" in roles:
        out.append(Service("reward", "reward_svc"))
    if "trainer" in roles:
        base_port = int(env.get("TRAINER_METRICS_PORT", "0") or 0)
        for i in range(trainers):
            t_env = {"TRAINER_CONSUMER_ID": f"{host}-trainer-{i}"}
            if base_port:  # one port per trainer: TRAINER_METRICS_PORT, +1, +2, ...
                t_env["TRAINER_METRICS_PORT"] = str(base_port + i)
            out.append(Service("trainer" if i == 0 else f"trainer-{i}", "trainer_svc", t_env))
    if "admin" in roles:
        queue = env.get("ADMIN_QUEUE", "admin")
        level = env.get("LOG_LEVEL", "INFO")
        out.append(
            Service(
                "admin",
                "celery",
                args=(
                    "-A",
                    "broker.admin",
                    "worker",
                    "-Q",
                    queue,
                    "--concurrency",
                    "1",
                    "--loglevel",
                    level,
                    "-n",
                    f"admin@{host}",
                ),
            )
        )
    return out


def supervise(
    sup: Supervisor,
    stop: threading.Event,
    poll_s: float = 0.5,
    policy: RestartPolicy = RestartPolicy(),
    long_lived: Sequence[str] = LONG_LIVED,
    idle: Callable[[], bool] | None = None,
    job_end: Callable[[], JobEnd | None] | None = None,
) -> int:
    """Watch `sup`'s processes until the job's services are all done, one fails past `policy`,
    `idle()` says the fleet has nothing left to do, or `stop` is set. A failed process (non-zero
    exit, or one of `long_lived` exiting at all) is restarted when `policy` allows, with the
    reason logged, unless `job_end()` (the one job a `--spec` / `--job-id` run serves) says that
    job has ended: a restart would only serve it into the same end (or, before the services
    refused an ended job, replay its last batch into the same error until the restarts ran out).

    Returns:
        1 when a process failed and was not restarted, 0 when every job service (generator,
        reward, trainer) exited 0 or `idle()` answered True, 130 when `stop` was set. Stops
        nothing: the caller calls `sup.stop_all()`.
    """
    long_lived = tuple(long_lived)
    last_idle_check = 0.0
    due: dict[str, float] = {}  # name -> monotonic time of its pending restart
    while not stop.wait(poll_s):
        now = time.monotonic()
        for p in list(sup.procs):
            code = p.popen.poll()
            if code is None or (code == 0 and not any(p.name.startswith(n) for n in long_lived)):
                continue
            if p.name in due:
                if now >= due[p.name]:
                    del due[p.name]
                    q = sup.restart(p)
                    log.warning(
                        "restarted %s (pid %d; restart %d within %.0f s)",
                        p.name,
                        q.popen.pid,
                        len(q.restarts),
                        policy.window_s,
                    )
                continue
            ended = job_end() if job_end is not None and policy.on_failure else None
            if ended is not None:
                log.error(
                    "%s exited with code %s; not restarted: its job %s. Last lines of %s:\n%s",
                    p.name,
                    code,
                    ended,
                    p.log_path,
                    sup.tail(p.name),
                )
                return 1
            delay = policy.delay(p, now)
            if delay is None:
                why = "restart budget spent" if policy.on_failure else "no restart policy"
                log.error(
                    "%s exited with code %s (%s); stopping the rest. Last lines of %s:\n%s",
                    p.name,
                    code,
                    why,
                    p.log_path,
                    sup.tail(p.name),
                )
                return 1
            log.warning(
                "%s exited with code %s; restarting in %.1f s. Last lines of %s:\n%s",
                p.name,
                code,
                delay,
                p.log_path,
                sup.tail(p.name, 10),
            )
            due[p.name] = now + delay
        job_procs = [p for p in sup.procs if not any(p.name.startswith(n) for n in long_lived)]
        if job_procs and not due and all(p.popen.poll() == 0 for p in job_procs):
            log.info("every job service exited 0: the job is over")
            return 0
        if idle is not None and now - last_idle_check >= 2.0:
            last_idle_check = now
            if idle():
                log.info("no job is queued or running: the fleet exits (--exit-when-idle)")
                return 0
    return 130


@dataclass(frozen=True)
class JobEnd:
    """How the one job of a `--spec` / `--job-id` run ended: its state and error."""

    job_id: str
    state: str
    error: str | None = None

    def __str__(self) -> str:
        return f"{self.job_id} is {self.state}" + (f": {self.error}" if self.error else "")


class JobState:
    """`--spec` / `--job-id`: the one job's end, read from this box's API; None while it is live
    (queued, running, paused, stopping) or when the API cannot say (it is not up yet, a transient
    error: a restart is then decided as without it)."""

    LIVE = ("queued", "running", "paused", "stopping")  # broker.fleet.LIVE_STATES

    def __init__(self, api: str, job_id: str):
        self.api, self.job_id = api, job_id

    def __call__(self) -> JobEnd | None:
        import httpx

        try:
            resp = httpx.get(f"{self.api}/jobs/{self.job_id}", headers=_auth_headers(), timeout=5)
            body = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(body, dict) or not isinstance(body.get("state"), str) or body["state"] in self.LIVE:
            return None
        state, error = body["state"], body.get("error")
        return JobEnd(self.job_id, state, str(error)[:500] if error else None)


class QueueEmpty:
    """`--exit-when-idle`: True once the API's queue shows nothing queued or running, after the
    fleet ran a job or `grace_s` passed since the start (a script submits after the launch)."""

    def __init__(self, api: str, grace_s: float = 60.0):
        self.api, self.deadline, self.seen = api, time.monotonic() + grace_s, False

    def __call__(self) -> bool:
        import httpx

        try:
            resp = httpx.get(f"{self.api}/queue", headers=_auth_headers(), timeout=5)
            body = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return False
        if not isinstance(body, dict):
            return False
        busy = bool(body.get("running") or body.get("queued"))
        self.seen |= busy
        return not busy and (self.seen or time.monotonic() > self.deadline)


def wait_healthy(url: str, sup: Supervisor, name: str, timeout_s: float, stop: threading.Event | None = None) -> None:
    """Poll `url` until it answers 200 (or `stop` is set).

    Raises:
        RuntimeError: process `name` exited first.
        TimeoutError: no answer within `timeout_s`.
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (stop and stop.is_set()):
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if sup.wait(name, 0) is not None:
            raise RuntimeError(f"{name} exited before {url} answered:\n{sup.tail(name)}")
        time.sleep(0.2)
    if stop and stop.is_set():
        return
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s; see {sup.logdir / name}.log")


def _auth_headers() -> dict[str, str]:
    """A read-write token of this box's API (BROKER_TOKENS...), if it has any."""
    from broker.api import configured_tokens
    from shared.settings import BrokerSettings

    rw = [t for t, role in configured_tokens(BrokerSettings()).items() if role == "rw"]
    return {"Authorization": f"Bearer {rw[0]}"} if rw else {}


def _submit(api: str, spec_path: Path, job_id: str | None = None) -> str:
    """Submit a job spec file to the API (as `job_id`, when given); returns the job id."""
    import httpx

    resp = httpx.post(
        f"{api}/jobs",
        json=json.loads(spec_path.read_text()),
        headers=_auth_headers(),
        timeout=30,
        params={"job_id": job_id} if job_id else None,
    )
    if resp.status_code != 201:
        raise RuntimeError(f"job submission failed ({resp.status_code}): {resp.text}")
    return str(resp.json()["id"])


def spec_placement(spec_path: Path | None) -> str:
    """The placement the launcher plans: the job spec's (`--spec`), else NODE_PLACEMENT (split,
    colocated, or off: as --no-placement), else split.

    Raises:
        ValueError: the spec file does not parse as JSON, or names an unknown placement (the API
            validates the rest when the spec is submitted).
    """
    if spec_path is None:
        return os.environ.get("NODE_PLACEMENT") or "split"
    try:
        mode = json.loads(spec_path.read_text()).get("placement", "split")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"--spec {spec_path}: {exc}") from exc
    if mode not in ("split", "colocated"):
        raise ValueError(f"--spec {spec_path}: placement {mode!r}; valid are split, colocated")
    return str(mode)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m asyncrl.launch",
        description="Start the broker API, N generators, the reward service and the trainer (and "
        "optionally the Celery admin worker) on this box as supervised processes, one log each. "
        "Settings come from the environment (see deploy/env.example). Ctrl-C or SIGTERM stops "
        "them all: SIGTERM, a grace period, then SIGKILL; a second Ctrl-C kills at once.",
    )
    ap.add_argument("--generators", type=int, default=1, help="generator replicas (default 1)")
    ap.add_argument(
        "--trainers",
        type=int,
        default=1,
        help="trainer processes (default 1): the fleet runs this many jobs at once, sharing its "
        "generators and reward service",
    )
    ap.add_argument(
        "--roles",
        default=",".join(DEFAULT_ROLES),
        help=f"comma-separated subset of {','.join(ROLES)} (default %(default)s)",
    )
    ap.add_argument("--admin", action="store_true", help="also start the Celery admin worker")
    ap.add_argument(
        "--job-id",
        help="serve this one job (sets JOB_ID), then exit; default: JOB_ID, else serve the fleet's queue until stopped",
    )
    ap.add_argument("--spec", type=Path, help="submit this job spec once the API is up, serve it, then exit")
    ap.add_argument(
        "--exit-when-idle",
        action="store_true",
        help="serving the queue: exit 0 once no job is queued or running (after a first job, or 60 s)",
    )
    ap.add_argument("--logdir", type=Path, help="default runs/launch/<timestamp>")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL (default 30)")
    ap.add_argument(
        "--start-timeout", type=float, default=120.0, help="seconds to wait for the broker's /health (default 120)"
    )
    ap.add_argument(
        "--no-placement",
        action="store_true",
        help="start services unpinned with default thread counts (default: split this box's cores "
        "between the roles, shared.placement; a --spec job's placement: split or colocated; "
        "GEN_CPUS / TRAINER_CPUS / REWARD_CPUS override)",
    )
    ap.add_argument(
        "--restart",
        choices=("on-failure", "no"),
        default="on-failure",
        help="restart a process that fails (default %(default)s), within the budget below",
    )
    ap.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of one process within --restart-window before a failure stops the run (default 5)",
    )
    ap.add_argument("--restart-window", type=float, default=600.0, help="seconds (default 600)")
    ap.add_argument(
        "--private-redis",
        action="store_true",
        help="with no REDIS_URL and no Redis on 127.0.0.1:6379, start a private "
        "redis-server for this run (its data is lost when the launcher exits)",
    )
    args = ap.parse_args(argv)
    args.roles = [r.strip() for r in args.roles.split(",") if r.strip()] + (["admin"] if args.admin else [])
    if args.generators < 0:
        ap.error("--generators must be 0 or more")
    if args.spec and args.job_id:
        ap.error("give --spec or --job-id, not both")
    if args.exit_when_idle and (args.spec or args.job_id or "broker" not in args.roles):
        ap.error("--exit-when-idle is for a fleet serving the queue with its broker: not with --spec or --job-id")
    if args.spec and "broker" not in args.roles:
        ap.error("--spec submits through this box's API: keep 'broker' in --roles")
    if "admin" in args.roles and importlib.util.find_spec("broker.admin") is None:
        ap.error("the admin worker needs broker/admin.py, which this checkout does not have")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m asyncrl.launch`; returns the exit code (0 job done, 1 a process failed, 130 stopped)."""
    from broker.redis_server import resolve_redis_url
    from shared.logs import setup_logging
    from shared.settings import BrokerSettings

    args = _parse(argv)
    setup_logging("launch", os.environ.get("LOG_LEVEL", "INFO"))
    try:
        args.placement = spec_placement(args.spec)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if args.placement == "off":
        args.no_placement, args.placement = True, "split"
    # One line per health poll otherwise (alembic's plugin lines: setup_logging); the services'
    # own logs keep theirs.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        services = plan(args.roles, args.generators, dict(os.environ), trainers=args.trainers)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    # Resolved once here: services left to find Redis themselves could each start a private one.
    redis_url, private = resolve_redis_url(os.environ.get("REDIS_URL"), allow_embedded=args.private_redis)
    env = {"REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    fleet = not (args.job_id or args.spec or os.environ.get("JOB_ID"))
    if args.job_id:
        env["JOB_ID"] = args.job_id
    elif args.spec:
        # The id the spec will be submitted under, chosen here: every service starts now, told its
        # JOB_ID, and imports, builds its engine or model and waits for the job while the API starts.
        env["JOB_ID"] = uuid.uuid4().hex[:12]
    logdir = args.logdir or Path("runs/launch") / time.strftime("%Y%m%d-%H%M%S")
    sup = Supervisor(logdir, env)
    log.info("redis %s%s; logs in %s", redis_url, " (private server)" if private else "", sup.logdir.resolve())

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            log.warning("second %s: killing every process now", signal.Signals(signum).name)
            sup.kill_all()
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 1
    api: str | None = None  # this box's API, when it runs the broker
    try:
        # Every process starts at once: none needs another to be up first (services wait for
        # their job in the ledger), so their imports and engine builds overlap the API's start.
        rest = services
        if services and services[0].name == "broker":
            sup.start("broker", "broker")
            rest = services[1:]
        # The services placed here (or left unplaced by --no-placement) must not place themselves again.
        sup.env["NODE_PLACEMENT"] = "off"
        placed = (
            {}
            if args.no_placement
            else plan_placement(
                [(s.name, s.module) for s in rest],
                sorted(os.sched_getaffinity(0)),
                {**os.environ, **env},
                gpu_count(),
                mode=args.placement,
            )
        )
        for s in rest:
            if stop.is_set():
                break
            where = placed.get(s.name)
            if where is not None and (where.cpus or where.env):
                log.info(
                    "placing %s on cores %s %s",
                    s.name,
                    cpuset(sorted(where.cpus)) if where.cpus else "(any)",
                    " ".join(f"{k}={v}" for k, v in sorted(where.env.items())),
                )
            sup.start(
                s.name,
                s.module,
                {**(where.env if where else {}), **s.env},
                cpus=set(where.cpus) if where and where.cpus else None,
                args=s.args,
            )
        if services and services[0].name == "broker" and not stop.is_set():
            bs = BrokerSettings()
            host = "127.0.0.1" if bs.host in ("0.0.0.0", "::", "") else bs.host
            api = f"http://{host}:{bs.port}"
            wait_healthy(f"{api}/health", sup, "broker", args.start_timeout, stop)
            log.info("broker API at %s (status page %s/)", api, api)
            if args.spec and not stop.is_set():
                _submit(api, args.spec, sup.env["JOB_ID"])
                log.info("submitted %s as job %s", args.spec, sup.env["JOB_ID"])
        policy = RestartPolicy(args.restart == "on-failure", args.max_restarts, args.restart_window)
        idle = QueueEmpty(api) if args.exit_when_idle and api else None
        # the one job's end: a service of an ended job is not restarted, and a failed job fails the run
        job_id = sup.env.get("JOB_ID") or os.environ.get("JOB_ID")
        job_end = JobState(api, job_id) if api and job_id else None
        if fleet:
            log.info("serving the queue of jobs submitted to the API until stopped%s", " or idle" if idle else "")
        code = (
            130
            if stop.is_set()
            else supervise(
                sup, stop, policy=policy, idle=idle, long_lived=ROLES if fleet else LONG_LIVED, job_end=job_end
            )
        )
        if code == 0 and job_end is not None and (ended := job_end()) is not None and ended.state == "failed":
            log.error("job %s", ended)
            code = 1
    except (RuntimeError, TimeoutError) as exc:
        log.error("%s", exc)
    finally:
        if code != 0:
            log.info("stopping %d process(es) (SIGTERM, then SIGKILL after %.0f s)", len(sup.procs), args.grace)
        sup.stop_all(args.grace)
        for p in sup.procs:
            log.info("%-12s exit %-4s log %s", p.name, p.popen.returncode, p.log_path)
        if private:
            private.close()
    log.info("logs in %s", sup.logdir.resolve())
    return code


if __name__ == "__main__":
    sys.exit(main())
