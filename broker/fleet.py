"""The standing fleet: long-lived services that serve the ledger's queue of jobs one after another.

A service started without JOB_ID is one of the fleet (ARCHITECTURE.md, "The fleet and its queue").
It keeps what is expensive for its whole life (the ledger's engine, the Redis client, and in the
role's own code the vLLM engine, torch and the model code, the reward pool) and takes its jobs as
values from `Fleet.jobs()`:

- a trainer trains one job at a time: the job a trainer left unfinished (running, paused or
  stopping, and no live trainer holds its lease: it died or was restarted; resumed from its
  checkpoint), else the head of the queue (`queued` -> `running`, priority first, then first in,
  first out: JobRepository.claim_next). Each job a trainer runs is leased to it in Redis
  (`JobLease`), so several trainers run several jobs and never the same one;
- generators and reward services serve every job the trainers run, each in a thread of its own
  (`Fleet.serve_all`): a generator joins a job its engine can serve beside the others (the
  role's `joinable`), the jobs the fewest of its role serve first.

A job a service cannot serve for a reason of the job's own (its spec no longer validates, its model
cannot be loaded by the engine, its reward plug-in does not import) fails alone with that reason
(`fail_everywhere`: state `failed`, and a `cancel` on its control stream so every service of it
leaves), and the fleet goes on with the next. Started with JOB_ID, a service serves that one job
and exits, as before the fleet (the launcher's `--spec`).

Every process of the fleet says what it does in one Redis hash (`<prefix>fleet`, a field per
service, JSON with a timestamp: `Beacon`), which GET /fleet and GET /queue read: a queue with no
trainer up says so instead of waiting in silence.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from broker.job_summary import drop_skew
from broker.ledger import Ledger
from broker.ledger.rows import JobRow
from broker.redis_server import redact_url, resolve_redis_url
from broker.runtime import JobContext, fail_job, spec_problem, wait_for_job
from broker.streams import CONTROL, JobStreams, connect, subscriber
from shared.entry import JobOver, accept_drain, drain_requested
from shared.ids import control_id
from shared.jobspec import JobSpec
from shared.logs import escape_control, set_context
from shared.rewards.base import failed_fraction
from shared.schema import Control
from shared.settings import CommonSettings

log = logging.getLogger(__name__)

# A job its generators and reward services serve: a trainer took it and has not ended it.
SERVED_STATES = ("running", "paused", "stopping")
LIVE_STATES = ("queued", *SERVED_STATES)
BEAT_S = 2.0  # how often a service of the fleet refreshes its entry
STALE_S = 15.0  # an entry older than this is a service that is gone
POLL_S = 0.2  # how often an idle service looks for its next job
FLEET_KEY = "fleet"
LEASE_S = 15.0  # a trainer's lease on its job lapses this long after its last beat


def wake_fleet(redis: Any, prefix: str) -> None:
    """Tell the fleet's idle services to look for their next job now (a job was queued or
    claimed) rather than at their next poll. Best effort: a lost wake-up costs one poll."""
    try:
        redis.publish(f"{prefix}{FLEET_KEY}:wake", b"1")
    except Exception as exc:
        log.debug("fleet wake-up: %s", exc)


def fail_everywhere(ledger: Ledger, streams: JobStreams, job_id: str, reason: str) -> None:
    """The job cannot run for a reason of its own: `failed` with `reason` (unless it already
    ended), and a `cancel` on its control stream, so every service serving it leaves it now."""
    if ledger.move_job(job_id, LIVE_STATES, "failed", error=reason[:2000]):
        log.error("job %s failed: %s", job_id, escape_control(reason))
    streams.publish(
        CONTROL,
        Control(
            job_id=job_id,
            msg_id=control_id("cancel", uuid.uuid4().hex[:8]),
            policy_version=0,
            command="cancel",
            reason=reason[:500],
        ),
    )


class Beacon:
    """This process's entry in the fleet's hash: role, the jobs it serves (`job`: the first, for
    readers of one job), since when, and its `load` per job (the role's `load` callable: share,
    busy seconds, tokens); refreshed every BEAT_S by a daemon thread, which also renews the
    trainer's lease (`lease`); removed when the process ends well."""

    def __init__(self, redis: Any, prefix: str, role: str, service_id: str):
        self.redis, self.key, self.field = redis, f"{prefix}{FLEET_KEY}", f"{role}:{service_id}"
        self.entry: dict[str, Any] = {
            "role": role,
            "id": service_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "job": None,
            "jobs": [],
            "load": {},
            "state": "starting",
            "since": time.time(),
            "jobs_served": 0,
        }
        self.load: Callable[[], dict[str, Any]] | None = None
        self.lease: JobLease | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-beacon", daemon=True)
        self._thread.start()

    def set(self, state: str, job: str | None) -> None:
        self.set_jobs([job] if job else [], state)

    def set_jobs(self, jobs: list[str], state: str | None = None) -> None:
        """The jobs served now (state `serving`, or `idle` with none, unless `state` says)."""
        state = state or ("serving" if jobs else "idle")
        with self._lock:
            if (state, jobs) == (self.entry["state"], self.entry["jobs"]):
                return
            self.entry.update(state=state, jobs=list(jobs), job=jobs[0] if jobs else None, since=time.time())
        self.beat()

    def served_one(self) -> None:
        """One more job served to its end (`jobs_served`)."""
        with self._lock:
            self.entry["jobs_served"] += 1

    def beat(self) -> None:
        try:
            load = self.load() if self.load is not None else {}
        except Exception as exc:  # noqa: BLE001 - a figure never takes a service down
            log.debug("fleet beacon load: %s", exc)
            load = {}
        with self._lock:
            entry = {**self.entry, "load": load, "ts": time.time()}
        try:
            self.redis.hset(self.key, self.field, json.dumps(entry))
            if self.lease is not None:
                self.lease.renew()
        except Exception as exc:  # a beacon never takes a service down; the next beat retries
            log.debug("fleet beacon: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            self.beat()

    def close(self) -> None:
        self._stop.set()
        try:
            self.redis.hdel(self.key, self.field)
            if self.lease is not None:
                self.lease.release()
        except Exception as exc:
            log.debug("fleet beacon: %s", exc)


class JobLease:
    """A trainer's claim on the job it trains, in Redis (`<prefix>fleet:lease:{<job>}`, the
    trainer's id, expiring LEASE_S after the last renewal by its beacon): of several trainers
    of one fleet, exactly one trains a job. A trainer killed mid-job leaves its job `running`
    with a lease that lapses; another trainer, or this one restarted under the same id (the
    launcher's ids are stable), then takes it and resumes it from its checkpoint."""

    # renew or release only a lease that is still this trainer's
    _IF_MINE = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "if ARGV[2] == '0' then return redis.call('del', KEYS[1]) end "
        "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
    )

    def __init__(self, redis: Any, prefix: str, owner: str):
        self.redis, self.prefix, self.owner = redis, prefix, owner
        self.job: str | None = None

    def key(self, job_id: str) -> str:
        return f"{self.prefix}{FLEET_KEY}:lease:{{{job_id}}}"

    def take(self, job_id: str) -> bool:
        """Lease `job_id` to this trainer: True when no one holds it or this trainer already does."""
        key, ms = self.key(job_id), int(LEASE_S * 1000)
        if self.redis.set(key, self.owner, nx=True, px=ms) or self.redis.eval(self._IF_MINE, 1, key, self.owner, ms):
            self.job = job_id
            return True
        return False

    def holder(self, job_id: str) -> str | None:
        raw = self.redis.get(self.key(job_id))
        return raw.decode() if isinstance(raw, bytes) else raw

    def renew(self) -> None:
        """Extend the lease; a lease Redis lost (it came back empty) is taken again at once."""
        if self.job is None:
            return
        key, ms = self.key(self.job), int(LEASE_S * 1000)
        if self.redis.eval(self._IF_MINE, 1, key, self.owner, ms):
            return
        if self.redis.set(key, self.owner, nx=True, px=ms):
            log.warning("the lease on job %s was gone (Redis lost it): taken again", self.job)
        else:
            log.error("the lease on job %s is no longer this trainer's (%s)", self.job, self.holder(self.job))

    def release(self) -> None:
        if self.job is not None:
            self.redis.eval(self._IF_MINE, 1, self.key(self.job), self.owner, 0)
            self.job = None


