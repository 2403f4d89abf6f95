"""Start-up shared by every service: find Redis, open the ledger, wait for the job, open its streams."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.streams import CONTROL, JobStreams, connect
from shared.jobspec import JobSpec
from shared.logs import set_context
from shared.schema import Control
from shared.settings import CommonSettings

log = logging.getLogger(__name__)


@dataclass
class JobContext:
    job_id: str
    spec: JobSpec
    ledger: Ledger
    streams: JobStreams


def wait_for_job(ledger: Ledger, job_id: str | None, timeout_s: float) -> dict:
    """The named job, or the newest submitted/running one; waits up to `timeout_s` for it to appear."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = ledger.get_job(job_id) if job_id else ledger.latest_job()
        if job is not None:
            return job
        if time.monotonic() > deadline:
            what = f"job {job_id!r}" if job_id else "submitted or running job"
            raise TimeoutError(f"no {what} in the ledger after {timeout_s:.0f} s")
        time.sleep(0.5)


def open_job(settings: CommonSettings) -> JobContext:
    url, _ = resolve_redis_url(settings.redis_url)
    ledger = Ledger(settings.database_url)
    job = wait_for_job(ledger, settings.job_id, settings.job_wait_s)
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
    log.info("serving job %s (%s), redis %s, ledger %s", job["id"], spec.name, url, settings.database_url)
    return JobContext(job["id"], spec, ledger, streams)


class ControlWatcher:
    """Follows `{job}:control` (broadcast) and folds it into a state — running, paused, stopping
    (finish the current step, then exit) or cancelled (exit now) — plus the live knobs set so far.

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

    def poll(self, block_ms: int | None = None) -> str:
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
        return self.state in ("stopping", "cancelled")
