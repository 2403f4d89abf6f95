"""The names of one job's keys: its streams, its consumer groups, the heartbeat hash, the epoch
key and the streams' wake-up channels."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

log = logging.getLogger(__name__)

FIELD = b"d"  # each entry carries one field holding the msgpack body

PROMPTS, ROLLOUTS, SCORED = "prompts", "rollouts", "scored"
POLICY, CONTROL, DEAD = "policy", "control", "dead"
GROUP_GENERATORS, GROUP_REWARDERS, GROUP_TRAINERS = "generators", "rewarders", "trainers"
HEARTBEATS = "generators"  # the hash of generator heartbeats (not a stream)
EPOCH = "epoch"  # the trainer's token: gone when Redis lost the job's state (epoch.py)

# Every key of a job, by its name after the job id: what `adopt_legacy_keys` renames.
JOB_KEYS = (PROMPTS, ROLLOUTS, SCORED, POLICY, CONTROL, DEAD, HEARTBEATS, EPOCH)


@dataclass(frozen=True)
class JobKeys:
    """The key names of one job: `{prefix}{{job_id}}:{name}`."""

    prefix: str
    job_id: str

    def key(self, stream: str) -> str:
        """`{prefix}{{job_id}}:{stream}`: the job id in braces is the key's hash tag, so a Redis
        Cluster puts every key of the job in one slot (the slot of the job id) and the scripts
        and transactions that touch several of them run there; different jobs land in different
        slots, hence on different shards."""
        return f"{self.prefix}{{{self.job_id}}}:{stream}"

    def legacy_key(self, stream: str) -> str:
        """The key's name before hash tags (`{prefix}{job_id}:{stream}`): see
        `adopt_legacy_keys`."""
        return f"{self.prefix}{self.job_id}:{stream}"

    def wake_channel(self, stream: str) -> str:
        """The pub/sub channel a producer of `stream` publishes on after adding entries: a reader
        waiting for an entry wakes at once instead of at its next poll."""
        return f"{self.key(stream)}:wake"


def adopt_legacy_keys(client: Any, keys: JobKeys, *, cluster: bool) -> list[str]:
    """Rename the keys of a job started before keys had hash tags to their current names;
    returns the key names renamed. Every service calls it when it opens its job
    (broker.runtime.open_job), so a job that was running goes on where it was after an
    upgrade (stop its services, upgrade, start them again).

    RENAMENX per key: a key already present under its new name is left alone, as is its old
    twin (logged: a service of the old version is still writing to the job). Idempotent and
    safe when several services start at once. Nothing on a `cluster`: untagged keys of one job
    lie in different slots, and a cluster deployment starts with tagged keys.
    """
    if cluster:
        return []
    renamed = []
    for name in JOB_KEYS:
        old, new = keys.legacy_key(name), keys.key(name)
        try:
            if client.renamenx(old, new):
                renamed.append(old)
            else:
                log.warning(
                    "both %s and %s exist: left as they are (a service of an older version still serves job %s?)",
                    old,
                    new,
                    keys.job_id,
                )
        except ResponseError as exc:
            if "no such key" not in str(exc).lower():
                raise
    if renamed:
        log.warning("job %s: renamed its keys from before hash tags: %s", keys.job_id, ", ".join(renamed))
    return renamed
