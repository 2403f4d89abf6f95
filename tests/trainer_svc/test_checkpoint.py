"""Checkpoint round trip and the pieces of exact resume (trainer_svc/checkpoint.py)."""

import json
import os
import random

import numpy as np
import pytest
import torch

from asyncrl.tiny_model import build_tokenizer
from broker.streams import GROUP_TRAINERS, SCORED, Consumer
from shared.ids import group_seq
from shared.jobspec import JobSpec
from shared.prompts import renderer
from shared.schema import EvalItem, Rollout, SamplingParams, Scored, pack_f32, pack_i32
from shared.tasks import Problem
from trainer_svc import checkpoint
from trainer_svc.batch import TrainBatch
from trainer_svc.feeder import Feeder

RENDER = renderer(build_tokenizer())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("m") / "tiny", layers=1, hidden=32, heads=2, intermediate=64, seed=0
    )


def _draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_round_trip_restores_weights_optimizer_rng_and_the_next_step(tiny, tmp_path, streams):
    from transformers import AutoModelForCausalLM

    from bench.t_train import fake_batch
    from trainer_svc.learner import Learner
    from trainer_svc.sink import flatten_batch

    spec = JobSpec(
        model_path=str(tiny),
        group_size=4,
        prompts_per_step=2,
        sampling={"max_tokens": 4},
        algorithm={"lr": 1e-3},
        task={"n_train": 8, "n_test": 2},
    )
    a = Learner(spec, "cpu")
    samples, rewards = flatten_batch(fake_batch(2, 4, 4, a.model.config.vocab_size))
    a.step(TrainBatch.of(samples, rewards))  # optimizer state exists (exp_avg, exp_avg_sq, step)
    feeder = Feeder(streams, spec, [Problem(i, f"{i}+1=", str(i + 1)) for i in range(8)], RENDER)
    feeder.top_up(1, spec.staleness_bound)  # cap 2 groups
    final = checkpoint.step_dir(tmp_path, "job1", 1)
    state = {
        "job_id": "job1",
        "step": 1,
        "policy_version": 1,
        "k": 1,
        "lr": 1e-3,
        "knobs": {},
        "adaptive": None,
        "run_id": "r0",
        "feeder": feeder.state(),
    }
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(5)
    stats = checkpoint.save(final, a.model, a.tokenizer, a.optimizer, state)
    expected = _draws()  # what the saved RNG states draw next

    # HF files at the top level, trainer state beside them, COMMIT last
    names = set(os.listdir(final))
    assert {"config.json", "model.safetensors", "COMMIT", checkpoint.STATE_DIR} <= names
    assert set(os.listdir(final / checkpoint.STATE_DIR)) == {"optimizer.pt", "rng.pt", "trainer.json"}
    assert json.loads((final / "COMMIT").read_text())["step"] == 1 and stats["bytes"] > 0
    assert AutoModelForCausalLM.from_pretrained(final).config.vocab_size == a.model.config.vocab_size

    torch.manual_seed(999)  # scramble every generator; the load must bring them back
    np.random.seed(999)
    random.seed(999)
    b = Learner(spec, "cpu", final)
    st = checkpoint.load_state(final, b.optimizer)
    assert _draws() == expected
    assert st["feeder"] == feeder.state() and st["run_id"] == "r0"
    for (na, pa), (nb, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for key in sa["state"][i]:
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)
    # the strongest check: the next step from the restored state is the same update, bit for bit
    a.step(TrainBatch.of(samples, rewards))
    b.step(TrainBatch.of(samples, rewards))
    for (na, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), na


def test_feeder_restore_continues_the_data_order_across_epochs(streams):
    spec = JobSpec(model_path="m", max_staleness=0, prompts_per_step=3, seed=11)
    problems = [Problem(i, f"{i}+1=", str(i + 1)) for i in range(5)]
    a = Feeder(streams, spec, problems, RENDER)
    first = [a._next_problem().index for _ in range(7)]  # one epoch and two into the next
    a.seq, a.in_flight, a.open_evals = 7, {"job1/r/g5", "job1/r/g6"}, {"job1/r/e0": [3, "held_out"]}
    b = Feeder(streams, spec, problems, RENDER)
    b.restore(json.loads(json.dumps(a.state())))  # through JSON, as the journal stores it
    assert b.state() == a.state()
    assert [b._next_problem().index for _ in range(9)] == [a._next_problem().index for _ in range(9)]
    assert sorted(first[:5]) == list(range(5))


