"""Relay fan-out of weights (ARCHITECTURE.md, "Weights: relay fan-out"): a generator fetches each
version from its parent in a tree of generators rather than from the trainer, verifies it against
the trainer's manifest, then serves it to its own children.

`WeightRelay` does one generator's part: it keeps a registry entry in Redis (the hash
`{job}:relays`: generator id -> its address, the versions it serves, the one it is fetching, a
heartbeat time), picks a source per version by the rules of shared/transport/relay.py (parent
first; a dead, idle or failing relay is routed around, up to the trainer), fetches with the
transport's verifying client and serves the version from its own weight server as it verifies:
each chunk once it matched the trainer's manifest (`Streaming`), all of it once complete.
`RelayFollower` runs it in a background thread on every announcement, so a generator relays a new
version as soon as it is published, whatever its engine is doing; the engine then loads it from
this local server at its next swap.

`python -m generator_svc.relay --job JOB --id ID` runs a relay alone, with no engine: a relay node,
and the receiver the fan-out bench (bench/fanout.py) measures.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from broker.streams import POLICY, JobStreams, connect
from shared.schema import PolicyAnnouncement
from shared.transport import WeightServer, make_client, make_server
from shared.transport.base import Streaming, VersionStore
from shared.transport.relay import COMING, SERVING, TRAINER, pick_source, tree_ancestors

log = logging.getLogger(__name__)

RELAYS = "relays"  # the registry hash's name under the job's keys (JobStreams.key)


@dataclass
class RelayConfig:
    """How a relay behaves (GeneratorSettings relay_* in a generator; flags of the relay node)."""

    fanout: int = 2  # children per relay; 0: the star (everyone fetches from the trainer)
    host: str = "127.0.0.1"  # the relay's weight server binds here
    advertise_host: str | None = None  # and is reached there (default: host)
    keep: int = 2  # versions a relay keeps servable (each a full copy of the weights in host memory)
    idle_wait_s: float = 2.0  # how long to wait for an ancestor that has not started on a version
    coming_wait_s: float = 120.0  # ... and for one that is fetching it (then: nearest serving, else trainer)
    ttl_s: float = 5.0  # a registry entry older than this is a dead relay
    beat_s: float = 1.0  # how often a relay refreshes its entry
    poll_s: float = 0.02  # how often a waiting relay looks at the registry again
    uplink_bytes_per_s: float | None = None  # emulated uplink of its server (benchmarks only)
    stream: bool = True  # pass each chunk on once it verified (False: only whole versions, store and forward)


@dataclass
class Fetched:
    """One version a relay holds: the verified buffer, where it came from, how long it took."""

    version: int
    buf: np.ndarray
    source: str  # a generator id, or "trainer"
    seconds: float
    failed: dict[str, str] = field(default_factory=dict)  # sources that failed first: id -> why


class WeightRelay:
    """One generator's part in the fan-out: registry entry, source choice, verified fetch, serving."""

    def __init__(self, streams: JobStreams, generator_id: str, config: RelayConfig | None = None):
        self.streams, self.id, self.cfg = streams, generator_id, config or RelayConfig()
        self._key = streams.key(RELAYS)
        self._servers: dict[str, WeightServer] = {}
        self._lock = threading.Lock()
        self._run = ""
        self._transport = ""  # the transport of the versions it serves (the announcements')
        self._versions: list[int] = []
        self._served_at: dict[int, float] = {}
        self._fetching: int | None = None
        self._streaming: int | None = None  # the version it passes on while fetching it (cfg.stream)
        self._stop = threading.Event()
        self._beat_thread = threading.Thread(target=self._beat_loop, name="relay-beat", daemon=True)
        self._beat_thread.start()

    # -- the registry ---------------------------------------------------------------------------
    def _entry(self) -> dict:
        srv = self._servers.get(self._transport)
        with self._lock:
            return {
                "address": srv.address if srv else "",
                "transport": self._transport,
                "run": self._run,
                "versions": list(self._versions),
                "served_at": {str(v): t for v, t in self._served_at.items()},
                "fetching": self._fetching,
                "streaming": self._streaming,
                "ts": time.time(),
            }

    def beat(self) -> None:
        """Write this relay's entry (its state now, and that it lives)."""
        self.streams.r.hset(self._key, self.id, json.dumps(self._entry()))

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.cfg.beat_s):
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - a Redis blip: the next beat retries
                log.warning("relay %s: heartbeat failed: %s", self.id, exc)

    def members(self) -> dict[str, dict]:
        """Live relays' entries by id (heartbeat within `ttl_s`; older ones are dead relays and
        are deleted once ten times that old)."""
        now, live, dead = time.time(), {}, []
        for k, v in self.streams.r.hgetall(self._key).items():
            gid = k.decode() if isinstance(k, bytes) else k
            try:
                entry = json.loads(v)
                age = now - float(entry["ts"])
            except (ValueError, KeyError, TypeError):
                continue
            if age <= self.cfg.ttl_s:
                live[gid] = entry
            elif age > 10 * self.cfg.ttl_s:
                dead.append(gid)
        if dead:
            self.streams.r.hdel(self._key, *dead)
        return live

    @staticmethod
    def _state(entry: dict, ann: PolicyAnnouncement) -> str:
        v = ann.manifest.version
        if entry.get("run") == ann.trainer_run and entry.get("transport") == ann.transport:
            if v in entry.get("versions", []) or entry.get("streaming") == v:
                return SERVING
            if entry.get("fetching") == v:
                return COMING
        return ""

    # -- serving --------------------------------------------------------------------------------
    def server(self, transport: str) -> WeightServer:
        """This relay's weight server of `transport` (the announcement's: the engine's worker and
        the children speak it), started on first use."""
        if transport not in self._servers:
            kw: dict = {"host": self.cfg.host, "keep": self.cfg.keep, "advertise_host": self.cfg.advertise_host}
            if self.cfg.uplink_bytes_per_s is not None:
                kw["uplink_bytes_per_s"] = self.cfg.uplink_bytes_per_s
            self._servers[transport] = make_server(transport, **kw)
        return self._servers[transport]

    def serves(self, ann: PolicyAnnouncement) -> str | None:
        """This relay's address if it serves `ann`'s version (verified), else None."""
        with self._lock:
            held = (ann.trainer_run, ann.transport) == (
                self._run,
                self._transport,
            ) and ann.manifest.version in self._versions
        return self._servers[ann.transport].address if held and ann.transport in self._servers else None

    # -- fetching -------------------------------------------------------------------------------
    def fetch(self, ann: PolicyAnnouncement) -> Fetched:
        """Fetch `ann`'s version along the tree, verified against its manifest, and serve it.

        Source: the nearest ancestor that serves it, waiting for one that is on its way; a source
        that fails (refused, hung up, timed out, bytes that do not verify after the client's
        re-fetches) is routed around, up to the trainer.

        Raises:
            Exception: the trainer itself failed (whatever its client raised); nothing is served.
        """
        m, t0 = ann.manifest, time.monotonic()
        with self._lock:
            if (ann.trainer_run, ann.transport) != (self._run, self._transport):  # a restarted trainer
                # may reuse version numbers
                self._run, self._transport, self._versions, self._served_at = ann.trainer_run, ann.transport, [], {}
                for srv in self._servers.values():
                    srv.store = VersionStore(self.cfg.keep)  # type: ignore[attr-defined]
            self._fetching = m.version
        self.beat()  # "coming": children wait for it rather than go round it
        server = self.server(ann.transport)  # after: starting one can take a second (UCX's worker)
        failed: dict[str, str] = {}
        try:
            while True:
                members = self.members()
                ancestors = tree_ancestors([g for g in members if g != self.id], self.id, self.cfg.fanout)
                ancestors = [a for a in ancestors if a in members]
                waited = time.monotonic() - t0
                source = pick_source(
                    ancestors,
                    {a: self._state(members[a], ann) for a in ancestors},
                    failed,
                    wait_idle=waited < self.cfg.idle_wait_s,
                    wait_coming=waited < self.cfg.coming_wait_s,
                )
                if source is None:
                    time.sleep(self.cfg.poll_s)
                    continue
                address = ann.address if source == TRAINER else members[source]["address"]
                # pieces of one chunk: each chunk is hashed, and so passed on, as soon as it landed
                client = make_client(ann.transport, piece_bytes=m.chunk_bytes)
                partial = None
                if self.cfg.stream:  # children may read each chunk as soon as it verified
                    partial = Streaming(m)
                    server.serve(m, partial)  # type: ignore[arg-type]
                    with self._lock:
                        self._streaming = m.version
                    self.beat()
                try:
                    if partial is None:
                        buf = client.fetch(address, m)
                    else:
                        buf = client.fetch(address, m, out=partial.buf, on_ok=partial.mark)
                    break
                except Exception as exc:
                    if partial is not None:
                        partial.abort()  # its readers are cut off (they route around) and it is served no more
                        with self._lock:
                            self._streaming = None
                        server.store.drop(m.version)  # type: ignore[attr-defined]
                    if source == TRAINER:
                        raise
                    failed[source] = f"{type(exc).__name__}: {exc}"
                    log.warning(
                        "relay %s: v%d from %s failed (%s); routing around it",
                        self.id,
                        m.version,
                        source,
                        failed[source],
                    )
                finally:
                    client.close()
        finally:
            with self._lock:
                self._fetching = self._streaming = None
        server.serve(m, buf)
        with self._lock:
            self._versions = ([v for v in self._versions if v != m.version] + [m.version])[-self.cfg.keep :]
            self._served_at = {v: t for v, t in self._served_at.items() if v in self._versions}
            self._served_at[m.version] = time.time()
        self.beat()
        got = Fetched(m.version, buf, source or "trainer", time.monotonic() - t0, failed)
        log.info(
            "relay %s: serving v%d (%.1f MB) from %s after %.2fs%s",
            self.id,
            m.version,
            m.total_bytes / 1e6,
            got.source,
            got.seconds,
            f"; routed around {sorted(failed)}" if failed else "",
        )
        return got

    def close(self) -> None:
        """Leave the registry and stop serving."""
        self._stop.set()
        self._beat_thread.join(timeout=5)
        try:
            self.streams.r.hdel(self._key, self.id)
        finally:
            for srv in self._servers.values():
                srv.close()


