"""The trainer loop's parts: the staleness bound's one owner, the collapse guard object, the
tensor batch and the loop state's save/restore pair."""

import numpy as np
import pytest
import torch

from shared.jobspec import GuardSpec, JobSpec
from shared.schema import Rollout, Scored, pack_f32, pack_i32
from shared.staleness_bound import groups_in_flight, in_flight_samples, start_bound
from trainer_svc.batch import TrainBatch
from trainer_svc.guard import CollapseGuard
from trainer_svc.logprobs import pad_batch
from trainer_svc.staleness import StalenessBound


def _spec(**kw) -> JobSpec:
    return JobSpec(model_path="/nonexistent", **kw)


def test_start_bound_and_in_flight_budget():
    assert start_bound("sync", 3, None) == 0 and start_bound("sync", 3, 5) == 0
    assert start_bound("async", 3, None) == 3
    assert start_bound("async", 3, 5) == 5  # adaptive starts at its loosest
    assert groups_in_flight(2, 4) == 12  # (k + 1) * batch
    for spec in (_spec(), _spec(mode="sync"), _spec(max_staleness=3, adaptive_staleness={"k_min": 1, "k_max": 2})):
        assert (
            start_bound(
                spec.mode, spec.max_staleness, spec.adaptive_staleness.k_max if spec.adaptive_staleness else None
            )
            == spec.staleness_bound
        )
    # (1 + 1) * 2 groups of 2, plus an eval round of 2 problems
    assert in_flight_samples(1, 2, 2, 2) == 10
    assert in_flight_samples(0, 2, 2, 0) == 4  # sync: one step's groups


def test_staleness_bound_is_the_one_writer():
    b = StalenessBound(_spec(max_staleness=2))
    assert b.k == 2
    b.set_knob(5)
    assert b.k == 5
    b.tighten()
    assert b.k == 4
    b.after_step({"is/ess": 0.1})  # no adaptive policy: unchanged
    assert b.k == 4 and b.state() == {"k": 4, "adaptive": None}

    sync = StalenessBound(_spec(mode="sync", max_staleness=2))
    sync.set_knob(3)
    sync.tighten()
    assert sync.k == 0

    a = StalenessBound(_spec(adaptive_staleness={"k_min": 1, "k_max": 3, "patience": 1}))
    assert a.k == 3
    a.set_knob(9)  # clamped to the policy's range
    assert a.k == 3
    a.after_step({"is/ess": 0.5})  # drift: one tighter
    assert a.k == 2
    a.tighten()
    a.tighten()
    assert a.k == 1  # floored at k_min
    saved = a.state()
    assert saved == {"k": 1, "adaptive": {"k": 1, "calm": 0}}
    b2 = StalenessBound(_spec(adaptive_staleness={"k_min": 1, "k_max": 3, "patience": 1}))
    b2.restore(saved)
    assert b2.k == 1 and b2.state() == saved


def test_collapse_guard_trip_moves_the_trajectory_back():
    cfg = GuardSpec(reward_window=2, max_trips=2, on_no_checkpoint="lower_lr")
    g = CollapseGuard(cfg, "aipo")
    g.checkpointed(2)
    g.checkpointed(4)
    g.rewards = [[1, 0.5], [2, 0.5], [3, 0.5], [4, 0.5]]
    assert g.inspect({"loss": float("nan")}, [1.0, 0.0], [4, 4]) == ("non_finite", "loss is nan")
    assert g.measured == 0.5 and g.window == [0.5] * 5
    rb = g.trip("non_finite", "loss is nan", step=6, version=5)  # step 6 trained from version 5
    # non_finite: no trust bound, back to the newest checkpoint (4); steps 5..6 discarded = versions 5..5
    assert rb.redo and rb.back_to == 4 and rb.plan.action == "checkpoint"
    assert g.discarded == [[5, 5]] and g.checkpoints == [2, 4] and [s for s, _ in g.rewards] == [1, 2, 3, 4]
    assert g.gone({4, 5}) == [5]
    # the retry of a rolled-back step trips only on garbage; a resume's re-done step never
    assert g.inspect({"loss": 1.0, "is/applied_max": 1e9}, [1.0], [5], retry=True) is None
    assert g.inspect({"loss": float("inf")}, [1.0], [4], redo=True) is None
    assert g.measured is not None
    g.stood(6)
    assert g.rewards[-1] == [6, 1.0]
    restored = CollapseGuard(cfg, "aipo")
    restored.restore(g.state())
    assert restored.state() == g.state()
    g.trip("non_finite", "x", 7, 6)
    with pytest.raises(RuntimeError, match="tripped 3 times"):
        g.trip("non_finite", "x", 7, 6)


