"""The ledger on SQLite and PostgreSQL: schema, idempotency, status transitions, concurrency."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from broker.ledger import Base, Ledger
from broker.ledger import rows as ledger_rows
from broker.ledger.engine import Database
from broker.ledger.jobs import JobRepository
from broker.ledger.samples import SampleRepository

REPO = Path(__file__).resolve().parents[2]
HEAD = "0010"
TABLES = {
    "jobs",
    "policy_versions",
    "generator_loads",
    "samples",
    "train_steps",
    "evals",
    "job_changes",
    "checkpoints",
    "step_inputs",
}


def sample(msg_id: str, *, job_id: str = "job", gen_version: int = 0, **extra: Any) -> dict:
    return {
        "msg_id": msg_id,
        "job_id": job_id,
        "group_id": f"g-{msg_id}",
        "sample_index": 0,
        "prompt_index": 7,
        "generator_id": "gen-0",
        "gen_version_min": gen_version,
        "num_prompt_tokens": 5,
        "num_completion_tokens": 9,
        "completion": "The answer is 4.",
        **extra,
    }


def by_msg_id(ledger: Ledger, job_id: str = "job") -> dict[str, dict]:
    return {s["msg_id"]: s for s in ledger.samples(job_id)}


def run_python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


# -- schema and migrations ---------------------------------------------------------------------


def test_migrations_create_the_tables(ledger: Ledger) -> None:
    insp = inspect(ledger.engine)
    assert TABLES | {"alembic_version"} <= set(insp.get_table_names())
    assert ledger.current_revision() == HEAD
    assert {u["name"] for u in insp.get_unique_constraints("samples")} == {"uq_samples_msg_id"}
    indexes = {i["name"]: i["column_names"] for i in insp.get_indexes("samples")}
    assert indexes["ix_samples_job_id_status"] == ["job_id", "status"]


def test_models_match_the_migrations(ledger: Ledger) -> None:
    # Guards against editing a model without writing the migration (or the reverse).
    with ledger.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []


@pytest.mark.parametrize(
    ("shape", "table"),
    [
        (ledger_rows.JobRow, "jobs"),
        (ledger_rows.JobChangeRow, "job_changes"),
        (ledger_rows.SampleRow, "samples"),
        (ledger_rows.PolicyVersionRow, "policy_versions"),
        (ledger_rows.GeneratorLoadRow, "generator_loads"),
        (ledger_rows.TrainStepRow, "train_steps"),
        (ledger_rows.CheckpointRow, "checkpoints"),
        (ledger_rows.StepInputRow, "step_inputs"),
        (ledger_rows.EvalRow, "evals"),
        (ledger_rows.AdminTaskRow, "admin_tasks"),
    ],
)
def test_row_shapes_match_the_tables(shape: Any, table: str) -> None:
    # A row read back has exactly its table's columns.
    assert shape.__required_keys__ | shape.__optional_keys__ == set(Base.metadata.tables[table].columns.keys())


def test_sample_input_shape_matches_the_table() -> None:
    columns = set(Base.metadata.tables["samples"].columns.keys())
    sample_in = ledger_rows.SampleIn
    assert sample_in.__required_keys__ | sample_in.__optional_keys__ == columns - {"id"}
    assert set(sample("m1")) == sample_in.__required_keys__


def test_upgrade_at_head_is_a_noop(ledger_url: str) -> None:
    with Ledger(ledger_url) as led:
        led.create_job("j1", "first", {"lr": 1e-6})
        assert led.record_generated([sample("m1", job_id="j1")]) == 1
    # The operator entry point, on a database already at head.
    proc = run_python("-m", "broker.ledger", "upgrade", "--url", ledger_url)
    assert proc.returncode == 0, proc.stderr
    with Ledger(ledger_url) as led:  # migrate=True again
        led.upgrade()
        assert led.current_revision() == HEAD
        assert led.get_job("j1")["spec"] == {"lr": 1e-6}
        assert [s["msg_id"] for s in led.samples("j1")] == ["m1"]


def test_processes_starting_at_once_migrate_once(ledger_url: str) -> None:
    code = f"from broker.ledger import Ledger; Ledger({ledger_url!r}).close()"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True) for _ in range(4)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    with Ledger(ledger_url, migrate=False) as led:
        assert led.current_revision() == HEAD
        with led.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1


def test_sqlite_uses_wal_and_creates_the_directory(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "ledger.db"
    with Ledger(f"sqlite:///{path}") as led:
        assert path.exists()
        with led.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 30_000


def test_bare_postgresql_url_means_psycopg3(pg_url: str) -> None:
    bare = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with Ledger(bare) as led:
        assert led.engine.dialect.driver == "psycopg"
        assert led.current_revision() == HEAD


def test_unsupported_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="sqlite"):
        Ledger("mysql+pymysql://u@h/db", migrate=False)


def test_import_without_torch_or_vllm() -> None:
    proc = run_python(
        "-c",
        "import broker.ledger, sys; assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'heavy import'",
    )
    assert proc.returncode == 0, proc.stderr


def test_a_repository_works_alone_over_a_database(ledger_url: str) -> None:
    db = Database(ledger_url)
    try:
        db.upgrade()
        assert JobRepository(db).create_job("j1", "alone", {})
        assert SampleRepository(db).record_generated([sample("a", job_id="j1")]) == 1
    finally:
        db.close()
    with Ledger(ledger_url) as led:
        assert led.get_job("j1")["name"] == "alone" and led.status_counts("j1") == {"generated": 1}


# -- jobs ----------------------------------------------------------------------------------------


def test_jobs(ledger: Ledger) -> None:
    assert ledger.create_job("j1", "first", {"lr": 1e-6, "tags": ["a"]})
    assert not ledger.create_job("j1", "again", {"lr": 1.0})  # no second effect
    job = ledger.get_job("j1")
    assert job is not None
    assert (job["name"], job["spec"], job["state"], job["step"]) == (
        "first",
        {"lr": 1e-6, "tags": ["a"]},
        "queued",
        0,
    )
    assert job["created_at"].tzinfo is not None
    assert job["created_at"].utcoffset().total_seconds() == 0
    assert ledger.get_job("nope") is None

    ledger.create_job("j2", "second", {})
    assert [j["id"] for j in ledger.list_jobs()] == ["j2", "j1"]
    assert [j["id"] for j in ledger.list_jobs(limit=1)] == ["j2"]
    assert ledger.latest_job()["id"] == "j2"

    ledger.set_job_state("j2", "failed", error="OOM")
    ledger.set_job_state("j2", "failed", error="OOM")
    assert ledger.get_job("j2")["error"] == "OOM"
    assert ledger.latest_job()["id"] == "j1"
    assert ledger.latest_job(states=("failed",))["id"] == "j2"
    assert ledger.latest_job(states=("finished",)) is None

    ledger.set_job_state("j1", "running")
    ledger.set_job_step("j1", 3)
    ledger.set_job_step("j1", 3)
    job = ledger.get_job("j1")
    assert (job["state"], job["step"], job["error"]) == ("running", 3, None)
    assert job["updated_at"] >= job["created_at"]

    with pytest.raises(ValueError, match="queued"):
        ledger.set_job_state("j1", "exploded")
    with pytest.raises(LookupError):
        ledger.set_job_state("ghost", "running")
    with pytest.raises(LookupError):
        ledger.set_job_step("ghost", 1)


def test_the_queue_is_priority_then_first_in_first_out(ledger: Ledger) -> None:
    for job_id, priority in (("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1)):
        ledger.create_job(job_id, job_id, {"priority": priority})
        time.sleep(0.002)  # distinct created_at
    assert [j["id"] for j in ledger.queue()] == ["b", "d", "a", "c", "e"]
    assert ledger.move_job("a", ("queued",), "cancelled")  # taken out of line: never claimed
    assert not ledger.move_job("a", ("queued",), "running")  # no second effect
    claimed = [ledger.claim_next()["id"] for _ in range(4)]  # type: ignore[index]
    assert claimed == ["b", "d", "c", "e"]
    assert ledger.claim_next() is None
    assert {j["id"]: j["state"] for j in ledger.list_jobs()} == {
        "a": "cancelled",
        "b": "running",
        "c": "running",
        "d": "running",
        "e": "running",
    }
    # an end state is not left by a conditional move from the live states
    assert ledger.move_job("b", ("queued", "running"), "failed", error="boom")
    assert not ledger.move_job("b", ("queued", "running"), "cancelled")
    assert ledger.get_job("b")["error"] == "boom"  # type: ignore[index]


def test_two_claims_at_once_take_different_jobs(ledger: Ledger) -> None:
    for i in range(6):
        ledger.create_job(f"j{i}", "j", {})
    got: list[str] = []
    lock = threading.Lock()

    def claim() -> None:
        while (job := ledger.claim_next()) is not None:
            with lock:
                got.append(job["id"])

    threads = [threading.Thread(target=claim) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [f"j{i}" for i in range(6)]  # each once


# -- samples -------------------------------------------------------------------------------------


def test_record_generated_is_idempotent(ledger: Ledger) -> None:
    assert ledger.record_generated([sample("a"), sample("b")]) == 2
    assert ledger.record_generated([sample("a"), sample("b")]) == 0
    # A redelivered batch overlapping new rows inserts only the new ones.
    assert ledger.record_generated([sample("b"), sample("c")]) == 1
    assert ledger.record_generated([]) == 0
    rows = by_msg_id(ledger)
    assert sorted(rows) == ["a", "b", "c"]
    a = rows["a"]
    assert (a["status"], a["kind"], a["gen_version_max"], a["reward"]) == (
        "generated",
        "train",
        0,
        None,
    )
    assert a["created_at"].tzinfo is not None


def test_record_generated_rejects_bad_rows(ledger: Ledger) -> None:
    with pytest.raises(ValueError, match="missing keys.*completion"):
        ledger.record_generated([{k: v for k, v in sample("a").items() if k != "completion"}])
    with pytest.raises(ValueError, match="unknown keys.*logprobs"):
        ledger.record_generated([sample("a", logprobs=[0.1])])
    with pytest.raises(ValueError, match="sample kind"):
        ledger.record_generated([sample("a", kind="test")])
    assert ledger.samples("job") == []


def test_scored_only_from_generated(ledger: Ledger) -> None:
    ledger.record_generated([sample("a"), sample("b"), sample("c")])
    assert ledger.record_scored([("a", 1.0), ("b", 0.0)]) == 2
    # Redelivery (even with a different value) has no second effect.
    assert ledger.record_scored([("a", 0.5), ("b", 0.5)]) == 0
    assert ledger.record_scored([("unknown", 1.0)]) == 0
    assert ledger.record_scored([]) == 0
    ledger.record_used([{"msg_id": "c", "status": "dropped", "trainer_version": 1}])
    assert ledger.record_scored([("c", 1.0)]) == 0  # used samples are final

    rows = by_msg_id(ledger)
    assert (rows["a"]["status"], rows["a"]["reward"]) == ("scored", 1.0)
    assert (rows["b"]["status"], rows["b"]["reward"]) == ("scored", 0.0)
    assert rows["a"]["scored_at"] >= rows["a"]["created_at"]
    assert (rows["c"]["status"], rows["c"]["reward"], rows["c"]["scored_at"]) == (
        "dropped",
        None,
        None,
    )


def test_used_at_most_once(ledger: Ledger) -> None:
    ledger.record_generated([sample("a", gen_version=2), sample("b", gen_version=4), sample("c", gen_version=1)])
    ledger.record_scored([("a", 1.0), ("b", 0.0)])
    used = [
        # staleness omitted: computed as trainer_version - gen_version_min.
        {"msg_id": "a", "status": "trained", "trainer_version": 5},
        {"msg_id": "b", "status": "trained", "trainer_version": 5, "staleness": 1},
        # Dropped straight from 'generated', with a reward supplied by the trainer.
        {
            "msg_id": "c",
            "status": "dropped",
            "trainer_version": 5,
            "drop_reason": "stale",
            "reward": 0.25,
        },
    ]
    assert ledger.record_used(used) == 3
    assert ledger.record_used(used) == 0
    assert ledger.record_used([{"msg_id": "a", "status": "dropped", "trainer_version": 9}]) == 0
    assert ledger.record_used([]) == 0

    rows = by_msg_id(ledger)
    a, b, c = rows["a"], rows["b"], rows["c"]
    assert (a["status"], a["trainer_version"], a["staleness"], a["reward"]) == (
        "trained",
        5,
        3,
        1.0,
    )
    assert (b["status"], b["staleness"]) == ("trained", 1)
    assert (c["status"], c["drop_reason"], c["staleness"], c["reward"]) == (
        "dropped",
        "stale",
        4,
        0.25,
    )
    assert a["used_at"] >= a["scored_at"]

    with pytest.raises(ValueError, match="trained"):
        ledger.record_used([{"msg_id": "a", "status": "scored", "trainer_version": 1}])
    with pytest.raises(ValueError, match="allowed keys"):
        ledger.record_used([{"msg_id": "a", "status": "trained", "version": 1}])


def test_eval_samples(ledger: Ledger) -> None:
    ledger.record_generated([sample("e1", kind="eval"), sample("t1")])
    ledger.record_scored([("e1", 1.0)])
    assert ledger.record_used([{"msg_id": "e1", "status": "evaluated", "trainer_version": 3}]) == 1
    assert [s["msg_id"] for s in ledger.samples("job", kind="eval")] == ["e1"]
    assert [s["msg_id"] for s in ledger.samples("job", kind="train")] == ["t1"]
    assert ledger.staleness_histogram("job") == {}
    assert ledger.staleness_histogram("job", status="evaluated") == {3: 1}


def test_queries(ledger: Ledger) -> None:
    ledger.record_generated([sample(f"m{i:02d}", gen_version=i % 3) for i in range(12)])
    ledger.record_generated([sample("other", job_id="job2")])
    ledger.record_scored([(f"m{i:02d}", float(i)) for i in range(8)])
    ledger.record_used(
        [{"msg_id": f"m{i:02d}", "status": "trained", "trainer_version": 4} for i in range(6)]
        + [{"msg_id": "m06", "status": "dropped", "trainer_version": 4, "drop_reason": "stale"}]
    )

    assert ledger.status_counts("job") == {"trained": 6, "dropped": 1, "scored": 1, "generated": 4}
    assert ledger.status_counts("job2") == {"generated": 1}
    assert ledger.status_counts("nobody") == {}
    # gen versions of m00..m05 are 0,1,2,0,1,2 -> staleness 4,3,2,4,3,2 at trainer version 4.
    assert ledger.staleness_histogram("job") == {2: 2, 3: 2, 4: 2}
    assert list(ledger.staleness_histogram("job")) == [2, 3, 4]
    assert ledger.staleness_histogram("job", status="dropped") == {4: 1}

    assert [s["msg_id"] for s in ledger.samples("job", status="scored")] == ["m07"]
    page = ledger.samples("job", limit=5, offset=10)
    assert [s["msg_id"] for s in page] == ["m10", "m11"]
    assert len(ledger.samples("job")) == 12
    with pytest.raises(ValueError):
        ledger.samples("job", status="vanished")

    asked = [f"m{i:02d}" for i in range(12)] + ["other", "missing"]
    assert ledger.used_msg_ids("job", asked) == {f"m{i:02d}" for i in range(7)}
    assert ledger.used_msg_ids("job2", asked) == set()
    assert ledger.used_msg_ids("job", []) == set()


def test_large_batches(ledger: Ledger) -> None:
    # Larger than any internal chunk or page size, to catch parameter-limit bugs.
    n = 3_000
    ids = [f"m{i:05d}" for i in range(n)]
    assert ledger.record_generated([sample(m, gen_version=i % 4) for i, m in enumerate(ids)]) == n
    assert ledger.record_scored([(m, 1.0) for m in ids]) == n
    used = [{"msg_id": m, "status": "trained", "trainer_version": 4} for m in ids[: n // 2]]
    assert ledger.record_used(used) == n // 2
    assert ledger.used_msg_ids("job", ids) == set(ids[: n // 2])
    assert sum(ledger.staleness_histogram("job").values()) == n // 2


# -- policy versions, generator loads, train steps, evals ----------------------------------------


def test_policy_versions_and_generator_loads(ledger: Ledger) -> None:
    big = 20 * 2**30  # num_bytes beyond 32 bits
    assert ledger.record_policy_version("job", 1, "xxh-1", big)
    assert not ledger.record_policy_version("job", 1, "xxh-1", big)
    assert ledger.record_policy_version("job", 0, "xxh-0", 10)
    versions = ledger.policy_versions("job")
    assert [(v["version"], v["checksum"], v["num_bytes"]) for v in versions] == [
        (0, "xxh-0", 10),
        (1, "xxh-1", big),
    ]

    assert ledger.record_generator_load("job", 1, "gen-b", fingerprint="fp")
    assert not ledger.record_generator_load("job", 1, "gen-b", fingerprint="fp")
    assert ledger.record_generator_load("job", 1, "gen-a")
    assert ledger.record_generator_load("job", 0, "gen-a")
    loads = ledger.generator_loads("job")
    # By version, then by load time.
    assert [(x["version"], x["generator_id"]) for x in loads] == [
        (0, "gen-a"),
        (1, "gen-b"),
        (1, "gen-a"),
    ]
    assert {x["fingerprint"] for x in loads if x["generator_id"] == "gen-b"} == {"fp"}
    assert all(x["loaded_at"].tzinfo is not None for x in loads)
    assert ledger.generator_loads("other") == []


def test_train_step_with_the_job_step_is_one_write(ledger: Ledger) -> None:
    """record_train_step(job_step=True) also moves the job's step; for an unknown job it raises
    and writes neither (one transaction)."""
    ledger.create_job("j1", "first", {})
    ledger.record_train_step("j1", 4, 4, {"loss": 0.5}, job_step=True)
    assert ledger.get_job("j1")["step"] == 4
    assert [s["step"] for s in ledger.train_steps("j1")] == [4]
    with pytest.raises(LookupError, match="ghost"):
        ledger.record_train_step("ghost", 1, 1, {"loss": 0.5}, job_step=True)
    assert ledger.train_steps("ghost") == []


def test_train_steps_upsert(ledger: Ledger) -> None:
    metrics = {"loss": 0.5, "reward/mean": 0.25, "off_policy/mean": 1.5}
    ledger.record_train_step("job", 2, 2, metrics)
    ledger.record_train_step("job", 1, 1, {"loss": 1.0})
    ledger.record_train_step("job", 2, 2, metrics)  # redelivered: no second row
    steps = ledger.train_steps("job")
    assert [(s["step"], s["policy_version"]) for s in steps] == [(1, 1), (2, 2)]
    assert steps[1]["metrics"] == metrics
    # A replayed step (resume from an older checkpoint) overwrites its metrics.
    ledger.record_train_step("job", 2, 2, {"loss": 0.4})
    assert ledger.train_steps("job")[1]["metrics"] == {"loss": 0.4}
    # numpy scalars are stored as numbers; non-finite values as null (JSON has no NaN).
    ledger.record_train_step("job", 3, 3, {"loss": np.float32(0.5), "n": np.int64(4), "kl": float("nan")})
    assert ledger.train_steps("job")[2]["metrics"] == {"loss": 0.5, "n": 4, "kl": None}


def test_step_inputs_keep_their_bytes_and_a_redone_step_overwrites(ledger: Ledger) -> None:
    blob = bytes(range(256)) * 40  # every byte value: stored and read back as it is
    row = {
        "job_id": "job",
        "step": 2,
        "policy_version": 2,
        "lr": 1e-4,
        "checksum": "ab12",
        "restored_from": None,
        "identity": {"torch": "2.13.0+cpu", "threads": 1},
        "meta": {"format": 1, "term_names": []},
        "data": blob,
    }
    ledger.record_step_input(row)  # type: ignore[arg-type]
    ledger.record_step_input({**row, "step": 1, "data": b"one"})  # type: ignore[arg-type]
    assert ledger.step_input_steps("job") == [1, 2]
    got = ledger.step_input("job", 2)
    assert got is not None and bytes(got["data"]) == blob
    assert {k: got[k] for k in row if k != "data"} == {k: v for k, v in row.items() if k != "data"}  # type: ignore[literal-required]
    first = got["created_at"]
    # a step re-done after a resume: its record replaced (what follows is the re-done step's)
    ledger.record_step_input({**row, "checksum": "cd34", "restored_from": 0, "data": b"again"})  # type: ignore[arg-type]
    again = ledger.step_input("job", 2)
    assert again is not None and (again["checksum"], again["restored_from"], bytes(again["data"])) == (
        "cd34",
        0,
        b"again",
    )
    assert again["created_at"] == first
    assert ledger.step_input("job", 3) is None and ledger.step_input_steps("other") == []


def test_evals_upsert(ledger: Ledger) -> None:
    ledger.record_eval("job", 10, 9, 10, 0.5, 64)
    ledger.record_eval("job", 10, 9, 10, 0.5, 64)
    ledger.record_eval("job", 5, 5, 5, 0.25, 64)
    evals = ledger.evals("job")
    assert [(e["step"], e["policy_version_min"], e["policy_version_max"]) for e in evals] == [
        (5, 5, 5),
        (10, 9, 10),
    ]
    assert (evals[1]["reward_mean"], evals[1]["n"]) == (0.5, 64)
    ledger.record_eval("job", 10, 10, 10, 0.75, 128)
    assert (ledger.evals("job")[1]["reward_mean"], ledger.evals("job")[1]["n"]) == (0.75, 128)


def test_timestamps_are_utc(ledger: Ledger) -> None:
    before = datetime.now(timezone.utc)
    ledger.record_generated([sample("a")])
    created = ledger.samples("job")[0]["created_at"]
    assert created.tzinfo is not None and created.utcoffset().total_seconds() == 0
    assert before <= created <= datetime.now(timezone.utc)


# -- concurrency -----------------------------------------------------------------------------------


def test_two_ledgers_write_concurrently(ledger_url: str) -> None:
    """Two instances (as two processes would) hammer the same database at once.

    On SQLite this fails with "database is locked" without WAL, the busy timeout and
    BEGIN IMMEDIATE; on PostgreSQL it checks for deadlocks between overlapping batches.
    """
    first, second = Ledger(ledger_url), Ledger(ledger_url)
    rounds, batch = 25, 40
    errors: list[BaseException] = []

    def worker(led: Ledger, offset: int) -> None:
        try:
            for r in range(rounds):
                # Half of each batch overlaps the other worker's: same msg_ids, racing.
                ids = [f"r{r:03d}-{i:03d}" for i in range(offset, offset + batch)]
                led.record_generated([sample(m, gen_version=r) for m in ids])
                led.record_scored([(m, 1.0) for m in ids])
                led.record_used([{"msg_id": m, "status": "trained", "trainer_version": r + 1} for m in ids])
                led.record_train_step("job", r, r, {"loss": float(r)})
                led.record_generator_load("job", r, f"gen-{offset}")
                led.status_counts("job")
        except BaseException as e:  # collected for the main thread's assertion
            errors.append(e)

    threads = [
        threading.Thread(target=worker, args=(first, 0)),
        threading.Thread(target=worker, args=(second, batch // 2)),
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        distinct = rounds * (batch + batch // 2)
        assert first.status_counts("job") == {"trained": distinct}
        # Every sample used exactly once, one policy update old.
        assert first.staleness_histogram("job") == {1: distinct}
        assert len(first.train_steps("job")) == rounds
        assert len(first.generator_loads("job")) == 2 * rounds
    finally:
        first.close()
        second.close()


def test_upgrade_keeps_an_existing_databases_rows(ledger_url: str) -> None:
    old = Ledger(ledger_url, migrate=False)
    old.upgrade("0001")  # a database created by the first release
    with old.engine.begin() as conn:  # a job, a sample and an evaluation as 0001 stored them
        conn.execute(
            text(
                "INSERT INTO jobs (id, name, spec, state, step, created_at, updated_at) "
                "VALUES ('j1', 'old', '{\"model_path\": \"m\"}', 'submitted', 0, :t, :t)"
            ),
            {"t": datetime.now(timezone.utc)},
        )
        conn.execute(
            text(
                "INSERT INTO samples (msg_id, job_id, group_id, sample_index, kind, prompt_index, generator_id, "
                "gen_version_min, gen_version_max, num_prompt_tokens, num_completion_tokens, completion, status, "
                "created_at) VALUES ('j1/g0/0', 'j1', 'j1/g0', 0, 'train', 0, 'gen', 0, 0, 3, 2, '42', "
                "'generated', :t)"
            ),
            {"t": datetime.now(timezone.utc)},
        )
        conn.execute(
            text(
                "INSERT INTO evals (job_id, step, policy_version_min, policy_version_max, reward_mean, n, "
                "created_at) VALUES (:j, 5, 4, 5, 0.75, 16, :t)"
            ),
            {"j": "j1", "t": datetime.now(timezone.utc)},
        )
    old.close()
    new = Ledger(ledger_url)  # upgrades to head on open
    assert new.current_revision() == HEAD
    assert new.get_job("j1")["name"] == "old" and new.status_counts("j1") == {"generated": 1}
    # 0008: a job stored as `submitted` waits in the queue, at priority 0
    assert (new.get_job("j1")["state"], new.get_job("j1")["priority"]) == ("queued", 0)
    assert [j["id"] for j in new.queue()] == ["j1"]
    # 0004 re-keys evals by (job, step, source): the old row is the pipeline's, and a checkpoint
    # evaluation of the same step is a second row beside it
    (row,) = new.evals("j1")
    assert (row["step"], row["source"], row["reward_mean"], row["n"]) == (5, "pipeline", 0.75, 16)
    new.record_eval("j1", 5, 5, 5, 0.5, 16, source="checkpoint")
    assert [e["source"] for e in new.evals("j1")] == ["pipeline", "checkpoint"]
    # 0005: named evaluation sets; the old rows are the default set's
    assert {e["name"] for e in new.evals("j1")} == {"held_out"}
    new.record_eval("j1", 5, 5, 5, 0.25, 8, name="hard", metrics={"pass@4": 0.5}, wall_s=3.0)
    hard = [e for e in new.evals("j1") if e["name"] == "hard"]
    assert [(e["reward_mean"], e["metrics"], e["wall_s"]) for e in hard] == [(0.25, {"pass@4": 0.5}, 3.0)]
    new.record_scored([("j1/g0/0", 0.0, "timeout", {"reason": "no answer within 30 s"})])
    (srow,) = new.samples("j1")
    assert (srow["reward_status"], srow["reward_details"]) == ("timeout", {"reason": "no answer within 30 s"})
    assert new.get_job("j1")["started_at"] is None
    new.mark_job_started("j1")
    first = new.get_job("j1")["started_at"]
    new.mark_job_started("j1")  # a restarted trainer keeps the first start
    assert first is not None and new.get_job("j1")["started_at"] == first
    new.record_change("j1", "rw token 1a2b", {"lr": 1e-5})
    new.record_change("j1", "anonymous", {"command": "pause"})
    assert [(c["actor"], c["changes"]) for c in new.job_changes("j1")] == [
        ("rw token 1a2b", {"lr": 1e-5}),
        ("anonymous", {"command": "pause"}),
    ]
    new.set_job_state("j1", "paused")
    assert new.list_jobs(states=["paused"])[0]["id"] == "j1"
    new.close()


def test_checkpoints(ledger: Ledger) -> None:
    ledger.record_checkpoint("j", 10, 10, "/ck/j/step-000010")
    ledger.record_checkpoint("j", 10, 10, "/elsewhere")  # idempotent per (job, step)
    ledger.record_checkpoint("j", 20, 20, "/ck/j/step-000020")
    assert [(c["step"], c["path"]) for c in ledger.checkpoints("j")] == [
        (10, "/ck/j/step-000010"),
        (20, "/ck/j/step-000020"),
    ]