def test_feeder_journals_after_every_publish(streams):
    spec = JobSpec(model_path="m", max_staleness=0, prompts_per_step=2, group_size=2)
    seen = []
    f = Feeder(streams, spec, [Problem(i, "p", "a") for i in range(4)], RENDER, "run1", journal=seen.append)
    f.top_up(0, spec.staleness_bound)
    f.top_up(0, spec.staleness_bound)  # full: nothing published, nothing journaled
    rnd = f.feed_eval(0, 4, "held_out", [EvalItem(prompt_index=0, prompt="p", answer="a")], 1, SamplingParams())
    assert [s["seq"] for s in seen] == [2, 2] and seen[0]["in_flight"] == ["job1/run1/g0", "job1/run1/g1"]
    assert seen[1]["open_evals"] == {rnd: [4, "held_out"]}


def test_replay_plan_groups_trained_rows_by_step_in_feed_order():
    # Checkpoint at version 2. Step 3 trained at trainer_version 2, step 4 at 3; rows come in any
    # order and once per sample. g10 sorts after g9 (numeric, not text, order).
    rows = [
        {"group_id": "j/b/g10", "trainer_version": 3},
        {"group_id": "j/a/g9", "trainer_version": 3},
        {"group_id": "j/a/g4", "trainer_version": 2},
        {"group_id": "j/a/g5", "trainer_version": 2},
        {"group_id": "j/a/g4", "trainer_version": 2},
        {"group_id": "j/a/g1", "trainer_version": 1},
    ]
    assert checkpoint.replay_plan(rows, 2) == {3: ["j/a/g4", "j/a/g5"], 4: ["j/a/g9", "j/b/g10"]}
    assert checkpoint.replay_plan(rows, 4) == {}
    with pytest.raises(ValueError, match="not contiguous"):
        checkpoint.replay_plan([{"group_id": "j/a/g9", "trainer_version": 3}], 1)
    assert group_seq("job/x/g123") == 123


def test_latest_ignores_and_removes_uncommitted_saves(tmp_path):
    job = tmp_path / "job1"

    def make(name: str, commit: bool, state: bool = True) -> None:
        d = job / name
        (d / checkpoint.STATE_DIR).mkdir(parents=True)
        if state:
            (d / checkpoint.STATE_DIR / "trainer.json").write_text("{}")
        if commit:
            (d / checkpoint.COMMIT).write_text(json.dumps({"step": int(name[5:11])}))

    make("step-000002", True)
    make("step-000004", True)
    make("step-000006", False)  # died before COMMIT
    make("step-000008.tmp-123", False)  # died mid-save
    make("step-000010", True, state=False)  # an HF-only directory (older format): not resumable
    assert checkpoint.latest(tmp_path, "job1") == job / "step-000004"
    assert sorted(p.name for p in job.iterdir()) == ["step-000002", "step-000004", "step-000010"]
    assert checkpoint.latest(tmp_path, "nojob") is None


def _scored(group: str, i: int) -> Scored:
    r = Rollout(
        job_id="job1",
        msg_id=f"{group}/{i}",
        group_id=group,
        policy_version=0,
        policy_version_max=0,
        prompt_index=0,
        sample_index=i,
        group_size=2,
        generator_id="g",
        prompt_ids=pack_i32([1]),
        completion_ids=pack_i32([5]),
        logprobs=pack_f32([-0.1]),
        completion="2",
        answer="2",
    )
    return Scored(job_id="job1", msg_id=r.msg_id, group_id=group, policy_version=0, rollout=r, reward=1.0)