def _scored(g: int, i: int, prompt: list[int], comp: list[int], temp: float = 1.0) -> Scored:
    r = Rollout(
        job_id="j",
        msg_id=f"j/g{g}/{i}",
        group_id=f"j/g{g}",
        policy_version=g,
        policy_version_max=g,
        prompt_index=g,
        sample_index=i,
        group_size=2,
        generator_id="x",
        prompt_ids=pack_i32(prompt),
        completion_ids=pack_i32(comp),
        logprobs=pack_f32(-np.arange(1, len(comp) + 1) / 10),
        completion="",
        answer="0",
        temperature=temp,
        finish_reason="length" if len(comp) == 3 else "stop",
    )
    return Scored(
        job_id="j",
        msg_id=r.msg_id,
        group_id=r.group_id,
        policy_version=g,
        rollout=r,
        reward=float(i),
        details={"a": float(i)} if i else {},
    )


def test_train_batch_micro_batches_pad_like_pad_batch():
    samples = [
        _scored(0, 0, [1, 5], [6, 7, 8]),
        _scored(0, 1, [1], []),
        _scored(1, 0, [1, 9, 9, 9], [4]),
        _scored(1, 1, [1, 4], [5, 6], temp=0.5),
    ]
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    batch = TrainBatch.of(samples, rewards)
    assert len(batch) == 4 and batch.completion_lens.tolist() == [3, 0, 1, 2]
    assert batch.truncated.tolist() == [True, False, False, False] and batch.versions.tolist() == [0, 0, 1, 1]
    assert batch.reward_terms() == {"reward/a": 1.0}
    for lo, hi in ((0, 4), (1, 3), (3, 4)):
        ids, attn, behaviour, mask, temp = batch.micro_batch(lo, hi, pad_id=0)
        part = samples[lo:hi]
        want_ids, want_attn, want_mask = pad_batch(
            [s.rollout.prompt_array().tolist() for s in part], [s.rollout.completion_array().tolist() for s in part], 0
        )
        assert torch.equal(ids, want_ids) and torch.equal(attn, want_attn) and torch.equal(mask, want_mask)
        for row, s in enumerate(part):
            assert torch.equal(behaviour[row, mask[row].bool()], torch.from_numpy(s.rollout.logprob_array().copy()))
        assert temp.tolist() == [s.rollout.temperature for s in part]
    again = TrainBatch.from_tensors(batch.tensors(), batch.term_names)
    assert all(torch.equal(a, b) for a, b in zip(again.tensors().values(), batch.tensors().values(), strict=True))


class _Feeder:  # the loop state only asks the feeder for its state
    def state(self) -> dict:
        return {"seq": 3, "in_flight": ["j/g2"]}


def test_loop_state_save_and_restore_are_a_pair():
    from trainer_svc.state import LoopState

    spec = _spec(adaptive_staleness={"k_min": 0, "k_max": 2})
    knobs = {"lr": 0.5}
    a = LoopState("run1", 1e-3, StalenessBound(spec), CollapseGuard(spec.guard, "aipo"), _Feeder(), knobs)
    a.step, a.version = 4, 4
    a.bound.tighten()
    a.guard.checkpointed(4)
    a.guard.rewards = [[4, 0.25]]
    saved = a.save()
    # the keys the checkpoint's trainer.json has always had (and the resume plan reads)
    assert set(saved) == {"step", "policy_version", "run_id", "k", "adaptive", "lr", "knobs", "feeder", "guard"}
    assert saved["k"] == 1 and saved["adaptive"] == {"k": 1, "calm": 0} and saved["feeder"]["seq"] == 3
    assert saved["guard"] == {"rewards": [[4, 0.25]], "trips": 0, "checkpoints": [4], "discarded": []}
    b = LoopState("run2", 1e-3, StalenessBound(spec), CollapseGuard(spec.guard, "aipo"), _Feeder(), {})
    assert b.restore(saved) == knobs
    assert {**b.save(), "run_id": "run1", "knobs": knobs} == saved  # a new process keeps its own run id