class RelayFollower:
    """Relays every newest announcement in a background thread (its own read of `{job}:policy`),
    so a generator passes a version on while its engine is busy generating."""

    def __init__(self, relay: WeightRelay, streams: JobStreams):
        self.relay = relay
        # its own JobStreams over the same (thread-safe) client: reads keep per-instance state
        self.streams = JobStreams(
            streams.r, streams.job_id, prefix=streams.prefix, max_message_bytes=streams.max_message_bytes
        )
        self._cond = threading.Condition()
        self._failed: dict[tuple[str, int], str] = {}
        self._stop = threading.Event()
        self._handling: PolicyAnnouncement | None = None  # the newest announcement it has taken up
        relay.beat()  # a member of the tree from now on
        self._thread = threading.Thread(target=self._run, name="relay-follow", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        latest = self.streams.latest(POLICY, PolicyAnnouncement)
        last_id, newest = ("0", None) if latest is None else latest
        while not self._stop.is_set():
            if (
                newest is not None
                and self.relay.serves(newest) is None
                and (newest.trainer_run, newest.manifest.version) not in self._failed
            ):
                with self._cond:
                    self._handling = newest
                try:
                    self.relay.fetch(newest)
                except Exception as exc:  # noqa: BLE001 - the engine falls back to the trainer itself
                    log.warning("relay %s: v%d failed: %s", self.relay.id, newest.manifest.version, exc)
                    self._failed[(newest.trainer_run, newest.manifest.version)] = str(exc)
                with self._cond:
                    self._cond.notify_all()
            try:
                last_id, msgs = self.streams.read_broadcast(POLICY, last_id, PolicyAnnouncement, block_ms=500)
            except Exception as exc:  # noqa: BLE001 - a Redis blip: read again
                log.warning("relay %s: policy read failed: %s", self.relay.id, exc)
                time.sleep(0.5)
                continue
            for m in msgs:  # the newest by arrival: a restarted trainer's versions win (as PolicyFollower)
                if (
                    newest is None
                    or m.manifest.version > newest.manifest.version
                    or m.trainer_run != newest.trainer_run
                ):
                    newest = m

    def address_for(self, ann: PolicyAnnouncement, timeout_s: float) -> str | None:
        """The local relay's address once it serves `ann`'s version (waiting up to `timeout_s`),
        or None: it failed, or is not there in time (the caller then fetches from the trainer)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                address = self.relay.serves(ann)
                left = deadline - time.monotonic()
                if address is not None or left <= 0 or (ann.trainer_run, ann.manifest.version) in self._failed:
                    return address
                h = self._handling
                if h is not None and (h.trainer_run != ann.trainer_run or h.manifest.version > ann.manifest.version):
                    return None  # it moved on to a newer version: it will not fetch this one
                self._cond.wait(min(left, 0.5))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.relay.close()


def main(argv: list[str] | None = None) -> None:
    """A relay with no engine: follows `{job}:policy`, relays every version, until SIGTERM."""
    p = argparse.ArgumentParser(prog="python -m generator_svc.relay", description=main.__doc__)
    p.add_argument("--job", required=True)
    p.add_argument("--id", required=True, help="this relay's id (the tree orders relays by it)")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    p.add_argument("--prefix", default="rl:")
    p.add_argument("--fanout", type=int, default=RelayConfig.fanout)
    p.add_argument("--host", default=RelayConfig.host)
    p.add_argument("--keep", type=int, default=RelayConfig.keep)
    p.add_argument("--ttl", type=float, default=RelayConfig.ttl_s, help="seconds without a heartbeat: a dead relay")
    p.add_argument(
        "--idle-wait",
        type=float,
        default=RelayConfig.idle_wait_s,
        help="seconds to wait for an ancestor that has not started on a version",
    )
    p.add_argument(
        "--store-and-forward",
        action="store_true",
        help="pass a version on only once all of it verified (default: each chunk once it verified)",
    )
    p.add_argument(
        "--uplink-mbps",
        type=float,
        default=0.0,
        help="emulated uplink of this relay's server in MB/s (0: none; benchmarks only)",
    )
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s relay %(message)s")
    cfg = RelayConfig(
        fanout=a.fanout,
        host=a.host,
        keep=a.keep,
        ttl_s=a.ttl,
        beat_s=min(1.0, a.ttl / 3),
        idle_wait_s=a.idle_wait,
        stream=not a.store_and_forward,
        uplink_bytes_per_s=a.uplink_mbps * 1e6 if a.uplink_mbps > 0 else None,
    )
    streams = JobStreams(connect(a.redis), a.job, prefix=a.prefix)
    follower = RelayFollower(WeightRelay(streams, a.id, cfg), streams)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    follower.relay.beat()
    done.wait()
    follower.close()


if __name__ == "__main__":
    main()