def test_take_over_claims_a_dead_predecessors_entries_at_once(streams):
    streams.ensure_group(SCORED, GROUP_TRAINERS)
    streams.publish_many(SCORED, [_scored("job1/r/g0", i) for i in range(2)] + [_scored("job1/r/g1", 0)])
    dead = checkpoint.singleton_consumer(streams)
    assert len(dead.consume(Consumer(SCORED, GROUP_TRAINERS, "trainer-old", Scored), count=10, block_ms=None)) == 3
    streams.publish(SCORED, _scored("job1/r/g1", 1))  # arrived while the trainer was down
    # claim_idle_ms is 60 s by default: a plain consumer would not see the old entries for a minute
    got = checkpoint.take_over(streams, Consumer(SCORED, GROUP_TRAINERS, "trainer-new", Scored))
    assert sorted(d.message.msg_id for d in got) == ["job1/r/g0/0", "job1/r/g0/1", "job1/r/g1/0"]
    assert all(d.deliveries == 2 for d in got)
    new = checkpoint.singleton_consumer(streams).consume(
        Consumer(SCORED, GROUP_TRAINERS, "trainer-new", Scored), count=10, block_ms=None
    )
    assert [d.message.msg_id for d in new] == ["job1/r/g1/1"]


def test_plan_resume_from_the_ledger_checkpoint_and_journal(tmp_path):
    from broker.ledger import Ledger

    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    job = "job1"
    ledger.create_job(job, "t", {})
    g = [f"{job}/r/g{i}" for i in range(6)]
    ledger.record_generated(
        [
            {
                "msg_id": f"{gid}/{i}",
                "job_id": job,
                "group_id": gid,
                "sample_index": i,
                "prompt_index": n,
                "generator_id": "gen",
                "gen_version_min": 0,
                "num_prompt_tokens": 1,
                "num_completion_tokens": 1,
                "completion": "x",
            }
            for n, gid in enumerate(g)
            for i in range(2)
        ]
    )
    # steps 1 and 2 trained (versions 0 and 1); g6's predecessor dropped g4 at version 1
    ledger.record_used(
        [
            {"msg_id": f"{gid}/{i}", "status": "trained", "trainer_version": tv}
            for gid, tv in ((g[0], 0), (g[1], 0), (g[2], 1), (g[3], 1))
            for i in range(2)
        ]
    )
    ledger.record_used([{"msg_id": f"{g[4]}/{i}", "status": "dropped", "trainer_version": 1} for i in range(2)])
    ledger.record_train_step(job, 1, 1, {"lr": 1e-3})
    ledger.record_train_step(job, 2, 2, {"lr": 5e-4})
    ledger.record_eval(job, 0, 0, 0, 0.5, 2)
    # the checkpoint after step 1 (only its trainer.json and COMMIT matter here)
    d = checkpoint.step_dir(tmp_path, job, 1)
    (d / checkpoint.STATE_DIR).mkdir(parents=True)
    (d / checkpoint.STATE_DIR / "trainer.json").write_text(json.dumps({"step": 1, "policy_version": 1}))
    (d / checkpoint.COMMIT).write_text(json.dumps({"step": 1}))
    # the journal after the predecessor's last feed (before step 2 was trained)
    checkpoint.FeedJournal(tmp_path, job).write(
        {
            "seq": 6,
            "epochs": 1,
            "cursor": 6,
            "eval_rounds": 2,
            "temperature": 1.0,
            "top_p": 1.0,
            "in_flight": g[2:],
            "open_evals": {f"{job}/r/e0": 0, f"{job}/r/e1": 1},
        }
    )

    r = checkpoint.plan_resume(tmp_path, job, ledger)
    assert r is not None and r.checkpoint == d and (r.step, r.version) == (1, 1)
    assert r.replay == {2: [g[2], g[3]]} and r.replay_lr == {2: 5e-4}
    assert r.feeder["in_flight"] == [g[2], g[3], g[5]]  # g4 was dropped; g2, g3 are trained again
    # the step-0 round is recorded already (a bare step in an older journal: the default set)
    assert r.feeder["open_evals"] == {f"{job}/r/e1": [1, "held_out"]}
    assert r.eval_steps == {("held_out", 0), ("held_out", 1)}
    assert [c["step"] for c in ledger.checkpoints(job)] == [1]  # recorded if its save died before
    assert checkpoint.plan_resume(tmp_path, "other", ledger) is None
