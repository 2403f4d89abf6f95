"""Hostile stream entries against the real reward service: one bad entry must never cost good work.

The reward service runs as a subprocess (`python -m reward_svc`) on the local Redis and a fresh
ledger (SQLite and PostgreSQL). A burst of good rollouts is mixed with one entry of every poison
kind: values the ledger cannot store (policy_version 2**63, prompt_index 2**31, a NUL in the
completion), values that are garbage downstream (non-finite or positive logprobs, an infinite
temperature, negative token ids, policy_version > policy_version_max), lax types (a bool or a str
for an int), a second entry with a good rollout's msg_id, an oversized entry, msgpack bombs, and
schema-valid rollouts the database itself refuses (a trigger stands in for any constraint the
schema does not know about; it makes the batch write fail, which is what the ledger split is for).
The service is SIGKILLed twice mid-burst (entries pending) and restarted as a supervisor would.

Asserted: every good rollout scored exactly once (ledger and scored stream), none dead-lettered,
every poison dead-lettered with a reason and never published, no exit but the planned kills, and
the consumer's peak RSS under its bound while it reads ten 50 MB entries and the bombs.

The same measurement runs against another checkout (the code before a change) with
HOSTILE_SERVICE_ROOT=/path/to/checkout: `run_burst` and `run_memory` return the figures.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from sqlalchemy import text

from broker.ledger import Ledger
from broker.streams import CONTROL, FIELD, GROUP_REWARDERS, ROLLOUTS, SCORED, JobStreams, connect
from shared.jobspec import JobSpec
from shared.schema import Control, Rollout, encode, pack_f32, pack_i32

pytestmark = [pytest.mark.hostile]

ROOT = Path(__file__).resolve().parents[1]
SERVICE_ROOT = Path(os.environ.get("HOSTILE_SERVICE_ROOT", ROOT))
REDIS_URL = os.environ.get("HOSTILE_REDIS_URL", "redis://127.0.0.1:6379/0")
MIB = 1024 * 1024
MAX_MESSAGE_BYTES = 8 * MIB  # the default
MAX_READ_BYTES = 2 * MAX_MESSAGE_BYTES  # broker.streams' default
# The consumer's peak RSS may exceed its idle RSS by: one read's payload as redis-py returns it and
# as msgpack copies it out (3 x (max_read_bytes + max_message_bytes)), one decode's object graph
# (shared.schema: DEFAULT_MAX_ELEMENTS x ~60 B = 16 MiB), and the batch's ledger/score/publish copies
# (2 x max_read_bytes). With the defaults: 72 + 16 + 32 = 120 MiB.
RSS_HEADROOM_MIB = (3 * (MAX_READ_BYTES + MAX_MESSAGE_BYTES) + 16 * MIB + 2 * MAX_READ_BYTES) / MIB


# -- the burst -------------------------------------------------------------------------------------


def good_rollout(job: str, i: int) -> Rollout:
    return Rollout(
        job_id=job,
        msg_id=f"{job}/good/{i}",
        group_id=f"{job}/good/{i}",
        policy_version=1,
        policy_version_max=1,
        prompt_index=i,
        sample_index=0,
        group_size=1,
        generator_id="gen-0",
        prompt_ids=pack_i32([1, 2, 3]),
        completion_ids=pack_i32([4, 5]),
        logprobs=pack_f32([-0.25, -1.5]),
        completion=f"{i}",
        answer=f"{i}" if i % 2 else "no",
        prompt=f"say {i}",
        temperature=1.0,
    )


def body_of(msg: Rollout) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


def packb(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def bomb_nested() -> bytes:
    """A schema-shaped rollout whose metadata is ~8.4 M empty arrays in 2040 arrays of 4096: each
    array within the per-array limit, the payload under 8 MiB, the object graph ~0.6 GiB."""
    inner = b"\xdd" + (4096).to_bytes(4, "big") + b"\x90" * 4096  # array32 of 4096 empty arrays
    outer = b"\xdd" + (2040).to_bytes(4, "big") + inner * 2040
    head = packb({"schema_version": 1, "kind": "rollout", "job_id": "x"})
    # splice a "metadata" key into the map: fixmap of 3 -> 4 entries
    return bytes([head[0] + 1]) + head[1:] + packb("metadata") + outer


def bomb_flat(job: str) -> bytes:
    """~8 MiB of one array of empty arrays: a single header claiming 8 M elements."""
    n = MAX_MESSAGE_BYTES - 64
    head = packb({"schema_version": 1, "kind": "rollout", "job_id": job})
    return bytes([head[0] + 1]) + head[1:] + packb("metadata") + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n


def poisons(job: str, dup_of: Rollout) -> dict[str, bytes]:
    """Every poison kind, as the raw payload of one stream entry (msg_ids of their own except
    the duplicate)."""
    base = body_of(good_rollout(job, 999))

    def mutated(name: str, **changes: Any) -> bytes:
        return packb({**base, "msg_id": f"{job}/poison/{name}", "group_id": f"{job}/poison/{name}", **changes})

    lp = np.array([-0.5, -0.5], "<f4")
    return {
        "policy_version_2**63": mutated("pv", policy_version=2**63, policy_version_max=2**63),
        "prompt_index_2**31": mutated("pi", prompt_index=2**31),
        "nul_in_completion": mutated("nul", completion="4\x002"),
        "nan_logprob": mutated("nan", logprobs=np.array([np.nan, -0.5], "<f4").tobytes()),
        "inf_logprob": mutated("inf", logprobs=np.array([-0.5, np.inf], "<f4").tobytes()),
        "positive_logprob": mutated("pos", logprobs=(lp + 3).tobytes()),
        "inf_temperature": mutated("temp", temperature=float("inf")),
        "negative_token_id": mutated("neg", completion_ids=pack_i32([-7, 5])),
        "version_order": mutated("order", policy_version=3, policy_version_max=1),
        "bool_schema_version": mutated("boolver", schema_version=True),
        "bool_as_int": mutated("boolint", group_size=True),
        "str_as_int": mutated("strint", policy_version="1"),
        "duplicate_msg_id": encode(dup_of.model_copy(update={"completion": "a different completion"})),
        "oversized": mutated("big", completion="x" * (MAX_MESSAGE_BYTES + 1024)),
        "msgpack_bomb_nested": bomb_nested(),
        "msgpack_bomb_flat": bomb_flat(job),
        "ledger_refuses_row": mutated("dbrow", completion="POISON-ROW"),
        "ledger_refuses_score": mutated("dbscore", completion="POISON-SCORE"),
        "garbage": b"\xc1\xc1 not msgpack",
    }


def install_db_poison(ledger: Ledger) -> None:
    """Triggers that refuse rows the schema admits: a completion with POISON-ROW on insert, with
    POISON-SCORE when it is scored. SQLite: RAISE(ABORT) (an IntegrityError); PostgreSQL: a
    data_exception (SQLSTATE 22000, a DataError)."""
    with ledger.engine.begin() as conn:
        if ledger.engine.dialect.name == "sqlite":
            conn.execute(
                text(
                    "CREATE TRIGGER hostile_row BEFORE INSERT ON samples WHEN NEW.completion LIKE '%POISON-ROW%' "
                    "BEGIN SELECT RAISE(ABORT, 'hostile test: this row is refused'); END"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER hostile_score BEFORE UPDATE ON samples "
                    "WHEN NEW.status = 'scored' AND NEW.completion LIKE '%POISON-SCORE%' "
                    "BEGIN SELECT RAISE(ABORT, 'hostile test: this reward is refused'); END"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE FUNCTION hostile_poison() RETURNS trigger AS $$ BEGIN "
                    "IF NEW.completion LIKE '%POISON-ROW%' OR (NEW.status = 'scored' AND NEW.completion LIKE "
                    "'%POISON-SCORE%') THEN RAISE EXCEPTION 'hostile test: this row is refused' "
                    "USING ERRCODE = '22000'; "
                    "END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER hostile_poison BEFORE INSERT OR UPDATE ON samples "
                    "FOR EACH ROW EXECUTE FUNCTION hostile_poison()"
                )
            )


# -- the service as a subprocess -------------------------------------------------------------------


def _proc_status(pid: int, key: str) -> float:
    """A /proc/<pid>/status figure in MiB (VmRSS: now, VmHWM: the process's peak); 0 once gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclass
class Service:
    """The reward service under a supervisor: restarted whenever it exits; exits it was not asked
    for (SIGKILL by `crash`, drain) are counted."""

    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    exits: list[int] = field(default_factory=list)
    starts: int = 0
    peak_rss_mib: float = 0.0

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reward_svc"], cwd=SERVICE_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self.starts += 1

    def watch(self) -> None:
        """Record the peak RSS; restart after an exit (counted)."""
        assert self.proc is not None
        self.peak_rss_mib = max(self.peak_rss_mib, _proc_status(self.proc.pid, "VmHWM"))
        if self.proc.poll() is not None:
            self.exits.append(self.proc.returncode)
            self.start()

    def crash(self) -> None:
        assert self.proc is not None
        self.watch()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.start()

    def rss_mib(self) -> float:
        assert self.proc is not None
        return _proc_status(self.proc.pid, "VmRSS")

    def drain(self, streams: JobStreams, job: str) -> int | None:
        assert self.proc is not None
        self.watch()
        streams.publish(
            CONTROL, Control(job_id=job, msg_id=f"end-{uuid.uuid4().hex[:6]}", policy_version=0, command="drain")
        )
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


@dataclass
class Setup:
    job: str
    ledger: Ledger
    streams: JobStreams
    service: Service


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path, postgres_database) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/ledger.db"
    else:
        with postgres_database() as url:
            yield url


