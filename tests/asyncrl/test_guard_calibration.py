"""Guard calibration (asyncrl/guard_calibration.py) over a ledger of synthetic step metrics."""

import json
import math
import random

from asyncrl.guard_calibration import job_row, main, replay
from broker.ledger import Ledger
from shared.jobspec import GuardSpec


def _steps(seed: int, n: int, p: float, collapse_at: int | None = None) -> list[dict[str, float]]:
    """AIPO step metrics of 64-sample Bernoulli batches at success rate p (0 from collapse_at on),
    each with one token whose raw pi/mu is 148 (truncated at rho 2: applied weights healthy)."""
    rng = random.Random(seed)
    out = []
    for step in range(1, n + 1):
        q = 0.0 if collapse_at is not None and step >= collapse_at else p
        rewards = [float(rng.random() < q) for _ in range(64)]
        mean = sum(rewards) / 64
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 63)
        out.append(
            {
                "loss": 0.1,
                "grad_norm": 1.0,
                "reward/mean": mean,
                "reward/std": std,
                "samples": 64.0,
                "is/max": 148.0,
                "is/ess": 0.03,
                "is/applied_max": 2.0,
                "is/applied_ess": 0.997,
            }
        )
    return out


def _ledger(path) -> tuple[str, dict[str, list[dict[str, float]]]]:
    url = f"sqlite:///{path}"
    ledger = Ledger(url)
    jobs = {f"healthy-{s}": _steps(s, 150, 0.15) for s in range(4)}
    jobs["collapse"] = _steps(99, 40, 0.3, collapse_at=25)
    for i, (job_id, steps) in enumerate(jobs.items()):
        spec = {
            "name": job_id,
            "model_path": "/m",
            "mode": "sync" if i == 1 else "async",
            "max_staleness": 2,
            "seed": i,
            "task": {"name": "arithmetic"},
            "algorithm": {"loss": "aipo"},
        }
        ledger.create_job(job_id, job_id, spec)
        for step, metrics in enumerate(steps, start=1):
            ledger.record_train_step(job_id, step, step, metrics)
    ledger.close()
    return url, jobs


def test_replay_counts_no_false_trip_on_healthy_noise_and_trips_on_a_collapse():
    cfg = GuardSpec()
    for seed in range(4):
        assert replay(list(enumerate(_steps(seed, 150, 0.15), start=1)), cfg, "aipo") == []
    trips = replay(list(enumerate(_steps(99, 40, 0.3, collapse_at=25), start=1)), cfg, "aipo")
    assert trips and trips[0]["kind"] == "reward_collapse" and 25 < trips[0]["step"] <= 31
    # the raw weights alone (reinforce reads them) trip at every step
    assert len(replay(list(enumerate(_steps(0, 5, 0.15), start=1)), cfg, "reinforce")) == 5


def test_cli_writes_the_table_and_json(tmp_path, capsys):
    url, jobs = _ledger(tmp_path / "ledger.db")
    out, md = tmp_path / "results" / "guard_calibration.json", tmp_path / "results" / "guard_calibration.md"
    assert main(["--url", url, "--out", str(out), "--md", str(md)]) == 0
    result = json.loads(out.read_text())
    rows = {r["job_id"]: r for r in result["jobs"]}
    assert set(rows) == set(jobs)
    assert all(rows[f"healthy-{s}"]["n_trips"] == 0 for s in range(4))
    assert rows["collapse"]["n_trips"] >= 1 and rows["collapse"]["trips"][0]["kind"] == "reward_collapse"
    assert (rows["healthy-1"]["mode"], rows["healthy-1"]["k"], rows["healthy-0"]["k"]) == ("sync", "0", "2")
    assert rows["healthy-0"]["steps"] == 150 and rows["healthy-0"]["missing_metrics"] == []
    assert result["jobs_with_trips"] == 1 and result["guard"]["reward_window"] == 5
    table = capsys.readouterr().out
    assert table == md.read_text()
    assert "| collapse | arithmetic | async | 2 | 4 | aipo | 40 |" in table and "reward collapse" in table
    # one job, another GuardSpec
    assert main(["--url", url, "--job", "healthy-0", "--guard", '{"reward_false_alarm": 0.49}', "--out", str(out)]) == 0
    assert [r["job_id"] for r in json.loads(out.read_text())["jobs"]] == ["healthy-0"]


def test_a_row_reads_the_stored_spec_with_jobspec_s_defaults():
    """An older stored spec (a field since removed) still gives its row; what it leaves out is
    JobSpec's default (shared/jobspec.py stored_spec)."""
    job = {
        "id": "old",
        "spec": {
            "model_path": "/m",
            "adaptive_staleness": {"k_max": 3},
            "retired_knob": 1,
            "algorithm": {"loss": "gspo"},
        },
    }
    row = job_row("sqlite://", job, [], GuardSpec())
    assert (row["task"], row["mode"], row["k"], row["seed"], row["loss"]) == (
        "arithmetic",
        "async",
        "0-3 (adaptive)",
        0,
        "gspo",
    )
