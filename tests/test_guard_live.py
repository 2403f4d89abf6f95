"""The collapse guard tripping in a live job (the session's standing fleet: services as processes,
real vLLM, real Redis).

A warm-started tiny model trained with a destructive learning rate (the demo's 1e-4 x 20) loses its
reward within a few steps. The guard must see the collapse, roll back to a checkpoint from before
it (not merely the newest one, which already holds a collapsed policy), halve the lr, record it in
the ledger and show it through the API, and the job must still finish with its ledger consistent
and replay bit for bit.
"""

from __future__ import annotations

import httpx
import pytest
from shared_fleet import Fleet  # tests/ is on sys.path

from broker.verify import verify
from trainer_svc import checkpoint
from trainer_svc.replay import replay, report

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LR, STEPS, EVERY = 2e-3, 20, 2


def test_destructive_lr_trips_the_guard_and_rolls_back_before_the_collapse(fleet: Fleet, demo_model):
    model = demo_model
    ckpts = fleet.tmp / "checkpoints"
    spec = {
        "name": "guard-live",
        "model_path": str(model),
        "mode": "async",
        "max_staleness": 1,
        "steps": STEPS,
        "group_size": 8,
        "prompts_per_step": 8,
        "eval_every": 0,
        "checkpoint_every": EVERY,
        "algorithm": {"lr": LR, "lr_schedule": "constant"},  # the destructive lr to the end
        "sampling": {"max_tokens": 8},
        # "initial": this test is about the roll-back, and a collapse this early has no checkpoint
        # before it (the default, lower_lr, would keep the collapsed policy and go on)
        "guard": {"reward_window": 3, "min_best_reward": 0.1, "max_trips": 8, "on_no_checkpoint": "initial"},
    }
    job_id = fleet.post(spec)
    job = fleet.wait(job_id, timeout=600)
    assert job["state"] == "finished", (job.get("error"), fleet.sup.tail("trainer"))
    changes = httpx.get(f"{fleet.api}/jobs/{job_id}/changes", timeout=30).json()
    ledger = fleet.ledger

    trips = [c["changes"] for c in changes if c["actor"] == "trainer collapse guard"]
    rewards = [round(s["metrics"]["reward/mean"], 3) for s in ledger.train_steps(job_id)]
    assert trips, f"no guard trip in {STEPS} steps at lr {LR}; rewards per step {rewards}"
    for i, t in enumerate(trips):
        # at this lr both signs show: the reward falls, and the policy moves so far in a step that
        # the importance weights of one-step-old samples blow up
        assert t["kind"] in ("reward_collapse", "is_blowup"), t
        assert t["lr"] == pytest.approx(LR * 0.5 ** (i + 1))  # halved on every trip
        back = t["rolled_back_to_step"]
        # a checkpoint: one every EVERY steps, or an earlier trip's redone step (checkpointed at once)
        assert (back % EVERY == 0 or back in {u["step"] for u in trips[:i]}) and back <= t["step"] - 1, t
        if t["kind"] == "reward_collapse":
            # back to a checkpoint from before the collapse, not the newest one, which the decaying
            # policy wrote (trainer_svc/guard.py trusted_step)
            assert back < t["step"] - 1, t
        assert t["discarded_steps"] == list(range(back + 1, t["step"])), t
        assert back == 0 or checkpoint.step_dir(ckpts, job_id, back).is_dir()
        # the redone step is checkpointed at once: a resume must not redo the discarded steps
        assert (checkpoint.step_dir(ckpts, job_id, t["step"]) / checkpoint.COMMIT).exists(), t
    assert job["last_metrics"]["guard/trips"] == len(trips)
    assert "collapse guard: " in fleet.log("trainer")
    steps = [s["step"] for s in ledger.train_steps(job_id)]
    assert steps == list(range(1, STEPS + 1))  # every step number once, the redone ones included
    result = verify(ledger, job_id)
    assert result.ok, [v.message for v in result.violations]
    # the job replays bit for bit (trainer_svc/replay.py): each tripped step's last try from the
    # checkpoint its roll-back restored, at the halved lr, as recorded
    last_back = {t["step"]: t["rolled_back_to_step"] for t in trips}  # a step's last trip restored last
    restored = {step: ledger.step_input(job_id, step) for step in last_back}
    assert {step: r and r["restored_from"] for step, r in restored.items()} == last_back
    replayed = report(job_id, list(replay(ledger, job_id)))
    assert replayed["bitwise"], replayed
    print(
        f"\nguard trips {[t['kind'] for t in trips]} at steps {[t['step'] for t in trips]} -> rolled back to "
        f"{[t['rolled_back_to_step'] for t in trips]}, lr {[t['lr'] for t in trips]}; rewards per step {rewards}"
    )
