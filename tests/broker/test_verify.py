"""Ledger verification on SQLite and PostgreSQL: a clean job passes; each deliberately broken
invariant is caught (and only the checks it breaks fail); the CLI prints the table and exits
non-zero on violations."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import delete, update

import broker.verify
from broker.ledger import GeneratorLoad, Ledger, Sample, TrainStep
from broker.verify import CHECKS, main, verify

JOB = "job-verify"
SPEC = {
    "model_path": "/m",
    "group_size": 2,
    "prompts_per_step": 2,
    "max_staleness": 1,
    "task": {"n_test": 2},
}
samples_t = Sample.__table__
steps_t = TrainStep.__table__
loads_t = GeneratorLoad.__table__


def gid(g: int) -> str:
    return f"{JOB}/run1/g{g}"


def row(group: str, i: int, version: int, *, kind: str = "train", gen: str = "gen-0") -> dict:
    return {
        "msg_id": f"{group}/{i}",
        "job_id": JOB,
        "group_id": group,
        "sample_index": i,
        "kind": kind,
        "prompt_index": 0,
        "generator_id": gen,
        "gen_version_min": version,
        "gen_version_max": version,
        "num_prompt_tokens": 3,
        "num_completion_tokens": 4,
        "completion": "42",
    }


def train(ledger: Ledger, rows: list[dict], trainer_version: int, status: str = "trained") -> None:
    # staleness left to the ledger: trainer_version - gen_version_min, computed in SQL
    ledger.record_used([{"msg_id": r["msg_id"], "status": status, "trainer_version": trainer_version} for r in rows])


def build(ledger: Ledger, state: str = "finished") -> None:
    """A small job as the trainer leaves it: 2 steps of 2 groups of 2, a dropped group, an
    evaluation round, and one group still in flight."""
    ledger.create_job(JOB, "verify", SPEC, state=state)
    for v in range(3):
        ledger.record_policy_version(JOB, v, f"c{v}", 100)
        ledger.record_generator_load(JOB, v, "gen-0")
    steps = {
        1: [row(gid(0), i, 0) for i in range(2)] + [row(gid(1), i, 0) for i in range(2)],
        2: [row(gid(2), i, 1) for i in range(2)] + [row(gid(3), i, 0) for i in range(2)],
    }
    dropped = [row(gid(9), i, 0) for i in range(2)]
    evals = [row(f"{JOB}/run1/e0/{p}", 0, 0, kind="eval") for p in range(2)]
    in_flight = [row(gid(4), i, 2) for i in range(2)]
    everything = [r for rs in steps.values() for r in rs] + dropped + evals + in_flight
    ledger.record_generated(everything)
    ledger.record_scored([(r["msg_id"], 1.0) for r in everything[:-1]])  # the last stays 'generated'
    train(ledger, evals, 0, "evaluated")
    for step, rows in steps.items():
        train(ledger, rows, step - 1)
        ledger.record_train_step(JOB, step, step, {"samples": float(len(rows)), "loss": 0.1})
    ledger.record_used(
        [
            {"msg_id": r["msg_id"], "status": "dropped", "trainer_version": 2, "drop_reason": "staleness > 1"}
            for r in dropped
        ]
    )
    ledger.set_job_step(JOB, 2)


def sql(ledger: Ledger, stmt) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(stmt)


def test_clean_ledger_passes(ledger: Ledger) -> None:
    build(ledger)
    res = verify(ledger, JOB)
    assert res.ok, res.violations
    assert res.checks == dict.fromkeys(CHECKS, 0)
    assert res.counts == {"trained": 8, "dropped": 2, "evaluated": 2, "scored": 1, "generated": 1}
    assert res.in_flight == 2 and res.steps == 2 and res.total == 14
    (note,) = [f for f in res.info if f.check == "in_flight"]
    assert note.count == 2 and "nominal bound per trainer run 10" in note.message  # (1+1)*2*2 + 2


def test_samples_redis_lost_are_reported_not_violations(ledger: Ledger) -> None:
    """The in-flight group g4 was lost by Redis (the trainer settled it `lost`, as
    trainer_svc/sink.py does), and g5 never generated (its rows written lost by the trainer): an
    accounted loss, counted, with every invariant holding."""
    build(ledger)
    never = [
        dict(
            row(gid(5), i, 2),
            generator_id="",
            num_completion_tokens=0,
            completion="",
            status="lost",
            drop_reason="lost by Redis",
            trainer_version=2,
            staleness=0,
        )
        for i in range(2)
    ]
    ledger.record_generated(never)
    train(ledger, [row(gid(4), i, 2) for i in range(2)], 2, "lost")
    res = verify(ledger, JOB)
    assert res.ok, res.violations
    assert res.lost == 4 and res.in_flight == 0 and res.counts["lost"] == 4
    (note,) = [f for f in res.info if f.check == "lost"]
    assert note.count == 4 and "Redis lost" in note.message


def _wrong_staleness(ledger: Ledger) -> None:
    sql(ledger, update(samples_t).where(samples_t.c.msg_id == f"{gid(0)}/0").values(staleness=5))


def _gen_versions_reversed(ledger: Ledger) -> None:
    sql(
        ledger,
        update(samples_t).where(samples_t.c.msg_id == f"{gid(2)}/1").values(gen_version_min=1, gen_version_max=0),
    )


def _used_without_version(ledger: Ledger) -> None:
    sql(ledger, update(samples_t).where(samples_t.c.msg_id == f"{gid(9)}/0").values(trainer_version=None))


def _unknown_status(ledger: Ledger) -> None:
    sql(ledger, update(samples_t).where(samples_t.c.msg_id == f"{gid(4)}/0").values(status="vanished"))


def _trained_twice(ledger: Ledger) -> None:
    # The same (group, sample index) under a second msg_id, trained in a later step.
    dup = {**row(gid(0), 0, 0), "msg_id": f"{gid(0)}/0-again"}
    ledger.record_generated([dup])
    train(ledger, [dup], 1)
    ledger.record_train_step(JOB, 2, 2, {"samples": 5.0})


def _group_split(ledger: Ledger) -> None:
    # One sample of a group trained at step 1 shows up as trained at step 2 instead.
    sql(ledger, update(samples_t).where(samples_t.c.msg_id == f"{gid(1)}/1").values(trainer_version=1, staleness=1))
    ledger.record_train_step(JOB, 1, 1, {"samples": 3.0})
    ledger.record_train_step(JOB, 2, 2, {"samples": 5.0})


def _group_incomplete(ledger: Ledger) -> None:
    half = row(gid(5), 0, 1)
    ledger.record_generated([half])
    train(ledger, [half], 1)
    ledger.record_train_step(JOB, 2, 2, {"samples": 5.0})


def _step_count_wrong(ledger: Ledger) -> None:
    ledger.record_train_step(JOB, 2, 2, {"samples": 3.0})


def _trained_without_step(ledger: Ledger) -> None:
    late = [row(gid(6), i, 2) for i in range(2)]
    ledger.record_generated(late)
    train(ledger, late, 2)  # a third step's samples, but no train_steps row for it


def _version_never_loaded(ledger: Ledger) -> None:
    sql(ledger, delete(loads_t).where(loads_t.c.job_id == JOB, loads_t.c.version == 1))


BREAKS: dict[str, tuple[Callable[[Ledger], None], set[str]]] = {
    "staleness": (_wrong_staleness, {"staleness"}),
    "gen_version_order": (_gen_versions_reversed, {"gen_version_order"}),
    "used_has_version": (_used_without_version, {"used_has_version"}),
    "status_known": (_unknown_status, {"status_known"}),
    "trained_once": (_trained_twice, {"trained_once", "group_one_step", "group_complete"}),
    "group_one_step": (_group_split, {"group_one_step"}),
    "group_complete": (_group_incomplete, {"group_complete"}),
    "step_samples": (_step_count_wrong, {"step_samples"}),
    "trained_has_step": (_trained_without_step, {"trained_has_step"}),
    "gen_version_loaded": (_version_never_loaded, {"gen_version_loaded"}),
}


def test_every_check_has_a_breaking_case() -> None:
    # msg_id_unique is a UNIQUE constraint on both backends: no ledger can be built that breaks it.
    assert set(BREAKS) | {"msg_id_unique"} == set(CHECKS)


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_violation_is_caught(ledger: Ledger, name: str) -> None:
    build(ledger)
    breaker, expected = BREAKS[name]
    breaker(ledger)
    res = verify(ledger, JOB)
    assert not res.ok
    assert {f.check for f in res.violations} == expected, res.violations
    assert {k for k, n in res.checks.items() if n} == expected
    finding = next(f for f in res.violations if f.check == name)
    assert finding.count >= 1 and finding.message and finding.examples


def test_running_job_in_progress_step_is_info(ledger: Ledger) -> None:
    build(ledger, state="running")
    _trained_without_step(ledger)  # the step at version 2 wrote its samples, not yet its row
    res = verify(ledger, JOB)
    assert res.ok, res.violations
    assert any(f.check == "trained_has_step" and f.level == "info" for f in res.info)
    assert any(f.check == "in_flight" and "running job" in f.message for f in res.info)


def test_unknown_job(ledger: Ledger) -> None:
    with pytest.raises(LookupError, match="no job 'nope'"):
        verify(ledger, "nope")


def test_cli_exit_codes_and_table(ledger_url: str, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps the table to the terminal width
    with Ledger(ledger_url) as led:
        build(led)
    assert main(["--url", ledger_url, "--job", JOB]) == 0
    out = capsys.readouterr().out
    assert "ledger OK" in out and "staleness" in out and JOB in out
    assert main(["--url", ledger_url]) == 0  # the newest job by default
    capsys.readouterr()
    with Ledger(ledger_url) as led:
        _step_count_wrong(led)
    assert main(["--url", ledger_url, "--job", JOB]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "step 2: 3 samples, 4 trained rows at v1" in out
    assert main(["--url", ledger_url, "--job", "nope"]) == 2


def test_cli_does_not_create_a_missing_sqlite_ledger(tmp_path) -> None:
    assert main(["--url", f"sqlite:///{tmp_path}/none/ledger.db"]) == 2
    assert not (tmp_path / "none").exists()


def test_verify_runs_no_sql_of_its_own() -> None:
    # Its queries are the ledger's (broker.ledger.audit); verify.py keeps findings and report.
    tree = ast.parse(Path(broker.verify.__file__).read_text())
    imports = {(n.module or "", a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {name for module, name in imports if module.startswith("sqlalchemy")} <= {"make_url"}
    assert not {module for module, _ in imports if module == "broker.ledger.models"}
