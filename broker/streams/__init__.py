"""Redis Streams plumbing: the only package in the project that issues stream commands.

Semantics: consumers read with XREADGROUP, handle, write the ledger, publish downstream, then
XACK. Entries left pending by a dead consumer are reclaimed with XAUTOCLAIM after
`claim_idle_ms` (a live consumer whose work outlasts that keeps its entries with `touch`); an
entry delivered more than `max_deliveries` times, or one that fails decoding or validation, goes
to `{job}:dead` with the reason and is acked so the consumer keeps going.

Bounded memory: every read is sized on the server before anything is transferred (the READ
script): a consumer holds at most `max_read_bytes + max_message_bytes` of entry payload per read,
and an entry over `max_message_bytes` is dead-lettered from its size alone (see `JobStreams`).

Works against Redis 7.0 and the embedded 6.2 server (no newer commands).

Services talk to one job's streams through `JobStreams` (job.py), a facade over the parts:

    keys.py          the key names of a job (stream, group and heartbeat names; hash tags)
    connection.py    `connect`: a single server or a Redis Cluster, riding out outages
    scripts.py       the Lua scripts (atomic hand-offs, sized reads) and their fallback switch
    entries.py       `Consumer`, `Delivery` (generic in the message kind: a `Consumer[Rollout]`
                     gets `Delivery[Rollout]`s), and an entry as a read returns it
    reads.py         bounded reads, scripted or plain
    dead_letters.py  decoding, and the dead stream
    wakeups.py       waiting for an entry: the producers' wake-up channels, or polling
    publishing.py    producing, and publish-if-owned
    groups.py        consumer groups: consume, reclaim, touch, ack, trim
    broadcast.py     broadcast streams (policy, control) and generator heartbeats
    epoch.py         the epoch key: whether Redis lost the job's state
"""

from .connection import (
    CLUSTER_SCHEMES,
    OutageCluster,
    connect,
    is_cluster_url,
    plain_url,
    subscriber,
)
from .entries import Consumer, Delivery, Expected
from .job import JobStreams
from .keys import (
    CONTROL,
    DEAD,
    FIELD,
    GROUP_GENERATORS,
    GROUP_REWARDERS,
    GROUP_TRAINERS,
    JOB_KEYS,
    POLICY,
    PROMPTS,
    ROLLOUTS,
    SCORED,
)

__all__ = [
    "CLUSTER_SCHEMES",
    "CONTROL",
    "DEAD",
    "FIELD",
    "GROUP_GENERATORS",
    "GROUP_REWARDERS",
    "GROUP_TRAINERS",
    "JOB_KEYS",
    "POLICY",
    "PROMPTS",
    "ROLLOUTS",
    "SCORED",
    "Consumer",
    "Delivery",
    "Expected",
    "JobStreams",
    "OutageCluster",
    "connect",
    "is_cluster_url",
    "plain_url",
    "subscriber",
]
