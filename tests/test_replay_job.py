"""`asyncrl replay` on real jobs of the standing fleet (tests/shared_fleet.py: one generator, the
real vLLM CPU engine, a SQLite ledger): a sync and an async job, recorded by the trainer loop as it
trains, replay bit for bit from the initial model and from a checkpoint; a sign-flipped loss in
the replaying process and a tampered recorded batch are each named at the first step they change.
Two generators: `python -m bench replay` (results/correctness.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch
from shared_fleet import Fleet  # tests/ is on sys.path
from typer.testing import CliRunner

from asyncrl.cli import app
from broker.ledger.rows import StepInputIn
from trainer_svc.replay import decode, encode

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4


@pytest.fixture(scope="module")
def jobs(fleet: Fleet) -> dict[str, str]:
    """A sync and an async (k = 1) job of STEPS steps, checkpointed every 2, both finished. Their
    reward is the completion's first character, odd or even: the fleet's untrained model earns no
    reward on its task, and with equal rewards in every group the advantages, and so the policy
    gradient, are 0 (the weights would move by weight decay alone, whatever the batch). Not the
    completion's length: most completions run to max_tokens, so whole steps had equal rewards."""
    plugin = fleet.tmp / "parity_reward.py"
    plugin.write_text("def score(completion, answer):\n    return float(ord(completion[0]) % 2 if completion else 0)\n")
    reward = {"kind": "python", "function": f"{plugin}:score"}
    ids = {
        "sync": fleet.submit("replay-sync", steps=STEPS, mode="sync", checkpoint_every=2, reward=reward),
        "async": fleet.submit(
            "replay-async", steps=STEPS, mode="async", max_staleness=1, checkpoint_every=2, reward=reward
        ),
    }
    for job_id in ids.values():
        job = fleet.wait(job_id)
        assert job["state"] == "finished", job.get("error")
    return ids


def _replay(fleet: Fleet, job_id: str, *args: str, fresh: bool = False) -> tuple[int, dict[str, Any]]:
    """`asyncrl replay JOB --json ARGS`: in this process (a test may patch the learner), or with
    `fresh` as its own process, the way a user runs it. Bit for bit needs the latter where it also
    checks the software identity: once vLLM's CPU worker was imported into a process (other tests do)
    it makes torch.set_num_threads a no-op there, so replay cannot take the recorded thread count."""
    db = fleet.ledger.url.render_as_string(hide_password=False)
    argv = ["replay", job_id, "--db", db, "--json", *args]
    if fresh:
        cmd = [sys.executable, "-m", "asyncrl.cli", *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.stdout.strip(), proc.stderr[-3000:]
        return proc.returncode, json.loads(proc.stdout)
    res = CliRunner().invoke(app, argv)
    return res.exit_code, json.loads(res.stdout)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_real_job_replays_bit_for_bit(fleet: Fleet, jobs: dict[str, str], mode: str) -> None:
    job_id = jobs[mode]
    code, out = _replay(fleet, job_id, fresh=True)
    assert code == 0, out
    assert (out["bitwise"], out["not_comparable"], out["start"]["source"]) == (True, [], "the initial model")
    assert [s["step"] for s in out["steps"]] == list(range(1, STEPS + 1))
    # what was compared is what the trainer published for each version
    published = {v["version"]: v["checksum"] for v in fleet.ledger.policy_versions(job_id)}
    assert [s["got"] for s in out["steps"]] == [published[v] for v in range(1, STEPS + 1)]
    assert out["start"]["checksum"] == published[0]
    losses = [s["loss"] for s in out["steps"]]
    assert any(loss != 0.0 for loss in losses), losses  # a policy gradient: the batches mattered
    # from the checkpoint at step 2, with its optimizer state
    code, out = _replay(fleet, job_id, "--from-step", "3", fresh=True)
    assert code == 0, out
    assert out["start"]["step"] == 2 and [s["step"] for s in out["steps"]] == [3, 4]


def test_the_async_job_trained_on_samples_of_older_versions(fleet: Fleet, jobs: dict[str, str]) -> None:
    # what makes its replay an off-policy one: behaviour logprobs of an older policy, replayed as recorded
    stale = [s["staleness"] for s in fleet.ledger.samples(jobs["async"], status="trained")]
    assert stale and max(stale) >= 1, stale


def test_a_sign_flipped_loss_differs_at_its_first_gradient_step(
    fleet: Fleet, jobs: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer_svc import learner

    real = learner.policy_loss
    monkeypatch.setattr(learner, "policy_loss", lambda *a, **k: replace(o := real(*a, **k), loss=-o.loss))
    # the first step with a policy gradient (a step whose every group had equal rewards has none)
    first = min(r["step"] for r in fleet.ledger.train_steps(jobs["sync"]) if r["metrics"]["loss"] != 0.0)
    code, out = _replay(fleet, jobs["sync"])
    assert code == 1
    assert (out["bitwise"], out["first_differing_step"]) == (False, first)
    assert out["differs"][0].startswith("weights checksum")


def test_a_tampered_recorded_batch_is_named_at_its_step(fleet: Fleet, jobs: dict[str, str]) -> None:
    ledger, job_id = fleet.ledger, jobs["async"]
    row = ledger.step_input(job_id, 3)
    assert row is not None
    kept: StepInputIn = {k: v for k, v in row.items() if k != "created_at"}  # type: ignore[assignment]
    batch, rng = decode(row["data"], row["meta"])
    tokens = batch.completion_tokens.clone()
    tokens[0] = 4 + (int(tokens[0]) - 3) % 100  # another of the tiny model's 100 character ids (4..103)
    rewards = batch.rewards.clone()
    rewards[0] = torch.tensor([1.0, 0.0, 0.0, 0.0]) if rewards[0].tolist() != [1.0, 0.0, 0.0, 0.0] else 1 - rewards[0]
    try:
        # one completion token of one sample: its logprobs (is/mean) at least, its gradient if its advantage is not 0
        forged = replace(batch, completion_tokens=tokens)
        ledger.record_step_input({**kept, **dict(zip(("data", "meta"), encode(forged, rng), strict=True))})
        code, out = _replay(fleet, job_id)
        assert (code, out["first_differing_step"], [s["step"] for s in out["steps"]]) == (1, 3, [1, 2, 3])
        assert out["differs"], out
        # one group's rewards: its advantages, so the update
        forged = replace(batch, rewards=rewards)
        ledger.record_step_input({**kept, **dict(zip(("data", "meta"), encode(forged, rng), strict=True))})
        code, out = _replay(fleet, job_id)
        assert (code, out["first_differing_step"]) == (1, 3)
        assert out["differs"][0].startswith("weights checksum"), out
    finally:
        ledger.record_step_input(kept)
    assert _replay(fleet, job_id, "--to-step", "3")[0] == 0
