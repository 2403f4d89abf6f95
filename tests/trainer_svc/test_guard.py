"""Collapse guard: hand-computed trips (trainer_svc/guard.py) and the roll-back it triggers."""

import math
import random

import pytest
import torch

from shared.jobspec import GuardSpec
from trainer_svc import checkpoint
from trainer_svc.algorithms import (
    LOSSES,
    BatchNorm,
    LossConfig,
    LossInputs,
    finalize_metrics,
    policy_loss,
)
from trainer_svc.batch import TrainBatch
from trainer_svc.guard import (
    IS_SIGNALS,
    Recovery,
    batch_noise,
    check,
    is_blowup,
    non_finite,
    recovery,
    reward_collapse,
    reward_margin,
    step_noise,
    trusted_reward,
    trusted_step,
)

CFG = GuardSpec(max_is=10.0, min_ess=0.1, reward_window=2, reward_drop=0.5, min_best_reward=0.2)
# the live job's guard (tests/test_guard_live.py)
LIVE = GuardSpec(reward_window=3, min_best_reward=0.1, max_trips=8)


def test_non_finite_loss_or_grad_norm():
    assert non_finite({"loss": 0.3, "grad_norm": 1.0}) is None
    assert non_finite({"loss": math.nan, "grad_norm": 1.0}) == "loss is nan"
    assert non_finite({"loss": 0.3, "grad_norm": math.inf}) == "grad_norm is inf"


def test_importance_weight_blowup_reads_the_weights_the_loss_applies():
    # reinforce applies no weight: its raw ratios are the signal
    assert is_blowup({"is/max": 10.0, "is/ess": 0.1}, CFG, "reinforce") is None  # at the limits: fine
    assert "max 12" in is_blowup({"is/max": 12.0, "is/ess": 0.9}, CFG, "reinforce")
    assert "ESS 0.05" in is_blowup({"is/max": 2.0, "is/ess": 0.05}, CFG, "reinforce")
    # the losses that truncate or clip: their applied weights, whatever the raw ones say
    for loss in ("aipo", "ppo_clip", "gspo"):
        raw_wild = {"is/max": 148.0, "is/ess": 0.03}
        assert is_blowup({**raw_wild, "is/applied_max": 2.0, "is/applied_ess": 0.9}, CFG, loss) is None
        assert "applied importance-weight ESS 0.04" in is_blowup(
            {**raw_wild, "is/applied_max": 2.0, "is/applied_ess": 0.04}, CFG, loss
        )
        assert "applied importance weight max 12" in is_blowup(
            {"is/applied_max": 12.0, "is/applied_ess": 0.9}, CFG, loss
        )
        assert is_blowup(raw_wild, CFG, loss) is None  # a ledger from before the applied metrics
    with pytest.raises(ValueError, match="unknown loss 'dpo'; valid"):
        is_blowup({}, CFG, "dpo")


def test_every_loss_has_its_importance_weight_signals():
    assert set(IS_SIGNALS) == set(LOSSES)


def test_aipo_batch_with_a_raw_max_of_148_and_healthy_truncated_weights_does_not_trip():
    # the issue's healthy AIPO (rho 2) batch: 320 tokens on-policy but one with pi/mu = 148;
    # raw ESS 467^2 / (320 * (319 + 148^2)) = 0.0307 and max 148 tripped the old check; the
    # applied weights are 319 x 1 and min(148, 2) = 2: ESS 321^2 / (320 * 323) = 0.99691
    lp = torch.full((64, 5), -1.0)
    beh = lp.clone()
    beh[3, 1] -= math.log(148.0)
    mask = torch.ones(64, 5)
    norm = BatchNorm.from_lengths([5] * 64, 5)
    m = finalize_metrics(
        policy_loss(LossInputs(lp, beh, torch.ones(64), mask), LossConfig(rho=2.0), norm).metrics, norm
    )
    assert m["is/max"] == pytest.approx(148.0, rel=1e-5) and m["is/ess"] < GuardSpec().min_ess
    assert m["is/applied_ess"] == pytest.approx(0.99691, abs=1e-5)
    assert is_blowup(m, GuardSpec(), "aipo") is None
    assert is_blowup(m, GuardSpec(), "reinforce") is not None  # uncorrected, 148 x off for that token