def fleet_members(redis: Any, prefix: str, now: float | None = None) -> list[dict[str, Any]]:
    """The fleet's live services (entries refreshed within STALE_S), by role then id; entries of
    services gone for an hour are removed on the way."""
    now = time.time() if now is None else now
    key = f"{prefix}{FLEET_KEY}"
    out, gone = [], []
    for field, raw in redis.hgetall(key).items():
        try:
            entry = json.loads(raw)
            age = now - float(entry["ts"])
        except (ValueError, KeyError, TypeError):
            gone.append(field)
            continue
        if age > 3600:
            gone.append(field)
        elif age <= STALE_S:
            out.append(entry)
    if gone:
        redis.hdel(key, *gone)
    return sorted(out, key=lambda e: (str(e.get("role")), str(e.get("id"))))


def queue_view(ledger: Ledger, members: list[dict[str, Any]]) -> dict[str, Any]:
    """GET /queue: the running jobs (each with its share and the services serving it), and each
    queued job's place in line and what it waits for."""
    running = ledger.list_jobs(limit=1000, states=SERVED_STATES)
    # job id -> role -> ids of the services serving it: a service's `jobs` (several at once), else
    # its `job` (an entry from before `jobs`); ids in the members' order (by role, then id)
    serving: dict[str, dict[str, list[str]]] = {}
    for m in members:
        for job_id in dict.fromkeys(str(j) for j in m.get("jobs") or ([m["job"]] if m.get("job") else [])):
            serving.setdefault(job_id, {}).setdefault(str(m.get("role")), []).append(str(m.get("id")))
    trainers = [m for m in members if m.get("role") == "trainer"]
    idle = [m for m in trainers if m.get("job") is None]
    queued = ledger.queue()
    out = []
    for pos, job in enumerate(queued, start=1):
        if not trainers:
            why = "no trainer is up: start the fleet (python -m asyncrl.launch) or a trainer (python -m trainer_svc)"
        elif pos > len(idle):
            ahead = [j["id"] for j in running][: len(trainers)] if pos == 1 else [q["id"] for q in queued[: pos - 1]]
            why = f"job {ahead[0]} to end" if pos == 1 and ahead else f"{pos - 1} job(s) ahead of it"
        else:
            why = "a trainer to take it (now)"
        out.append(
            {
                "id": job["id"],
                "name": job["name"],
                "position": pos,
                "priority": job["priority"],
                "submitted_at": job["created_at"],
                "waiting_for": why,
            }
        )
    return {
        "running": [
            {
                "id": j["id"],
                "name": j["name"],
                "state": j["state"],
                "step": j["step"],
                "steps": int(j["spec"].get("steps", 0)) if isinstance(j["spec"], dict) else 0,
                "priority": j["priority"],
                "share": float(j["spec"].get("share", 1.0)) if isinstance(j["spec"], dict) else 1.0,
                "served_by": serving.get(j["id"], {}),
                "started_at": j["started_at"],
                "reward_error_fraction": failed_fraction(ledger.reward_status_counts(j["id"])),
                "drop_skew_warnings": drop_skew(ledger.train_steps(j["id"]), j["spec"])["warnings"],
            }
            for j in running
        ],
        "queued": out,
        "trainers": len(trainers),
    }