def test_a_resumed_loop_trains_every_step_at_the_uninterrupted_runs_lr():
    """The schedule's position is the step, which a checkpoint holds: after a resume every re-done
    and later step trains at the lr the uninterrupted run used, with a live lr set before the
    checkpoint and one set after it (the way Parts.take_over and apply_knobs put them)."""
    import json

    from trainer_svc.algorithms import LrSchedule
    from trainer_svc.state import LoopState

    spec = _spec(steps=8, algorithm={"lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1})
    knob_before = {3: 5e-4, 6: 2e-3}  # PATCH lr, applied before these steps

    def state() -> LoopState:
        return LoopState(
            "run",
            spec.algorithm.lr,
            StalenessBound(spec),
            CollapseGuard(spec.guard, "aipo"),
            _Feeder(),
            {},
            schedule=LrSchedule.from_spec(spec),
        )

    # the uninterrupted run, checkpointed after step 4; the ledger records each step's lr
    run, ledger_lr, saved = state(), {}, {}
    for t in range(1, 9):
        if t in knob_before:
            run.knobs["lr"] = run.lr = knob_before[t]
        ledger_lr[t] = run.step_lr(t)
        run.step = run.version = t
        if t == 4:
            saved = json.loads(json.dumps(run.save()))  # trainer.json
    # Hand-computed: W = 2, S = 8, min 0.1; after the warm-up p = (t - 2) / 6 and the factor is
    # 1 - 0.9 (1 - cos(pi p)) / 2: t=3..8: 0.939711, 0.775, 0.55, 0.325, 0.160289, 0.1; times the
    # live lr (1e-3, then 5e-4 from step 3, 2e-3 from step 6).
    assert list(ledger_lr.values()) == pytest.approx(
        [5e-4, 1e-3, 5e-4 * 0.939711, 5e-4 * 0.775, 5e-4 * 0.55, 2e-3 * 0.325, 2e-3 * 0.160289, 2e-4], rel=1e-5
    )

    # killed after step 6: a new process resumes from the checkpoint of step 4 and re-does 5 and 6
    resumed = state()
    resumed.step, resumed.version = 4, 4
    resumed.replay_lr = {5: ledger_lr[5], 6: ledger_lr[6]}  # checkpoint.plan_resume, from the ledger
    applied = resumed.restore(saved)
    control = {"lr": 2e-3}  # the control stream replayed from its start: the knobs set so far
    since = {k: v for k, v in control.items() if applied.get(k) != v}
    assert applied == {"lr": 5e-4} and since == {"lr": 2e-3}
    resumed.lr = since["lr"]  # apply_knobs
    assert {t: resumed.step_lr(t) for t in range(5, 9)} == {t: ledger_lr[t] for t in range(5, 9)}
    # the staleness scale multiplies a step's lr; a re-done step keeps the lr it was recorded with
    assert resumed.step_lr(7, 0.5) == pytest.approx(ledger_lr[7] / 2) and resumed.step_lr(5, 0.5) == ledger_lr[5]


def test_a_constant_schedule_trains_at_the_live_lr_exactly():
    from trainer_svc.state import LoopState

    spec = _spec(steps=5, algorithm={"lr": 3e-6})
    st = LoopState("run", 3e-6, StalenessBound(spec), CollapseGuard(spec.guard, "aipo"), _Feeder())
    st.lr = 7e-6  # a PATCH; the guard's lower lr likewise
    assert [st.step_lr(t, 0.5) for t in range(1, 6)] == [7e-6 * 0.5] * 5  # as before schedules: lr x staleness scale