def test_batch_and_step_noise():
    # reward/std 0.4 over 64 samples: 0.4 / 8 = 0.05
    assert batch_noise({"reward/std": 0.4, "samples": 64.0}) == pytest.approx(0.05)
    assert batch_noise({"reward/mean": 0.3}) == 0.0
    # diffs of [0.2, 0.4, 0.1, 0.1]: 0.2, 0.3, 0 -> median 0.2; / (sqrt 2 * 0.674490) = 0.209672
    assert step_noise([0.2, 0.4, 0.1, 0.1]) == pytest.approx(0.2 / (math.sqrt(2) * 0.6744898), rel=1e-6)
    assert step_noise([0.2, 0.4, 0.1, 0.1], floor=0.3) == 0.3
    # one big jump among steady steps leaves the estimate alone: diffs 0.01, 0.01, 0.3 -> 0.01
    assert step_noise([0.3, 0.31, 0.3, 0.0]) == pytest.approx(0.01 / (math.sqrt(2) * 0.6744898), rel=1e-4)
    assert step_noise([0.5]) == 0.0


def test_reward_margin_hand_computed():
    # one window of 4, noise 0.1, false alarm 0.02: Q^-1(0.02 / 2) = 2.326348;
    # margin = 2 * 2.326348 * 0.1 / sqrt 4 = 0.2326348
    assert reward_margin(1, 4, 0.1, 0.02) == pytest.approx(0.2326348, rel=1e-6)
    # 150 windows of 5 at 0.001 (the issue's run, s = 0.0446 / sqrt 5 = 0.02): Q^-1(3.33e-6) = 4.5,
    # margin 9.0 s = 0.18 > the 0.113 between its best (0.219) and now (0.106)
    assert reward_margin(150, 5, 0.0446, 0.001) == pytest.approx(2 * 4.50 * 0.0446 / math.sqrt(5), rel=2e-3)
    assert reward_margin(150, 5, 0.0446, 0.001) > 0.219 - 0.106
    assert reward_margin(1000, 5, 0.1, 0.001) > reward_margin(10, 5, 0.1, 0.001)  # grows with the run


def test_reward_collapse_against_the_best_window_and_the_noise():
    cfg = CFG.model_copy(update={"reward_false_alarm": 0.02})
    # window 2: means of [0.6, 0.6, 0.6, 0.6, 0.2, 0.1] are 0.6, 0.6, 0.6, 0.4, 0.15; best 0.6,
    # now 0.15 < 0.5 * 0.6 = 0.3. Diffs 0, 0, 0, 0.4, 0.1: median 0, a noiseless series: trips
    collapse = [0.6, 0.6, 0.6, 0.6, 0.2, 0.1]
    assert "0.150 < 0.5 x best 0.600, 0.450 below it (noise margin 0.000)" in reward_collapse(collapse, cfg)
    # batch noise 0.1 per step; 6 reference levels (the opening step and 5 windows): margin
    # 2 * Q^-1(0.02 / (2 * 6)) * 0.1 / sqrt 2 = 2 * 2.935199 * 0.070711 = 0.415100 < 0.45: trips;
    # at 0.12 per step the margin is 0.498120 > 0.45: noise
    assert "noise margin 0.415" in reward_collapse(collapse, cfg, floor=0.1)
    assert reward_collapse(collapse, cfg, floor=0.12) is None
    # now 0.4 (0.5, 0.3) >= 0.5 x best 0.7: no trip however quiet the series
    assert reward_collapse([0.6, 0.8, 0.5, 0.3], cfg) is None
    # best 0.15 never reached min_best_reward 0.2: nothing to lose, no trip
    assert reward_collapse([0.2, 0.1, 0.0, 0.0], cfg) is None
    assert reward_collapse([0.9], cfg) is None  # no full window yet