class Fleet:
    """A long-lived service's link to the fleet: the ledger and Redis client it keeps, and the jobs
    it serves (`jobs`). `role` is trainer, generator or reward; `service_id` names it in the fleet."""

    def __init__(self, settings: CommonSettings, role: str, service_id: str):
        self.settings, self.role = settings, role
        self.url, _ = resolve_redis_url(settings.redis_url)
        self.ledger = Ledger(settings.database_url)
        self.redis = connect(self.url)
        self.done: set[str] = set()  # jobs this process served to their end (never taken again)
        self.attempts: dict[str, int] = {}
        self.service_id = service_id
        self.beacon = Beacon(self.redis, settings.stream_prefix, role, service_id)
        self.lease = JobLease(self.redis, settings.stream_prefix, service_id) if role == "trainer" else None
        self.beacon.lease = self.lease
        self._wakeups: Any = None
        self._lock = threading.Lock()  # `done` and `attempts`, shared by serve_all's job threads

    def close(self) -> None:
        self.beacon.close()
        if self._wakeups is not None:
            self._wakeups.close()

    def jobs(self) -> Iterator[JobContext]:
        """The jobs to serve, one at a time, each as a fresh JobContext: with JOB_ID, that job
        once (JobOver if it already ended, or if its spec no longer validates); else the fleet's,
        until SIGTERM."""
        if self.settings.job_id:
            job = wait_for_job(self.ledger, self.settings.job_id, self.settings.job_wait_s)
            if job["state"] not in LIVE_STATES:  # over: a restart must not serve it into the same end
                error = f": {escape_control(str(job['error']))[:500]}" if job.get("error") else ""
                raise JobOver(f"job {job['id']} is already {job['state']}{error}")
            reason = spec_problem(job)
            if reason is not None:
                fail_job(self.ledger, job, reason)
                raise JobOver(f"job {job['id']} failed: {reason}")
            if self.lease is not None:
                self._wait_lease(job["id"])
            self.beacon.set("serving", job["id"])
            yield self.open(job)
            return
        accept_drain()  # SIGTERM between jobs: exit at once, 0
        log.info(
            "%s serving the fleet's queue (redis %s, ledger %s)",
            self.role,
            redact_url(self.url),
            redact_url(self.settings.database_url),
        )
        while (nxt := self._next()) is not None:
            ctx = self.open(nxt)
            self.beacon.set("serving", nxt["id"])
            try:
                yield ctx
            finally:
                self.beacon.set("idle", None)
                self.beacon.served_one()
                set_context(job_id=None, policy_version=None)

    def _wait_lease(self, job_id: str) -> None:
        """JOB_ID's trainer: lease the job, waiting out the lease of a trainer that died (under
        another id) for up to twice LEASE_S."""
        assert self.lease is not None
        deadline = time.monotonic() + 2 * LEASE_S
        while not self.lease.take(job_id):
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} is trained by another live trainer ({self.lease.holder(job_id)})")
            log.info("job %s is leased to trainer %s; waiting for it to lapse", job_id, self.lease.holder(job_id))
            time.sleep(1.0)

    def serve(
        self,
        serve_job: Callable[[JobContext], str],
        job_faults: tuple[type[BaseException], ...] = (),
        on_job_fault: Callable[[], None] | None = None,
    ) -> None:
        """Run `serve_job` on each job of `jobs()` until SIGTERM: it returns the job's final control
        state ("terminating": this process was asked to stop, the job goes on). An exception of
        `job_faults` is the job's own fault (the job fails, `on_job_fault` runs); any other is
        retried (`failed`). With JOB_ID every exception propagates: the one job's service fails,
        and a job fault fails the job first (a restart would meet the same fault: it finds the job
        ended instead, `jobs`)."""
        for ctx in self.jobs():
            try:
                state = serve_job(ctx)
            except Exception as exc:
                fault = isinstance(exc, job_faults)
                if self.settings.job_id:
                    if fault:
                        fail_everywhere(
                            self.ledger, ctx.streams, ctx.job_id, f"{self.role}: {type(exc).__name__}: {exc}"
                        )
                    raise
                if not fault:
                    log.exception("%s: job %s", self.role, ctx.job_id)
                self.failed(ctx, exc, the_jobs_fault=fault)
                if fault and on_job_fault is not None:
                    on_job_fault()
                continue
            if state == "terminating":
                return
            self.served(ctx.job_id)

    def serve_all(
        self,
        serve_job: Callable[[JobContext], str],
        job_faults: tuple[type[BaseException], ...] = (),
        on_job_fault: Callable[[JobContext], None] | None = None,
        joinable: Callable[[JobRow, list[JobContext]], bool] = lambda job, serving: True,
        max_jobs: int = 8,
    ) -> None:
        """A generator's or reward service's loop: serve every job the trainers run at once, each
        in a thread of its own running `serve_job` (as `serve`: its exceptions, `job_faults` the
        job's own fault), up to `max_jobs`. A job is joined when `joinable(job, serving)` says
        this process can serve it beside the jobs it serves (a generator: its engine can), the
        jobs the fewest services of this role serve first, then the oldest. With JOB_ID: `serve`.
        Returns after SIGTERM, once every job's thread finished the work in hand."""
        if self.settings.job_id:
            self.serve(serve_job, job_faults)  # one job: its fault ends this process (`serve`)
            return
        accept_drain()
        log.info(
            "%s serving the fleet's jobs, up to %d at once (redis %s, ledger %s)",
            self.role,
            max_jobs,
            redact_url(self.url),
            redact_url(self.settings.database_url),
        )
        threads: dict[str, tuple[threading.Thread, JobContext]] = {}
        self.beacon.set_jobs([])
        collected = True
        while not drain_requested():
            for job_id in [j for j, (t, _) in threads.items() if not t.is_alive()]:
                threads.pop(job_id)[0].join()
            if not threads and not collected:
                gc.collect()  # what the last job left in reference cycles goes while idle
                collected = True
            for job in self._joinable_jobs(set(threads)):
                if len(threads) >= max_jobs:
                    break
                reason = spec_problem(job)
                if reason is not None:
                    fail_job(self.ledger, job, reason)
                    self.served(job["id"])
                    continue
                if not joinable(job, [c for _, c in threads.values()]):
                    continue
                ctx = self.open(job)
                thread = threading.Thread(
                    target=self._serve_one,
                    args=(ctx, serve_job, job_faults, on_job_fault),
                    name=f"job-{job['id']}",
                    daemon=True,
                )
                threads[job["id"]] = (thread, ctx)
                collected = False
                thread.start()
            self.beacon.set_jobs(sorted(threads))
            self._wait(POLL_S)
        for thread, _ in threads.values():  # SIGTERM: each finishes the work in hand
            thread.join()

    def _serve_one(
        self,
        ctx: JobContext,
        serve_job: Callable[[JobContext], str],
        job_faults: tuple[type[BaseException], ...],
        on_job_fault: Callable[[JobContext], None] | None,
    ) -> None:
        """One job's thread of `serve_all`: serve it to its end (never again), or, on an error,
        fail it (the job's own fault) or leave it to be taken again (`failed`)."""
        set_context(job_id=ctx.job_id)
        try:
            state = serve_job(ctx)
        except Exception as exc:
            fault = isinstance(exc, job_faults)
            if not fault:
                log.exception("%s: job %s", self.role, ctx.job_id)
            self.failed(ctx, exc, the_jobs_fault=fault)
            if fault and on_job_fault is not None:
                on_job_fault(ctx)
            return
        if state != "terminating":
            self.served(ctx.job_id)
            self.beacon.served_one()

    def _joinable_jobs(self, serving: set[str]) -> list[JobRow]:
        """The jobs trainers run that this process does not serve (nor served to their end), the
        ones the fewest live services of this role serve first, then the oldest."""
        live = [
            j
            for j in self.ledger.list_jobs(limit=1000, states=SERVED_STATES)
            if j["id"] not in self.done and j["id"] not in serving
        ]
        if not live:
            return []
        count: dict[str, int] = {}
        for m in fleet_members(self.redis, self.settings.stream_prefix):
            if m.get("role") == self.role and m.get("id") != self.service_id:
                for job_id in m.get("jobs") or ([m["job"]] if m.get("job") else []):
                    count[job_id] = count.get(job_id, 0) + 1
        return sorted(live, key=lambda j: (count.get(j["id"], 0), j["created_at"], j["id"]))

    def served(self, job_id: str) -> None:
        """The job is over for this service: never taken again by it."""
        with self._lock:
            self.done.add(job_id)
            self.attempts.pop(job_id, None)
        if self.lease is not None and self.lease.job == job_id:
            self.lease.release()

    def failed(self, ctx: JobContext, exc: BaseException, *, the_jobs_fault: bool) -> None:
        """Serving `ctx`'s job raised `exc`. The job's own fault (its model, data or plug-in): the
        job fails with the reason. Otherwise it is retried (this service takes it again after a
        pause), and failed after 3 attempts in a row."""
        with self._lock:
            n = self.attempts[ctx.job_id] = self.attempts.get(ctx.job_id, 0) + 1
        reason = f"{self.role}: {type(exc).__name__}: {exc}"
        if the_jobs_fault or n >= 3:
            fail_everywhere(self.ledger, ctx.streams, ctx.job_id, reason)
            self.served(ctx.job_id)
        else:
            log.error("job %s: %s (attempt %d of 3; taking it again)", ctx.job_id, escape_control(reason), n)
            time.sleep(min(5.0, 0.5 * 2**n))

    def open(self, job: JobRow) -> JobContext:
        spec = JobSpec.model_validate(job["spec"])
        set_context(job_id=job["id"])
        s = self.settings
        streams = JobStreams(
            self.redis,
            job["id"],
            prefix=s.stream_prefix,
            max_message_bytes=s.max_message_bytes,
            claim_idle_ms=s.claim_idle_ms,
            max_deliveries=s.max_deliveries,
        )
        streams.adopt_legacy_keys()
        log.info("serving job %s (%s)", job["id"], escape_control(spec.name))
        return JobContext(job["id"], spec, self.ledger, streams)

    def _next(self) -> JobRow | None:
        """The next job for this role, waiting for one; None once SIGTERM came."""
        pick: Callable[[], JobRow | None] = self._take if self.role == "trainer" else self._follow
        self.beacon.set("idle", None)
        waited, collected = time.monotonic(), False
        while not drain_requested():
            job = pick()
            if job is None and not collected:
                # What the last job left in reference cycles (a model, its optimizer) goes now,
                # while idle, rather than before a job that is already waiting.
                gc.collect()
                collected = True
                continue
            if job is not None:
                reason = spec_problem(job)
                if reason is None:
                    return job
                fail_job(self.ledger, job, reason)
                self.served(job["id"])
                continue
            if time.monotonic() - waited > 300:
                log.info("%s idle: no job to serve", self.role)
                waited = time.monotonic()
            self._wait(POLL_S)
        return None

    def _wait(self, timeout_s: float) -> None:
        """Until a wake-up (wake_fleet) or `timeout_s`."""
        try:
            if self._wakeups is None:
                channel = f"{self.settings.stream_prefix}{FLEET_KEY}:wake"
                self._wakeups = subscriber(self.redis, channel)
                self._wakeups.subscribe(channel)
            self._wakeups.get_message(timeout=timeout_s)
        except Exception as exc:  # no pub/sub (an outage): polling alone
            log.debug("fleet wake-ups: %s", exc)
            if self._wakeups is not None:
                with contextlib.suppress(Exception):
                    self._wakeups.close()
            self._wakeups = None
            time.sleep(timeout_s)

    def _take(self) -> JobRow | None:
        """Trainer: a job a trainer left unfinished (oldest first) whose lease lapsed (or is
        this trainer's), else the head of the queue. A claimed job is leased at once; of a claim
        and another trainer taking the fresh job as a left one, the lease decides: the other one
        starts it (from its initial model, as a resume of a job that took no step)."""
        assert self.lease is not None
        left = [j for j in self.ledger.list_jobs(limit=1000, states=SERVED_STATES) if j["id"] not in self.done]
        for job in sorted(left, key=lambda j: (j["created_at"], j["id"])):
            if self.lease.take(job["id"]):
                return job
        while (claimed := self.ledger.claim_next()) is not None:
            wake_fleet(self.redis, self.settings.stream_prefix)  # its generators and rewarders
            if self.lease.take(claimed["id"]):
                return claimed
        return None

    def _follow(self) -> JobRow | None:
        """One job at a time (`serve`, for a follower that serves jobs one by one): the job trainers
        run that the fewest of this role serve, then the oldest."""
        jobs = self._joinable_jobs(set())
        return jobs[0] if jobs else None
