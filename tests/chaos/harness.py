"""Chaos harness: one real job, every service a process, faults on a seeded schedule.

Pieces:

- `RedisAOF`: a private redis-server with AOF on (`appendfsync everysec`) in a temp dir, which
  can be shut down gracefully (SHUTDOWN writes the AOF) and started again on the same port and dir.
- `Witness`: a thread that follows the prompts stream with plain XREAD (no consumer group, so it
  changes nothing) and records every prompt group the trainer fed, with the time it saw it. That
  is the independent list the loss count is taken against: the ledger only holds groups that were
  generated.
- `Stack`: the services under a `asyncrl.launch.Supervisor`, with SIGKILL (of the whole process
  group: vLLM's engine core dies with its generator) and SIGTERM by role, restarts with the same
  consumer names, and a record of every fault.
- `account`: what happened to every fed group, from the witness, the ledger, the dead-letter
  stream and the final feed journal (definitions in its docstring).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from asyncrl.launch import Supervisor
from broker.ledger import USED_STATUSES, Ledger
from broker.streams import PROMPTS, JobStreams, connect
from shared.schema import DecodeError, EvalRound, PromptGroup, decode
from trainer_svc.feeder import dead_members

REDIS_SERVER = "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisAOF:
    """A private redis-server with AOF on, restartable on the same port and data directory.
    `appendonly=False`: no persistence at all, so every restart comes back empty."""

    def __init__(self, workdir: Path, appendonly: bool = True):
        self.appendonly = appendonly
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout_s: float = 20.0) -> None:
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--dir",
                str(self.dir),
                "--logfile",
                str(self.dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if redis.Redis.from_url(self.url, socket_timeout=0.5).ping():
                    return
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; see {self.dir}/redis.log")
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Graceful: SHUTDOWN flushes and fsyncs the AOF, then the server exits."""
        with contextlib.suppress(redis.ConnectionError):  # the server closes the connection as it exits
            redis.Redis.from_url(self.url, socket_timeout=5).shutdown()
        assert self.proc is not None
        self.proc.wait(30)

    def kill(self) -> None:
        """SIGKILL: what the AOF had not fsynced (at most ~1 s with everysec) is gone."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Witness(threading.Thread):
    """Records every prompt group XADDed to `{job}:prompts` (group id -> (n, purpose, seen at)).

    The trainer trims acked entries, so a witness too slow could miss some: `missed()` compares
    what it read with the stream's own count of entries ever added (XINFO STREAM)."""

    def __init__(self, redis_url: str, job_id: str, prefix: str, interval_s: float = 0.1):
        super().__init__(daemon=True)
        self.streams = JobStreams(connect(redis_url), job_id, prefix=prefix)
        self.interval_s = interval_s
        self.fed: dict[str, tuple[int, str, float]] = {}
        self.seen = 0  # entries read, garbage included
        self.errors = 0
        self._last = "0"
        self._halt = threading.Event()

    def run(self) -> None:
        key = self.streams.key(PROMPTS)
        while not self._halt.is_set():
            try:
                for _k, entries in self.streams.r.xread({key: self._last}, count=1000) or []:
                    for eid, fields in entries:
                        self._last = eid.decode()
                        self.seen += 1
                        try:
                            m = decode(fields.get(b"d", b""), (PromptGroup, EvalRound))
                        except DecodeError:
                            continue  # the injected garbage
                        for g in m.groups() if isinstance(m, EvalRound) else [m]:
                            assert isinstance(g, PromptGroup)
                            self.fed.setdefault(g.group_id, (g.n, g.purpose, time.time()))
            except redis.RedisError:
                self.errors += 1  # Redis restarting: read on when it is back
            self._halt.wait(self.interval_s)

    def missed(self) -> int:
        """Entries XADDed that the witness never read (garbage included: an injected entry is
        dead-lettered, acked and trimmed within milliseconds, so some go unseen)."""
        return int(self.streams.r.xinfo_stream(self.streams.key(PROMPTS))["entries-added"]) - self.seen

    def missed_groups(self) -> int:
        """Prompt groups the feeders fed that the witness never saw. Training groups carry a feed
        counter that every trainer run continues (`{job}/{run}/g{seq}`), eval groups a round
        counter and the problem index: every counter value up to the highest seen must be there."""
        seqs, rounds, problems = set(), {}, set()
        for gid in self.fed:
            last, prev = gid.rsplit("/", 2)[-1], gid.rsplit("/", 2)[-2]
            if last.startswith("g"):
                seqs.add(int(last[1:]))
            else:
                rounds.setdefault(int(prev.removeprefix("e")), set()).add(last)
                problems.add(last)
        missing = len(set(range(max(seqs, default=-1) + 1)) - seqs)
        missing += len(set(range(max(rounds, default=-1) + 1)) - rounds.keys())
        return missing + sum(len(problems - got) for got in rounds.values())

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