def open_setup(url: str, tmp_path: Path, *, batch: int = 8) -> Setup:
    job = f"hostile-{uuid.uuid4().hex[:8]}"
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    ledger = Ledger(url)
    ledger.create_job(job, "hostile", JobSpec(model_path="/nonexistent").model_dump(mode="json"), state="running")
    streams = JobStreams(connect(REDIS_URL), job, prefix=prefix, max_message_bytes=MAX_MESSAGE_BYTES)
    streams.ensure_group(ROLLOUTS, GROUP_REWARDERS)
    env = {
        **os.environ,
        "PYTHONPATH": str(SERVICE_ROOT),
        "REDIS_URL": REDIS_URL,
        "DATABASE_URL": url,
        "JOB_ID": job,
        "STREAM_PREFIX": prefix,
        "MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
        "REWARD_CONSUMER_ID": "rw-0",
        "REWARD_BATCH": str(batch),
        "REWARD_BLOCK_MS": "100",
        "REWARD_WORKERS": "0",
        "REWARD_JOB_WAIT_S": "30",
        "REWARD_MAX_DELIVERIES": "5",
        "LOG_LEVEL": "INFO",
    }
    return Setup(job, ledger, streams, Service(env, tmp_path / f"reward-{job}.log"))


def _wait(until: Callable[[], bool], service: Service, timeout_s: float, every_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        service.watch()
        if until():
            return True
        time.sleep(every_s)
    return until()


def _msg_id(raw: bytes) -> str | None:
    try:
        body = msgpack.unpackb(raw, raw=False)
        return body.get("msg_id") if isinstance(body, dict) else None
    except Exception:
        return None


def outcome(s: Setup, good: dict[str, str], bad: dict[str, str]) -> dict[str, Any]:
    """Figures of a finished burst. `good`/`bad`: entry id -> msg_id / poison name."""
    good_ids = set(good.values())
    rows = {r["msg_id"]: r for r in s.ledger.samples(s.job)}
    published = Counter(_msg_id(f[FIELD]) for _, f in s.streams.r.xrange(s.streams.key(SCORED)))
    dead = {d.entry_id: d for d in s.streams.dead_letters(count=100_000)}
    poison_msg_ids = {_msg_id(d.raw) for eid, d in dead.items() if eid in bad} - good_ids - {None}
    return {
        "good": len(good),
        "good_scored": sum(rows.get(m, {}).get("status") == "scored" for m in good_ids),
        "good_published_once": sum(published[m] == 1 for m in good_ids),
        "good_published_extra": sum(max(0, published[m] - 1) for m in good_ids),
        "good_dead_lettered": sum(eid in dead for eid in good),
        "poisons": len(bad),
        "poisons_dead_lettered": sum(eid in dead and bool(dead[eid].reason) for eid in bad),
        "poisons_published": sum(
            n for m, n in published.items() if m in poison_msg_ids or (m is not None and "/poison/" in m)
        ),
        "dead_codes": {bad[eid]: dead[eid].code for eid in bad if eid in dead},
        "pending": s.streams.pending_count(ROLLOUTS, GROUP_REWARDERS),
        "exits": list(s.service.exits),
        "starts": s.service.starts,
        "peak_rss_mib": round(s.service.peak_rss_mib, 1),
    }


def all_read(s: Setup) -> bool:
    """Every entry of the rollouts stream delivered and acked (scored or dead-lettered)."""
    key = s.streams.key(ROLLOUTS)
    last = s.streams.r.xinfo_stream(key)["last-generated-id"]
    (group,) = [g for g in s.streams.r.xinfo_groups(key) if g["name"] in (GROUP_REWARDERS, GROUP_REWARDERS.encode())]
    return group["last-delivered-id"] == last and group["pending"] == 0


def run_burst(
    url: str, tmp_path: Path, *, n_good: int = 20, kills: int = 2, only: str | None = None, timeout_s: float = 120
) -> dict:
    """Good rollouts with every poison (or `only` that one, in the middle) between them, in
    kills + 1 waves, the service SIGKILLed with entries pending after each wave but the last.
    Returns `outcome`'s figures."""
    s = open_setup(url, tmp_path)
    install_db_poison(s.ledger)
    try:
        goods = [good_rollout(s.job, i) for i in range(n_good)]
        bad_raw = [(k, v) for k, v in poisons(s.job, dup_of=goods[3]).items() if only in (None, k)]
        entries: list[tuple[str, str, bytes]] = []  # (kind, label, raw)
        rest = iter(bad_raw)
        for i, g in enumerate(goods):
            entries.append(("good", g.msg_id, encode(g)))
            # the duplicate follows the rollout it copies; a single poison sits in the middle
            if i >= (n_good // 2 if only else 4) and (b := next(rest, None)) is not None:
                entries.append(("bad", *b))
        entries += [("bad", *b) for b in rest]
        good: dict[str, str] = {}
        bad: dict[str, str] = {}
        pending_at_kill: list[int] = []
        waves = np.array_split(np.arange(len(entries)), kills + 1)
        s.service.start()
        for w, idx in enumerate(waves):
            for i in idx:
                kind, label, raw = entries[i]
                eid = s.streams.publish_raw(ROLLOUTS, {FIELD: raw})
                (good if kind == "good" else bad)[eid] = label
            if w < kills:  # crash with entries in flight (read, not acked), or soon after
                _wait(lambda: s.streams.pending_count(ROLLOUTS, GROUP_REWARDERS) > 0, s.service, 10, every_s=0.002)
                pending_at_kill.append(s.streams.pending_count(ROLLOUTS, GROUP_REWARDERS))
                s.service.crash()
        t0 = time.monotonic()
        _wait(lambda: all_read(s), s.service, timeout_s, every_s=0.2)
        settle_s = time.monotonic() - t0
        rc = s.service.drain(s.streams, s.job)
        out = outcome(s, good, bad)
        out.update(drain_rc=rc, pending_at_kill=pending_at_kill, settle_s=round(settle_s, 1))
        return out
    finally:
        s.streams.delete_all()
        s.ledger.close()


def run_memory(
    url: str, tmp_path: Path, *, big: int = 10, big_mib: int = 50, near: int = 4, timeout_s: float = 180
) -> dict:
    """Ten 50 MB entries, both bombs and four entries just under the limit, between good rollouts,
    read by a consumer allowed 64 entries a read. Returns the consumer's idle and peak RSS."""
    s = open_setup(url, tmp_path, batch=64)
    try:
        s.service.start()
        warm = [good_rollout(s.job, 1000 + i) for i in range(4)]
        for g in warm:
            s.streams.publish_raw(ROLLOUTS, {FIELD: encode(g)})
        _wait(lambda: s.ledger.count_samples(s.job, status="scored") >= len(warm), s.service, 60)
        time.sleep(0.5)
        idle = s.service.rss_mib()
        idle_peak = s.service.peak_rss_mib
        good: dict[str, str] = {}
        bad: dict[str, str] = {}
        payload = b"\x00" * (big_mib * 1000 * 1000)
        pipe = s.streams.r.pipeline(transaction=True)  # all in the stream before the next read
        for _ in range(big):
            pipe.xadd(s.streams.key(ROLLOUTS), {FIELD: payload})
        ids = pipe.execute()
        bad.update({i.decode(): f"big-{n}" for n, i in enumerate(ids)})
        del payload, pipe
        bad[s.streams.publish_raw(ROLLOUTS, {FIELD: bomb_nested()})] = "bomb_nested"
        bad[s.streams.publish_raw(ROLLOUTS, {FIELD: bomb_flat(s.job)})] = "bomb_flat"
        for i in range(near):  # valid, each a little under MAX_MESSAGE_BYTES
            g = good_rollout(s.job, 2000 + i).model_copy(update={"completion": "y" * (MAX_MESSAGE_BYTES - 4096)})
            good[s.streams.publish_raw(ROLLOUTS, {FIELD: encode(g)})] = g.msg_id
        for i in range(8):
            g = good_rollout(s.job, 3000 + i)
            good[s.streams.publish_raw(ROLLOUTS, {FIELD: encode(g)})] = g.msg_id
        _wait(lambda: all_read(s), s.service, timeout_s, every_s=0.05)
        rc = s.service.drain(s.streams, s.job)
        out = outcome(s, good, bad)
        out.update(
            drain_rc=rc,
            idle_rss_mib=round(idle, 1),
            idle_peak_rss_mib=round(idle_peak, 1),
            bound_mib=round(idle + RSS_HEADROOM_MIB, 1),
        )
        return out
    finally:
        s.streams.delete_all()
        s.ledger.close()


# -- the tests ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("ledger_url", ["postgres"], indirect=True)  # the refused-row tests below take both
def test_poison_burst_costs_no_good_rollout(ledger_url: str, tmp_path: Path) -> None:
    from hostile_results import record_hostile

    out = run_burst(ledger_url, tmp_path)
    print(out)
    unplanned = [rc for rc in out["exits"] if rc != -signal.SIGKILL]
    record_hostile(
        good_lost=out["good"] - out["good_scored"],
        good_dead_lettered=out["good_dead_lettered"],
        service_exits=len(unplanned),
        peak_rss_mib=out["peak_rss_mib"],
    )
    assert unplanned == [] and out["drain_rc"] == 0, out
    assert out["good_scored"] == out["good_published_once"] == out["good"], out
    assert out["good_published_extra"] == 0 and out["good_dead_lettered"] == 0, out
    assert out["poisons_dead_lettered"] == out["poisons"] and out["poisons_published"] == 0, out
    assert out["pending"] == 0 and out["starts"] == 3, out
    codes = out["dead_codes"]
    assert codes["ledger_refuses_row"] == codes["ledger_refuses_score"] == "ledger_rejected", codes
    assert codes["duplicate_msg_id"] == "duplicate_msg_id", codes
    assert codes["oversized"] == codes["msgpack_bomb_nested"] == codes["msgpack_bomb_flat"] == "oversized", codes
    assert {
        codes[k]
        for k in (
            "nul_in_completion",
            "nan_logprob",
            "inf_logprob",
            "positive_logprob",
            "inf_temperature",
            "negative_token_id",
            "version_order",
            "bool_as_int",
            "str_as_int",
            "policy_version_2**63",
            "prompt_index_2**31",
        )
    } == {"invalid"}, codes
    assert codes["bool_schema_version"] == "schema_version", codes


@pytest.mark.slow
def test_consumer_memory_is_bounded(tmp_path: Path) -> None:
    """The ledger plays no part in a read's memory: SQLite only."""
    from hostile_results import record_hostile

    out = run_memory(f"sqlite:///{tmp_path}/ledger.db", tmp_path)
    print(out)
    unplanned = [rc for rc in out["exits"] if rc != -signal.SIGKILL]
    record_hostile(
        good_lost=out["good"] - out["good_scored"],
        good_dead_lettered=out["good_dead_lettered"],
        service_exits=len(unplanned),
        peak_rss_mib=out["peak_rss_mib"],
        reward_consumer_rss={k: out[k] for k in ("idle_rss_mib", "peak_rss_mib", "bound_mib")},
    )
    assert unplanned == [] and out["drain_rc"] == 0, out
    assert out["good_scored"] == out["good"] and out["good_dead_lettered"] == 0, out
    assert out["poisons_dead_lettered"] == out["poisons"], out
    assert out["peak_rss_mib"] <= out["bound_mib"], out


# -- the pieces, one by one ------------------------------------------------------------------------


def sample_rows(job: str, n: int) -> list[dict]:
    return [
        {
            "msg_id": f"{job}/s{i}",
            "job_id": job,
            "group_id": f"{job}/g",
            "sample_index": i,
            "prompt_index": 0,
            "generator_id": "gen",
            "gen_version_min": 0,
            "num_prompt_tokens": 1,
            "num_completion_tokens": 1,
            "completion": f"c{i}",
        }
        for i in range(n)
    ]


def test_a_refused_row_is_isolated_and_the_rest_written(ledger_url: str) -> None:
    from broker.ledger import write_isolating

    ledger = Ledger(ledger_url)
    try:
        rows = sample_rows("iso", 10)
        rows[2]["gen_version_min"] = 2**63  # SQLite: OverflowError; PostgreSQL: integer out of range
        rows[7]["prompt_index"] = 2**31 if ledger.engine.dialect.name == "postgresql" else 2**64
        done, refused = write_isolating(ledger.record_generated, rows)
        assert sum(done) == 8 and sorted(refused) == [2, 7]
        assert all(("out of range" in why or "too large" in why) for why in refused.values()), refused
        assert {r["msg_id"] for r in ledger.samples("iso")} == {
            r["msg_id"] for i, r in enumerate(rows) if i not in (2, 7)
        }
        if ledger.engine.dialect.name == "postgresql":
            nul = sample_rows("nul", 3)
            nul[1]["completion"] = "a\x00b"
            done, refused = write_isolating(ledger.record_generated, nul)
            assert sum(done) == 2 and list(refused) == [1] and "NUL" in refused[1]
    finally:
        ledger.close()


def test_errors_about_the_database_are_not_pinned_on_a_row() -> None:
    from sqlalchemy.exc import OperationalError

    from broker.ledger import write_isolating

    calls = []

    def down(items):
        calls.append(len(items))
        raise OperationalError("INSERT ...", {}, Exception("server closed the connection unexpectedly"))

    with pytest.raises(OperationalError):
        write_isolating(down, [1, 2, 3, 4])
    assert calls == [4]  # not split: every row would have been dead-lettered for an outage


def test_a_second_entry_of_a_scored_sample_is_not_scored_again(ledger_url: str) -> None:
    ledger = Ledger(ledger_url)
    try:
        ledger.record_generated(sample_rows("dup", 2))
        first = ("dup/s0", 1.0, "ok", {"entry": "rollouts/1-0"})
        assert ledger.record_scored_ids([first, ("dup/s1", 0.0, "ok", {"entry": "rollouts/1-1"})]) == {
            "dup/s0",
            "dup/s1",
        }
        assert ledger.record_scored_ids([first]) == {"dup/s0"}  # the same entry again: its publish was lost
        assert ledger.record_scored_ids([("dup/s0", 0.5, "ok", {"entry": "rollouts/9-0"})]) == set()  # another entry
        assert ledger.record_scored_ids([("dup/s0", 0.5)]) == set()
        assert ledger.samples("dup")[0]["reward"] == 1.0
    finally:
        ledger.close()


def test_admin_task_arguments_are_checked() -> None:
    from broker.admin import task_args

    assert task_args("job-1", 3) == ("job-1", 3)
    for job_id, step, why in [
        ("j", True, "step"),
        ("j", "3", "step"),
        ("j", 2**31, "step"),
        ("j", -1, "step"),
        ("j\x00", 1, "job_id"),
        (7, 1, "job_id"),
    ]:
        with pytest.raises(ValueError, match=f"invalid task argument {why}"):
            task_args(job_id, step)


def test_trainer_dead_letters_token_ids_outside_its_vocabulary() -> None:
    pytest.importorskip("torch")
    from shared.schema import Scored
    from trainer_svc.sink import out_of_vocab

    r = good_rollout("v", 1).model_copy(update={"completion_ids": pack_i32([4, 50_000])})
    s = Scored(job_id="v", msg_id=r.msg_id, group_id=r.group_id, policy_version=1, rollout=r, reward=1.0)
    assert out_of_vocab(s, 50_001) is None
    assert "rollout.completion_ids[1] is 50000, outside the model's vocabulary of 50000" in (
        out_of_vocab(s, 50_000) or ""
    )


def test_generator_dead_letters_a_group_the_engine_botched() -> None:
    from broker.streams import GROUP_GENERATORS, PROMPTS, Consumer, Delivery
    from generator_svc.engine import Sample
    from generator_svc.service import entry_rollouts
    from shared.schema import PromptGroup, SamplingParams

    job = f"gen-{uuid.uuid4().hex[:6]}"
    js = JobStreams(connect(REDIS_URL), job, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    try:
        js.ensure_group(PROMPTS, GROUP_GENERATORS)
        groups = [
            PromptGroup(
                job_id=job,
                msg_id=f"{job}/g{i}",
                group_id=f"{job}/g{i}",
                policy_version=0,
                prompt_index=i,
                prompt="1+1=",
                answer="2",
                n=1,
                sampling=SamplingParams(),
            )
            for i in range(2)
        ]
        ids = js.publish_many(PROMPTS, groups)
        js.consume(Consumer(PROMPTS, GROUP_GENERATORS, "gen-0", PromptGroup), block_ms=None)
        units = [(Delivery(eid, g), [g]) for eid, g in zip(ids, groups, strict=True)]

        def sample(lp: float, text: str) -> Sample:
            return Sample(prompt_ids=[1], completion_ids=[2], logprobs=[lp], text=text, finish_reason="stop")

        out = entry_rollouts(units, [[sample(float("nan"), "2")], [sample(-0.1, "2\x00\x1b")]], 0, "gen-0", js)
        assert [(eid, [r.completion for r in rs]) for eid, rs in out] == [(ids[1], ["2\ufffd\ufffd"])]
        (dead,) = js.dead_letters()
        assert dead.entry_id == ids[0] and dead.code == "invalid_output" and "logprobs[0] is nan" in dead.reason
        assert js.pending_count(PROMPTS, GROUP_GENERATORS) == 1  # the dead one acked, the good one still held
    finally:
        js.delete_all()
