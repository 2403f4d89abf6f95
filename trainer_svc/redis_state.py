"""Redis coming back empty mid-job (restarted without persistence, or its keys flushed).

Everything of the job in Redis is gone at once: the prompts, rollouts and scored samples in
flight, the consumer groups, and the trainer's policy announcement. The services ride out the
outage and go on, but the announcement is not published again until the next step, and the next
step needs generation at that very version: a generator that restarted, or that had not yet read
the lost announcement, waits for it (up to GEN_JOB_WAIT_S, then exits, restarts and waits again)
and the job stands still, failing nothing.

`RedisWatch` notices: the trainer writes a token to the job's epoch key when it starts (a new one
after each recovery) and looks at it at most every EPOCH_CHECK_S while it waits for samples. A key
that is gone means Redis lost the job's state; the trainer then, within seconds:

1. writes a new token, and re-creates the consumer groups of the three work streams;
2. publishes its last policy announcement again (the weight server still serves that version):
   every generator, restarted or not, can load the policy the fed groups need;
3. settles what was in flight as lost (TrainSink.settle_lost with `after_flush`: a group partly
   delivered to this trainer is lost too, its other members went with the rest), which frees the
   feeder's slots; the caller feeds them again, and the job goes on.

Redis can also lose only the newest writes: a failover to a replica that had not yet received
them (ARCHITECTURE.md, "Redis Cluster"). The epoch key, written long before, survives; the newest
policy announcement may not, and the same standstill follows (the groups fed at that version wait
for a generator holding it; the trainer's next announcement waits for those groups). So at the
same cadence the watch also reads the policy stream's newest announcement and, where it is not this
trainer's newest, publishes that again (`keep_announced`). The groups the failover lost are
settled by the sink (TrainSink.settle_lost).

What cannot be recovered fails the job with its reason: a resume that needs pending entries Redis
no longer holds (trainer_svc/sink.py check_replay), a re-announcement that cannot be published.
A token of another trainer's (a successor took the job over from this stale process) is only
logged: not this process's to recover.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from broker.streams import (
    GROUP_GENERATORS,
    GROUP_REWARDERS,
    GROUP_TRAINERS,
    POLICY,
    PROMPTS,
    ROLLOUTS,
    SCORED,
    JobStreams,
)
from shared.schema import PolicyAnnouncement
from trainer_svc.sink import TrainSink

log = logging.getLogger(__name__)

# How often the trainer looks at the epoch key while it waits for samples: a generator waiting for
# the lost announcement gets it this long (and a Redis round trip) after Redis is back.
EPOCH_CHECK_S = 2.0


class RedisWatch:
    """The trainer's view of whether Redis still holds the job's state (see the module docstring).

    Args:
        streams: the job's streams.
        run_id: this trainer process's run id (each token is `<run_id>.<n>`).
        clock: monotonic seconds (a test passes its own).
    """

    def __init__(self, streams: JobStreams, run_id: str, clock: Callable[[], float] = time.monotonic):
        self.streams, self.run_id, self.clock = streams, run_id, clock
        self.token: str | None = None
        self.stamps = 0
        self.checked_at = -math.inf
        self.announcement: PolicyAnnouncement | None = None  # the newest this trainer published
        self.recoveries = 0
        self.reannounced = 0  # announcements published again after a partial loss (keep_announced)
        self._foreign: str | None = None  # another trainer's token, logged once

    def stamp(self) -> None:
        """Write a new token of this process to the job's epoch key."""
        self.stamps += 1
        self.token = f"{self.run_id}.{self.stamps}"
        self.streams.stamp_epoch(self.token)
        self.checked_at = self.clock()

    def announced(self, ann: PolicyAnnouncement) -> None:
        """Keep the announcement just published (trainer_svc/weights.py `on_announce`): the one to
        publish again after a loss."""
        self.announcement = ann

    def lost(self) -> bool:
        """Whether Redis lost the job's state since the last stamp: its epoch key is gone. Reads
        the key at most every EPOCH_CHECK_S (False in between, and before the first stamp); while
        the key is this trainer's, also makes sure its newest announcement is there
        (`keep_announced`)."""
        now = self.clock()
        if self.token is None or now - self.checked_at < EPOCH_CHECK_S:
            return False
        self.checked_at = now
        seen = self.streams.epoch()
        if seen is not None and seen != self.token and seen != self._foreign:
            self._foreign = seen
            log.error(
                "the job's epoch key holds %r, not this trainer's %r: another trainer process serves this job",
                seen,
                self.token,
            )
        if seen == self.token:
            self.keep_announced()
        return seen is None

    def keep_announced(self) -> bool:
        """Publish this trainer's newest announcement again where the policy stream's newest is not
        it (nor a newer one of this run): Redis lost it, the job's other state kept (see the module
        docstring). Returns whether it was published."""
        ann = self.announcement
        if ann is None:
            return False
        latest = self.streams.latest(POLICY, PolicyAnnouncement)
        if latest is not None:
            there = latest[1]
            if there.trainer_run == ann.trainer_run and there.manifest.version >= ann.manifest.version:
                return False
        self.reannounced += 1
        log.warning(
            "the policy stream's newest announcement is %s, not this trainer's version %d (Redis lost it: a "
            "failover to a replica that had not received it?); publishing it again",
            "gone" if latest is None else f"version {latest[1].manifest.version}",
            ann.manifest.version,
        )
        self.streams.publish(POLICY, ann)
        return True

    def recover(self, sink: TrainSink, version: int) -> int:
        """Redis lost the job's state: stamp anew, re-create the consumer groups, publish the last
        announcement again, and settle what was in flight as lost. Returns how many training
        groups and evaluation problems were settled (their feeder slots are free: feed them)."""
        self.recoveries += 1
        log.error(
            "Redis lost job %s's state (its epoch key is gone: restarted without persistence, or flushed); "
            "re-announcing policy version %s and settling what was in flight as lost",
            self.streams.job_id,
            None if self.announcement is None else self.announcement.manifest.version,
        )
        self.stamp()
        for stream, group in ((PROMPTS, GROUP_GENERATORS), (ROLLOUTS, GROUP_REWARDERS), (SCORED, GROUP_TRAINERS)):
            self.streams.ensure_group(stream, group)
        if self.announcement is not None:
            self.streams.publish(POLICY, self.announcement)
        return sink.settle_lost(version, every=True, min_interval_s=0, after_flush=True)
