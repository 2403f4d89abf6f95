"""Start-up shared by every service: find Redis, open the ledger, wait for the job, open its streams."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pydantic import ValidationError

from broker.ledger import Ledger
from broker.ledger.rows import JobRow, SampleIn
from broker.redis_server import redact_url, resolve_redis_url
from broker.streams import CONTROL, JobStreams, connect
from shared.entry import JobOver, accept_drain, drain_requested
from shared.jobspec import JobSpec, format_validation_error
from shared.logs import escape_control, set_context
from shared.schema import Control, Rollout
from shared.settings import CommonSettings

log = logging.getLogger(__name__)

# States a service without JOB_ID picks a job from, and how many of the newest it looks at.
PICKABLE_STATES = ("submitted", "running")
PICK_SCAN = 100


@dataclass
class JobContext:
    job_id: str
    spec: JobSpec
    ledger: Ledger
    streams: JobStreams


def spec_problem(job: JobRow) -> str | None:
    """Why the job's stored spec cannot be run (it no longer validates), or None when it can."""
    try:
        JobSpec.model_validate(job["spec"])
    except ValidationError as exc:
        fields = format_validation_error(exc)
        summary = "; ".join(f"{f['field'] or 'spec'}: {f['message']}" for f in fields[:5])
        more = f" (and {len(fields) - 5} more)" if len(fields) > 5 else ""
        return f"the stored job spec does not validate: {summary}{more}"[:2000]
    return None


def fail_job(ledger: Ledger, job: JobRow, reason: str) -> None:
    """Mark the job failed with `reason`, and say so in the log."""
    log.error("job %s (%s) cannot run, marked failed: %s", job["id"], escape_control(str(job["name"])),
              escape_control(reason))
    ledger.set_job_state(job["id"], "failed", error=reason)


def pick_job(ledger: Ledger) -> JobRow | None:
    """The newest submitted or running job whose spec validates. Newer jobs whose spec does not
    are marked failed on the way (each with a log line), so no service picks them again."""
    for job in ledger.list_jobs(limit=PICK_SCAN, states=PICKABLE_STATES):
        reason = spec_problem(job)
        if reason is None:
            return job
        fail_job(ledger, job, reason)
    return None


def wait_for_job(ledger: Ledger, job_id: str | None, timeout_s: float) -> JobRow:
    """The named job, or the newest submitted/running one that can run (`pick_job`); waits up to
    `timeout_s` for it to appear."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = ledger.get_job(job_id) if job_id else pick_job(ledger)
        if job is not None:
            return job
        if time.monotonic() > deadline:
            what = f"job {job_id!r}" if job_id else "submitted or running job"
            raise TimeoutError(f"no {what} in the ledger after {timeout_s:.0f} s")
        time.sleep(0.2)  # a launcher starts the services before it submits their job


def open_job(settings: CommonSettings) -> JobContext:
    """Find the job (JOB_ID, else `pick_job`) and open its streams.

    Raises:
        JobOver: the job's stored spec no longer validates; the job is marked failed with the
            reason first, and the service exits 0 (restarting would not help).
        TimeoutError: no such job appeared within `job_wait_s`.
    """
    url, _ = resolve_redis_url(settings.redis_url)
    ledger = Ledger(settings.database_url)
    job = wait_for_job(ledger, settings.job_id, settings.job_wait_s)
    reason = spec_problem(job)
    if reason is not None:
        fail_job(ledger, job, reason)
        raise JobOver(f"job {job['id']} failed: {reason}")
    spec = JobSpec.model_validate(job["spec"])
    set_context(job_id=job["id"])
    streams = JobStreams(
        connect(url),
        job["id"],
        prefix=settings.stream_prefix,
        max_message_bytes=settings.max_message_bytes,
        claim_idle_ms=settings.claim_idle_ms,
        max_deliveries=settings.max_deliveries,
    )
    streams.adopt_legacy_keys()  # a job started before keys had hash tags
    log.info("serving job %s (%s), redis %s, ledger %s", job["id"], escape_control(spec.name), redact_url(url),
             redact_url(settings.database_url))
    return JobContext(job["id"], spec, ledger, streams)


class ControlWatcher:
    """Follows `{job}:control` (broadcast) and folds it into a state — running, paused, stopping
    (finish the current step, then exit), cancelled (exit now) or terminating (this process got
    SIGTERM: finish the current work and exit, the job goes on; shared.entry) — plus the live
    knobs set so far. Creating one makes SIGTERM drain instead of interrupting.

    `exit_on` names the commands that stop this service. A user's `stop` is for the trainer (it
    finishes its step and the final evaluation, which needs generators and rewarders still up);
    the trainer then ends the job with `drain`, which every service obeys. `cancel` stops all now.
    Reads from the start of the stream, so a service that joins late sees what came before it.
    """

    def __init__(self, streams: JobStreams, exit_on: tuple[str, ...] = ("stop", "drain")):
        self._streams = streams
        self._exit_on = exit_on
        self._last_id = "0"
        self.state = "running"
        self.settings: dict[str, float] = {}
        self.changed = False  # set when `settings` changed since the caller last cleared it
        accept_drain()

    def poll(self, block_ms: int | None = None) -> str:
        if drain_requested() and self.state not in ("stopping", "cancelled"):
            self.state = "terminating"
        if self.state == "terminating":
            return self.state  # a restart of this process: the job's commands are for the successor
        self._last_id, msgs = self._streams.read_broadcast(CONTROL, self._last_id, Control, block_ms=block_ms)
        for m in msgs:
            if self.state in ("stopping", "cancelled"):
                break  # terminal for this service
            if m.command == "pause":
                self.state = "paused"
            elif m.command == "resume":
                self.state = "running"
            elif m.command in self._exit_on:
                self.state = "stopping"
            elif m.command == "cancel":
                self.state = "cancelled"
            elif m.command == "set":
                self.settings.update(m.settings)
                self.changed = True
        return self.state

    @property
    def done(self) -> bool:
        return self.state in ("stopping", "cancelled", "terminating")


def sample_row(r: Rollout) -> SampleIn:
    """The ledger row of one generated sample (status `generated`), from its rollout alone: the
    generator writes it after publishing, the reward service again before scoring (msg_id keyed,
    so whichever comes first inserts and the other is a no-op)."""
    row: SampleIn = {
        "msg_id": r.msg_id,
        "job_id": r.job_id,
        "group_id": r.group_id,
        "sample_index": r.sample_index,
        "kind": r.purpose,
        "prompt_index": r.prompt_index,
        "generator_id": r.generator_id,
        "gen_version_min": r.policy_version,
        "gen_version_max": r.policy_version_max,
        "num_prompt_tokens": r.num_prompt_tokens,
        "num_completion_tokens": r.num_completion_tokens,
        "completion": r.completion,
        "finish_reason": r.finish_reason,
        "eval_set": r.eval_set or None,
        "status": "generated",
    }
    if r.model_mask or r.stop_reason:  # a multi-turn episode
        row["turns"] = r.turns
        row["num_env_tokens"] = r.num_completion_tokens - r.num_model_tokens
        row["stop_reason"] = r.stop_reason
    return row
