"""What every service shares about its job: the job as a value (JobContext), why a stored spec cannot run,
the control stream's state, a sample's ledger row. The fleet's loop over jobs is broker/fleet.py."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pydantic import ValidationError

from broker.ledger import Ledger
from broker.ledger.rows import JobRow, SampleIn
from broker.streams import CONTROL, JobStreams
from shared.entry import accept_drain, drain_requested
from shared.jobspec import JobSpec, format_validation_error
from shared.logs import escape_control
from shared.schema import Control, Rollout

log = logging.getLogger(__name__)


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
    log.error(
        "job %s (%s) cannot run, marked failed: %s", job["id"], escape_control(str(job["name"])), escape_control(reason)
    )
    ledger.set_job_state(job["id"], "failed", error=reason)


def wait_for_job(ledger: Ledger, job_id: str, timeout_s: float) -> JobRow:
    """The named job; waits up to `timeout_s` for it to appear (a launcher starts the services,
    each told its JOB_ID, before it submits their job)."""
    deadline = time.monotonic() + timeout_s
    while (job := ledger.get_job(job_id)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no job {job_id!r} in the ledger after {timeout_s:.0f} s")
        time.sleep(0.2)
    return job


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
        self._changes: dict[str, float] = {}  # knobs set since the last take_changes
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
                self._changes.update(m.settings)
        return self.state

    def take_changes(self) -> dict[str, float]:
        """The live knobs set since the last call (a later set of a knob wins), handed over once:
        the caller applies what it takes, and nobody else's flag needs resetting."""
        changes, self._changes = self._changes, {}
        return changes

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
        "adapter": r.adapter or None,
        "gen_seconds": r.gen_seconds,
        "status": "generated",
    }
    if r.model_mask or r.stop_reason:  # a multi-turn episode
        row["turns"] = r.turns
        row["num_env_tokens"] = r.num_completion_tokens - r.num_model_tokens
        row["stop_reason"] = r.stop_reason
    return row