@dataclass
class Fault:
    kind: str  # "sigkill", "sigterm", "redis_restart", "redis_outage", "inject"
    role: str  # generator / reward / trainer / redis / streams
    name: str  # process name (gen-0, ...)
    at: float  # wall-clock time.time()
    phase: str
    step_at: int = 0  # trainer step in the ledger when the fault hit
    restarted_at: float | None = None
    recovered_at: float | None = None
    exit_code: int | None = None
    detail: str = ""

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.at


@dataclass
class Stack:
    """The services of one job under a Supervisor; process names are also their consumer names."""

    sup: Supervisor
    job_id: str
    ledger: Ledger
    modules: dict[str, tuple[str, str, dict[str, str]]]  # name -> (role, module, env)
    procs: dict[str, Any] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    starts: dict[str, int] = field(default_factory=dict)
    killed: set[int] = field(default_factory=set)  # pids stopped on purpose

    def start(self, name: str) -> None:
        role, module, env = self.modules[name]
        n = self.starts.get(name, 0)
        self.starts[name] = n + 1
        # one log per incarnation: a crashed one's tail stays readable
        self.procs[name] = self.sup.start(f"{name}.{n}", module, {"JOB_ID": self.job_id, **env})

    def alive(self, name: str) -> bool:
        return self.procs[name].popen.poll() is None

    def step(self) -> int:
        return (self.ledger.last_train_step(self.job_id) or {"step": 0})["step"]

    def kill(self, name: str, phase: str, sig: int = signal.SIGKILL) -> Fault:
        p = self.procs[name]
        self.killed.add(p.popen.pid)
        f = Fault(
            "sigkill" if sig == signal.SIGKILL else "sigterm",
            self.modules[name][0],
            name,
            time.time(),
            phase,
            self.step(),
        )
        if sig == signal.SIGKILL:
            os.killpg(p.popen.pid, signal.SIGKILL)
        else:
            p.popen.send_signal(sig)
        f.exit_code = p.popen.wait(120)
        if sig == signal.SIGKILL:  # nothing of it may linger (vLLM's engine core is a child)
            _killpg_quiet(p.popen.pid)
        self.faults.append(f)
        return f

    def restart(self, f: Fault, delay_s: float) -> None:
        time.sleep(delay_s)
        self.start(f.name)
        f.restarted_at = time.time()

    def unexpected_exits(self) -> list[str]:
        """Processes that died on their own (every deliberate kill has already been waited for)."""
        return [
            f"{n}: exit {p.popen.returncode}\n{self.sup.tail(p.name, 40)}"
            for n, p in self.procs.items()
            if p.popen.poll() not in (None, 0) and p.popen.pid not in self.killed
        ]