def _batches(seed: int, steps: int, p: float, prompts: int = 8, group: int = 8, spread: float = 0.0):
    """Per-step (reward/mean, metrics) of Bernoulli rewards: `prompts` x `group` samples, each
    prompt's success rate drawn from Beta with mean p and concentration 1/spread - 1 (spread 0:
    every prompt at p)."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        rewards = []
        for _ in range(prompts):
            q = p if spread == 0 else rng.betavariate(p * (1 / spread - 1), (1 - p) * (1 / spread - 1))
            rewards += [float(rng.random() < q) for _ in range(group)]
        n = len(rewards)
        mean = sum(rewards) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
        out.append(
            (
                mean,
                {
                    "loss": 0.1,
                    "grad_norm": 1.0,
                    "reward/mean": mean,
                    "reward/std": std,
                    "samples": float(n),
                    "is/applied_ess": 0.95,
                    "is/applied_max": 2.0,
                },
            )
        )
    return out


def _first_trip(batches, cfg, loss="aipo"):
    series = []
    for step, (r, m) in enumerate(batches, start=1):
        series.append(r)
        if (trip := check(m, series, cfg, loss)) is not None:
            return step, trip
    return None


def test_the_issues_noisy_healthy_series_does_not_trip():
    # 64-sample batches at p ~ 0.15 for 150 steps: a 5-step mean has a standard error of ~0.02,
    # and the best of ~150 windows sits ~2.5 of them above the level; the bare relative drop
    # (now < 0.5 x best >= 0.2) fires on some seeds, the noise margin on none
    cfg = GuardSpec()
    old_rule = 0
    for seed in range(12):
        for spread in (0.0, 1 / 3):  # every prompt alike; prompts of differing difficulty
            batches = _batches(seed, 150, 0.15, spread=spread)
            assert _first_trip(batches, cfg) is None, (seed, spread, _first_trip(batches, cfg))
            means = [sum(r for r, _ in batches[i : i + 5]) / 5 for i in range(146)]
            old_rule += any(m < 0.5 * max(means[: i + 1]) and max(means[: i + 1]) >= 0.2 for i, m in enumerate(means))
    assert old_rule >= 3  # the seeds do hold the series the issue saw trip


def test_the_live_collapse_trips():
    # the live job at lr 20x (tests/test_guard_live.py): 0.27, 0.34, then nothing. Window 3 means
    # 0.2033, 0.1133, 0; the opening levels 0.27 (step 1) and 0.305 (steps 1-2). At step 4 the
    # window (0.34, 0, 0) still holds a step above every line. At step 5, now 0; the diffs 0.07,
    # 0.34, 0, 0 give noise 0.035 / 0.953873 = 0.036693; over 5 levels z = Q^-1(0.001 / 10) =
    # 3.719016. The opening 0.305 (2 steps): margin 3.719016 * 0.036693 * (1/sqrt 2 + 1/sqrt 3)
    # = 0.175277, 0.130 to spare; the best window 0.2033: margin 0.157582, 0.046 to spare
    collapsed = {"loss": 0.0, "grad_norm": 0.0, "reward/std": 0.0, "samples": 64.0}
    assert check(collapsed, [0.27, 0.34, 0.0, 0.0], LIVE, "aipo") is None
    kind, reason = check(collapsed, [0.27, 0.34, 0.0, 0.0, 0.0], LIVE, "aipo")
    assert kind == "reward_collapse" and "the first 2 step(s)' 0.305" in reason and "noise margin 0.175" in reason
    # the bench's live job with the guard's defaults (results/own_task.md): 0.359, 0.203, then ~0.
    # No window of 5 ever reached min_best_reward 0.2 (the first is 0.112): only the opening level
    # (step 1, 0.359) catches it, once every step of the window is below 0.5 x 0.359 = 0.1795: at
    # step 6 the window still holds 0.203; at step 7 it is 0, 0, 0, 0, 0.016 (mean 0.0032), the
    # diffs 0.156, 0.203, 0, 0, 0, 0.016 give noise 0.008 / 0.953873 = 0.008387, and over 3
    # windows + 4 openings z = Q^-1(0.001 / 14) = 3.80; margin 3.80 * 0.008387 * (1 + 1/sqrt 5)
    # = 0.0461 < 0.356: trips
    default_live = [0.359, 0.203, 0.0, 0.0, 0.0, 0.0, 0.016]
    assert check(collapsed, default_live[:6], GuardSpec(), "aipo") is None
    kind, reason = check(collapsed, default_live, GuardSpec(), "aipo")
    assert kind == "reward_collapse" and "the first 1 step(s)' 0.359" in reason and "margin 0.046" in reason, reason
    # a run healthy at ~0.3 for 30 steps that falls to 0 trips within a window of the fall; with
    # prompts of differing difficulty (intra-group correlation 1/3: twice the step noise) the
    # margin is twice as wide, and the fall shows once the zeros have pulled the noise estimate
    # down (3-17 steps here)
    for seed in range(6):
        for spread, within in ((0.0, None), (1 / 3, 20)):
            healthy = _batches(100 + seed, 30, 0.3, spread=spread)
            for cfg in (GuardSpec(), LIVE):
                first = _first_trip(healthy + [(0.0, collapsed)] * 40, cfg)
                assert first is not None and first[1][0] == "reward_collapse", (seed, spread, cfg)
                assert 30 < first[0] <= 30 + (within or cfg.reward_window + 1), (seed, spread, first)


def test_trusted_step_is_before_the_collapse():
    # window 2 over steps 5..8: means 0.7 (steps 5, 6), 0.65, 0.3; in the best window the last
    # reward >= 0.7 is step 6's (0.8), which measured the policy trained at step 5: trust up to 5
    assert trusted_step("reward_collapse", [0.6, 0.8, 0.5, 0.1], [5, 6, 7, 8], CFG) == 5
    # a tie keeps the older window: means 0.5, 0.5, 0.3 over steps 1..4 -> window (1, 2), whose
    # last reward >= 0.5 is step 2's -> step 1
    assert trusted_step("reward_collapse", [0.5, 0.5, 0.5, 0.1], [1, 2, 3, 4], CFG) == 1
    # the fall inside the best window: window 3 over steps 1..5, means 0.2133, 0.104, 0.0 (the
    # diffs 0.016, 0.312, 0, 0: noise 0.008/0.953873 = 0.008387); the best window (0.2133) is
    # 0.2133 - margin above now, the opening 0.32 (steps 1-2) further: the fall is from 0.32,
    # which step 1 alone reached: trust up to step 0, the initial model
    w3 = CFG.model_copy(update={"reward_window": 3})
    assert trusted_step("reward_collapse", [0.328, 0.312, 0.0, 0.0, 0.0], [1, 2, 3, 4, 5], w3) == 0
    # a fall after a full window: means over steps 1..7 of [0.3, 0.32, 0.3, 0.31, 0.0, 0.0, 0.0]
    # are 0.3067, 0.31, 0.2033, 0.1033, 0.0; the best window (steps 2-4, 0.31) beats the openings
    # (0.3, 0.31 over 1-2 steps, wider margins); its last step >= 0.31 is step 4: trust step 3
    assert trusted_step("reward_collapse", [0.3, 0.32, 0.3, 0.31, 0.0, 0.0, 0.0], list(range(1, 8)), w3) == 3
    # the bad update of a non-finite loss or an IS blow-up is the current step's: no bound
    assert trusted_step("non_finite", [0.6, 0.8, 0.5, 0.1], [5, 6, 7, 8], CFG) is None
    assert trusted_step("is_blowup", [0.6, 0.8, 0.5, 0.1], [5, 6, 7, 8], CFG) is None


def test_trusted_reward_leaves_out_rolled_back_policies():
    # versions 3..5 were rolled back: of rewards 1, 0, 0, 1 (versions 2, 3, 5, 6) count 1 and 1
    assert trusted_reward([1.0, 0.0, 0.0, 1.0], [2, 3, 5, 6], [[3, 5]]) == 1.0
    assert trusted_reward([1.0, 0.0, 0.5], [2, 7, 8], [[3, 5], [7, 7]]) == pytest.approx(0.75)
    assert trusted_reward([0.0, 0.0], [4, 5], [[3, 5]]) is None  # nothing measured the trajectory
    assert trusted_reward([0.2, 0.4], [4, 5], []) == pytest.approx(0.3)


def test_no_checkpoint_is_the_jobs_policy_never_a_silent_restart():
    # a checkpoint the guard trusts: the newest one (at or before trusted_step's bound)
    assert recovery("is_blowup", [2, 4, 6], None, CFG) == Recovery(
        "checkpoint", 6, "rolled back to the checkpoint of step 6"
    )
    assert recovery("reward_collapse", [2, 4, 6], 5, CFG).step == 4
    # none: the default keeps the current policy (with the lr lowered by the caller)
    keep = recovery("reward_collapse", [2, 4, 6], 1, CFG)
    assert (keep.action, keep.step) == ("keep", None)
    assert "no checkpoint from before the collapse (the trusted policy is step 1's)" in keep.note
    assert recovery("is_blowup", [], None, CFG).action == "keep"
    assert "checkpoint_every" in recovery("is_blowup", [], None, CFG).note
    # a non-finite update has written non-finite weights: nothing to keep
    assert recovery("non_finite", [], None, CFG).action == "fail"
    assert recovery("non_finite", [3], None, CFG) == Recovery(
        "checkpoint", 3, "rolled back to the checkpoint of step 3"
    )
    initial = CFG.model_copy(update={"on_no_checkpoint": "initial"})
    assert recovery("non_finite", [], None, initial).action == "initial"
    assert recovery("reward_collapse", [4], 1, initial).step == 0
    fail = CFG.model_copy(update={"on_no_checkpoint": "fail"})
    assert recovery("reward_collapse", [], 1, fail).action == "fail"
    # a fall from the job's first steps trusts the initial model only: it is where the job goes
    # on from, said so, under the default; 'fail' still fails
    start = recovery("reward_collapse", [2, 4], 0, CFG)
    assert (start.action, start.step) == ("initial", 0) and "only policy trusted is the initial model" in start.note
    assert recovery("reward_collapse", [2, 4], 0, fail).action == "fail"
    assert recovery("reward_collapse", [2], 2, fail).action == "checkpoint"


def test_check_reports_the_first_kind():
    ok = {"loss": 0.1, "grad_norm": 1.0, "is/applied_max": 2.0, "is/applied_ess": 0.9}
    assert check(ok, [0.5, 0.5], CFG, "aipo") is None
    assert check({**ok, "loss": math.nan, "is/applied_max": 99.0}, [0.5], CFG, "aipo")[0] == "non_finite"
    assert check({**ok, "is/applied_max": 99.0}, [0.6, 0.6, 0.6, 0.1], CFG, "aipo")[0] == "is_blowup"
    assert check(ok, [0.6, 0.6, 0.6, 0.1, 0.1], CFG, "aipo")[0] == "reward_collapse"


def test_roll_back_restores_the_checkpoints_weights_and_optimizer(tmp_path):
    from asyncrl.tiny_model import build_tiny_model
    from bench.t_train import fake_batch
    from shared.jobspec import JobSpec
    from trainer_svc.learner import Learner
    from trainer_svc.sink import flatten_batch

    path = build_tiny_model(tmp_path / "m", layers=1, hidden=32, heads=2, intermediate=64, seed=0)
    spec = JobSpec(
        model_path=str(path), group_size=4, prompts_per_step=2, sampling={"max_tokens": 4}, algorithm={"lr": 1e-2}
    )
    learner = Learner(spec, "cpu")
    samples, rewards = flatten_batch(fake_batch(2, 4, 4, learner.model.config.vocab_size))
    learner.step(TrainBatch.of(samples, rewards))
    final = checkpoint.step_dir(tmp_path, "job", 1)
    checkpoint.save(final, learner.model, learner.tokenizer, learner.optimizer, {"step": 1, "policy_version": 1})
    good = {n: t.clone() for n, t in learner.model.state_dict().items()}
    good_avg = learner.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    learner.step(TrainBatch.of(samples, rewards))  # the "bad" step
    assert not torch.equal(learner.model.state_dict()["lm_head.weight"], good["lm_head.weight"])
    learner.restore(final)
    for n, t in learner.model.state_dict().items():
        assert torch.equal(t, good[n]), n
    assert torch.equal(learner.optimizer.state_dict()["state"][0]["exp_avg"], good_avg)
    assert checkpoint.step_of(final) == 1
    # without a checkpoint: the job's initial model and a fresh optimizer
    learner.restore(None)
    assert learner.optimizer.state_dict()["state"] == {}
    assert learner.step(TrainBatch.of(samples, rewards))["lr"] == pytest.approx(1e-2)  # and it trains on from there
