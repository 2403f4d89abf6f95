"""The Redis client the streams talk through: a single server or a Redis Cluster, each command
riding out an outage (or a failover) under the same time budget."""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from broker.redis_retry import OutageRetry
from shared.settings import CommonSettings

# A Redis Cluster is named by its URL's scheme: `redis+cluster://host:port` (`rediss+cluster://`
# for TLS), any one node as the seed; the rest of the URL is as for a single server.
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def is_cluster_url(url: str) -> bool:
    return url.lower().startswith(CLUSTER_SCHEMES)


def plain_url(url: str) -> str:
    """`url` with the `+cluster` of its scheme removed: what redis-py parses."""
    if not is_cluster_url(url):
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme[: -len('+cluster')]}://{rest}"


# A cluster client's own retries (each refreshes the slot map) before OutageCluster backs off.
_CLUSTER_TRIES = 3


class OutageCluster(RedisCluster):
    """redis-py's cluster client riding out outages like `connect`'s single-server client.

    redis-py retries a cluster command a fixed number of times, refreshing its slot map in
    between but without waiting, so a primary that died takes the command down with it before
    its replica is promoted (cluster-node-timeout plus an election, seconds). Here each command is
    wrapped in the same time-bounded OutageRetry: it waits out the failover and goes to the new
    primary. Pipelines are not wrapped (JobStreams issues none to a cluster, see
    `JobStreams.cluster`).
    """

    def __init__(self, *, outage: OutageRetry, **kwargs: Any):
        # First: the constructor already runs commands (COMMAND, CLUSTER SLOTS).
        self.outage = outage
        self.outage.update_supported_errors(
            [ClusterDownError, SlotNotCoveredError, TryAgainError, RedisClusterException]
        )
        super().__init__(retry=Retry(NoBackoff(), _CLUSTER_TRIES), **kwargs)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        call = super().execute_command
        return self.outage.call_with_retry(lambda: call(*args, **kwargs), lambda _error: None, _transient)


def _transient(error: Exception) -> bool:
    """Whether a cluster command's error may pass with time: a connection or cluster-state error,
    or redis-py's topology refresh finding no node to ask (it raises RedisClusterException then,
    which otherwise means a misuse, such as keys of two slots in one command)."""
    if isinstance(error, RedisClusterException) and not isinstance(error, (ClusterDownError, SlotNotCoveredError)):
        return "cannot be connected" in str(error)
    return True


def subscriber(client: Any, channel: str) -> Any:
    """A pub/sub object of `client` to subscribe `channel` with. On a cluster, a plain one on the
    node serving the channel's slot: a PUBLISH reaches every node's subscribers, and redis-py's
    cluster pub/sub (slot-map listeners and reconciliation threads run on every topology refresh)
    is machinery a wake-up does not need, in the one place a failover exercises it. Made anew
    after an error, it asks the slot map again, so a promoted replica is found."""
    if isinstance(client, RedisCluster):
        client = client.get_redis_connection(client.get_node_from_key(channel))
    return client.pubsub(ignore_subscribe_messages=True)


# No command of ours blocks on the server (scripts cannot; readers wait on pub/sub with their own
# timeout), so a reply this late means a server that stopped answering (a frozen host, a
# half-open connection): the command fails with a timeout and is retried like a lost connection
# instead of hanging its service for good.
SOCKET_TIMEOUT_S = 60.0


def connect(url: str, *, outage_s: float | None = None, socket_timeout_s: float = SOCKET_TIMEOUT_S) -> Any:
    """A client whose commands ride out a Redis outage: connection and timeout errors are retried
    with back-off for up to `outage_s` seconds (default: the REDIS_OUTAGE_S setting, 600;
    broker.redis_retry). A reply is waited for at most `socket_timeout_s`, a connection at most
    10 s of it.
    A request path that must answer fast passes a small `outage_s` and a `socket_timeout_s`.

    `url` is any redis-py URL: `redis://[[user]:password@]host:port/db` for AUTH (a user name
    means an ACL user, none the `default` user / requirepass), `rediss://...` for TLS with the
    certificate options as query parameters, e.g.
    `rediss://host:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_certfile=c.pem&ssl_keyfile=k.pem`
    (`ssl_cert_reqs=none` turns verification off; `ssl_check_hostname=false` skips the name
    check only). Wrong credentials raise redis.exceptions.AuthenticationError on the first
    command, without retries.

    `redis+cluster://host:port` (or `rediss+cluster://`) selects a Redis Cluster: redis-py's
    RedisCluster (`OutageCluster`), seeded by that node, db 0 only. Every key of a job shares one
    hash slot (`JobStreams.key`), so the job's scripts and transactions run on one shard; jobs
    spread over the shards by their ids.
    """
    timeouts = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": min(socket_timeout_s, 10.0)}
    outage = OutageRetry(CommonSettings().redis_outage_s if outage_s is None else outage_s)
    if is_cluster_url(url):
        return OutageCluster(
            url=plain_url(url), outage=outage, health_check_interval=30, socket_keepalive=True, **timeouts
        )
    return redis.Redis.from_url(
        url,
        retry=outage,
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=30,
        socket_keepalive=True,
        **timeouts,
    )


def batch(
    client: Any, calls: list[tuple[str, tuple, dict]], *, cluster: bool, raise_on_error: bool = False
) -> list[Any]:
    """Run (client method name, args, kwargs) calls in one pipelined round trip on a single
    server; one by one on a `cluster`, where each command rides out a failover (OutageCluster)
    and a pipeline would not. Errors come back in place unless `raise_on_error`."""
    if not cluster:
        pipe = client.pipeline(transaction=False)
        for name, args, kwargs in calls:
            getattr(pipe, name)(*args, **kwargs)
        return pipe.execute(raise_on_error=raise_on_error)
    out: list[Any] = []
    for name, args, kwargs in calls:
        try:
            out.append(getattr(client, name)(*args, **kwargs))
        except ResponseError as exc:
            if raise_on_error:
                raise
            out.append(exc)
    return out