def _killpg_quiet(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def ts(dt) -> float:
    return dt.timestamp()


def measure_recovery(faults: Iterable[Fault], ledger: Ledger, job_id: str) -> None:
    """Kill -> the role doing useful work again, from the ledger's own timestamps: a generator's
    next sample row (its generator id), the reward service's next scored sample, the trainer's
    next new step (a step number beyond the one in the ledger at the kill; re-done steps keep
    their first created_at). Redis: the next new trainer step after the restart."""
    samples = ledger.samples(job_id)
    steps = sorted((s["step"], ts(s["created_at"])) for s in ledger.train_steps(job_id))
    created: dict[str, list[float]] = {}
    scored: list[float] = []
    for s in samples:
        created.setdefault(s["generator_id"], []).append(ts(s["created_at"]))
        if s["scored_at"] is not None:
            scored.append(ts(s["scored_at"]))
    for times in created.values():
        times.sort()
    scored.sort()
    for f in faults:
        if f.kind not in ("sigkill", "sigterm", "redis_restart"):
            continue
        after = f.restarted_at or f.at
        if f.role == "generator":
            cand = [t for t in created.get(f.name, []) if t > after]
        elif f.role == "reward":
            cand = [t for t in scored if t > after]
        else:  # trainer, redis
            cand = [t for s, t in steps if s > f.step_at and t > f.at]
        f.recovered_at = min(cand) if cand else None


def rate(steps: list[tuple[int, float]], t0: float, t1: float) -> float:
    """New steps per second within [t0, t1] (progress of the step counter)."""
    inside = [s for s, t in steps if t0 <= t <= t1]
    before = [s for s, t in steps if t < t0]
    if not inside:
        return 0.0
    return (max(inside) - max(before, default=0)) / (t1 - t0)


def stepping_share(ledger: Ledger, job_id: str, t0: float, t1: float) -> float:
    """Share of [t0, t1] the trainer spent in optimizer steps (time/train_s of steps ending inside)."""
    busy = sum(
        s["metrics"].get("time/train_s", 0.0) for s in ledger.train_steps(job_id) if t0 <= ts(s["created_at"]) <= t1
    )
    return busy / (t1 - t0)


@dataclass
class Accounting:
    fed: int
    terminal: int
    in_flight_end: int
    in_flight_bound: int
    lost: list[str]
    dead_groups: int
    trained_twice_ledger: int
    trained_twice_metric: int
    statuses: dict[str, int]
    # groups the trainer settled `lost` (no stream held anything of them: Redis lost them, e.g. the
    # last second of writes a SIGKILL takes from an everysec AOF): accounted, not silently gone
    redis_lost: int = 0


def account(
    witness: Witness,
    ledger: Ledger,
    streams: JobStreams,
    job_id: str,
    checkpoint_dir: Path,
    in_flight_bound: int,
    group_size: int,
) -> Accounting:
    """What became of every prompt group fed: those the witness saw, plus any it missed that the
    ledger knows (call `witness.missed_groups()` afterwards: it must be 0 for the count to be
    complete).

    A group is **terminal** when every one of its n samples has a ledger row in a used status
    (trained, dropped with a reason, evaluated), or when a dead letter names it (the prompt group
    itself, or one of its samples) and none of its rows is left unused. A group is **in flight at
    the end** when the final feed journal (the trainer's record of what it fed and has not used)
    still names it, or it belongs to an eval round still open: the job was stopped with it in the
    pipeline, which the staleness cap bounds by (k + 1) * prompts_per_step groups. **Lost** is
    every other fed group: fed, never finished, never dead-lettered, and not in flight.

    **Trained twice**: (group, sample index) pairs with more than one `trained` row (the ledger,
    as verify's trained_once), and the sum of the trainer's `ledger/trained_twice` step metric
    (samples the ledger already had as used when a step recorded them, re-done steps excepted).
    """
    rows: dict[str, list[dict]] = {}
    for s in ledger.samples(job_id):
        rows.setdefault(s["group_id"], []).append(s)
    # A group generated and trimmed between two witness reads is known from its ledger rows; one
    # with neither would leave a hole in the feed counters (Witness.missed_groups).
    for gid, mine in rows.items():
        witness.fed.setdefault(gid, (group_size if mine[0]["kind"] == "train" else 1, mine[0]["kind"], 0.0))
    dead: set[str] = set()
    for dl in streams.dead_letters(count=1_000_000):
        dead.update(m.group_id for m in dead_members(dl))
    journal = json.loads((checkpoint_dir / job_id / "feed-journal.json").read_text())
    in_flight = set(journal["in_flight"]) | {
        g for g in witness.fed if any(g.startswith(r + "/") for r in journal["open_evals"])
    }
    terminal, flying, redis_lost, lost = 0, 0, 0, []
    for gid, (n, _purpose, _t) in witness.fed.items():
        mine = rows.get(gid, [])
        used = {r["sample_index"] for r in mine if r["status"] in USED_STATUSES}
        unused = [r for r in mine if r["status"] not in USED_STATUSES]
        if mine and all(r["status"] == "lost" for r in mine):
            redis_lost += 1
        elif len(used) == n or (gid in dead and not unused):
            terminal += 1
        elif gid in in_flight:
            flying += 1
        else:
            lost.append(gid)
    twice_ledger = 0
    pairs: dict[tuple[str, int], int] = {}
    for s in ledger.samples(job_id, status="trained"):
        key = (s["group_id"], s["sample_index"])
        pairs[key] = pairs.get(key, 0) + 1
    twice_ledger = sum(1 for c in pairs.values() if c > 1)
    twice_metric = int(sum(s["metrics"].get("ledger/trained_twice", 0) or 0 for s in ledger.train_steps(job_id)))
    return Accounting(
        len(witness.fed),
        terminal,
        flying,
        in_flight_bound,
        sorted(lost),
        len(dead & set(witness.fed)),
        twice_ledger,
        twice_metric,
        ledger.status_counts(job_id),
        redis_lost,
    )


def new_prefix(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}:"
