"""Replay (trainer_svc/replay.py): a step's record round-trips exactly and refuses damaged bytes; a
job recorded the way the loop records it (initial model, steps, a checkpoint) replays bit for bit
from the start and from the checkpoint; a sign-flipped loss, a tampered batch, a damaged blob and
other software are each named at the step they first show. A real job's recording (the loop in
trainer_svc/train.py) is replayed in tests/test_replay_job.py."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from broker.ledger import Ledger
from broker.ledger.rows import StepInputIn, StepInputRow
from shared.jobspec import JobSpec
from trainer_svc import checkpoint
from trainer_svc import learner as learner_mod
from trainer_svc.algorithms import LossOutputs
from trainer_svc.batch import TrainBatch
from trainer_svc.learner import Learner
from trainer_svc.replay import (
    CannotReplay,
    RecordDamaged,
    Start,
    StepResult,
    Taken,
    capture_rng,
    decode,
    encode,
    identity_differences,
    replay,
    software_identity,
    step_input,
    weights_checksum,
)

JOB = "rp0000000001"
# step ROLLED_BACK is taken after a collapse-guard roll-back to the checkpoint at CHECKPOINT_AT
STEPS, CHECKPOINT_AT, ROLLED_BACK = 4, 2, 4


def _batch(vocab: int, seed: int) -> TrainBatch:
    """2 groups of 2 samples: prompts of 3 tokens, completions of 4, 2, 5, 3 tokens."""
    g = torch.Generator().manual_seed(seed)
    comp = [4, 2, 5, 3]
    n = sum(comp)
    return TrainBatch(
        prompt_tokens=torch.randint(4, vocab, (12,), generator=g),
        prompt_lens=torch.tensor([3, 3, 3, 3]),
        completion_tokens=torch.randint(4, vocab, (n,), generator=g),
        completion_lens=torch.tensor(comp),
        behaviour_logprobs=-torch.rand(n, generator=g) * 3,
        model_mask=torch.ones(n),
        rewards=torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
        temperatures=torch.tensor([1.0, 1.0, 0.7, 0.7]),
        top_ks=torch.tensor([0, 0, 20, 20]),  # 0: no top-k cut
        top_ps=torch.tensor([1.0, 1.0, 0.9, 0.9]),
        truncated=torch.tensor([False, True, False, False]),
        versions=torch.tensor([0, 0, 1, 1]),
        terms=torch.tensor([0.5], dtype=torch.float64),
        term_names=("correct",),
    )


def test_a_record_round_trips_every_field_and_dtype() -> None:
    batch, rng = _batch(50, 0), capture_rng("cpu")
    data, meta = encode(batch, rng)
    back, rng_back = decode(data, meta)
    assert back.term_names == ("correct",)
    for name, t in batch.tensors().items():
        got = back.tensors()[name]
        assert got.dtype == t.dtype and torch.equal(got, t), name
    assert torch.equal(rng_back["torch"], rng["torch"])
    # a batch without reward terms: an empty tensor survives too
    empty = TrainBatch(**{**batch.tensors(), "terms": torch.zeros(0, dtype=torch.float64)})
    assert decode(*encode(empty, rng))[0].terms.shape == (0,)


def test_damaged_bytes_are_refused_naming_why() -> None:
    data, meta = encode(_batch(50, 0), capture_rng("cpu"))
    raw = zlib.decompress(data)
    flipped = bytearray(raw)
    flipped[-3] ^= 0x40  # a bit of the last tensor: still decodes, but is not what was recorded
    with pytest.raises(RecordDamaged, match="digest"):
        decode(zlib.compress(bytes(flipped)), meta)
    with pytest.raises(RecordDamaged, match="decompress"):
        decode(data[: len(data) // 2], meta)
    with pytest.raises(RecordDamaged, match="bytes, recorded"):
        decode(zlib.compress(raw + b"x"), meta)
    with pytest.raises(RecordDamaged, match="format"):
        decode(data, {**meta, "format": 99})


def test_identity_differences_name_each_key() -> None:
    here = software_identity("cpu")
    assert identity_differences(here, here) == []
    assert here["threads"] == torch.get_num_threads() and here["device"] == "cpu"
    diffs = identity_differences({**here, "torch": "2.0.0"}, here)
    assert diffs == [f"torch: '2.0.0' recorded, {here['torch']!r} here"]


# --- a job recorded as the loop records it --------------------------------------------------------


@dataclass
class Recorded:
    ledger: Ledger
    spec: JobSpec
    checksums: list[str]  # after step 0 (initial), 1, 2, ...


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    """STEPS steps of the tiny model recorded like trainer_svc/train.py does (the RNG state before
    the step, the lr, the batch, the checksum after, the metrics), version 0 published, a
    checkpoint after step CHECKPOINT_AT, and step ROLLED_BACK's last try taken from that checkpoint
    (as a guard trip's roll-back restores it: Parts.roll_back)."""
    from asyncrl.tiny_model import build_tiny_model

    tmp = tmp_path_factory.mktemp("replay")
    model = build_tiny_model(tmp / "tiny", layers=1, hidden=32, heads=2, intermediate=64, seed=0)
    spec = JobSpec(model_path=str(model), group_size=2, prompts_per_step=2, seed=3, sampling={"max_tokens": 5})
    ledger = Ledger(f"sqlite:///{tmp / 'ledger.db'}")
    ledger.create_job(JOB, "replay", spec.model_dump(mode="json"), state="finished")
    torch.manual_seed(spec.seed)
    learner = Learner(spec, "cpu")
    checksums = [weights_checksum(learner)]
    ledger.record_policy_version(JOB, 0, checksums[0], 1)
    for step in range(1, STEPS + 1):
        batch, lr = _batch(learner.vocab_size, step), 1e-3 * step
        restored = None
        if step == ROLLED_BACK:
            learner.step(batch, lr=lr)  # the try the guard rejects
            learner.restore(checkpoint.step_dir(tmp / "ckpt", JOB, CHECKPOINT_AT))
            restored, lr = CHECKPOINT_AT, lr / 2
        rng = capture_rng("cpu")
        metrics = learner.step(batch, lr=lr)
        checksums.append(weights_checksum(learner))
        taken = Taken(metrics, step == ROLLED_BACK, lr, rng, restored)
        ledger.record_step_input(step_input(JOB, step, step, batch, taken, checksums[-1], software_identity("cpu")))
        ledger.record_train_step(JOB, step, step, {**metrics, "time/step_s": 0.1})
        if step == CHECKPOINT_AT:
            path = checkpoint.step_dir(tmp / "ckpt", JOB, step)
            checkpoint.save(
                path, learner.model, learner.tokenizer, learner.optimizer, {"step": step, "policy_version": step}
            )
            ledger.record_checkpoint(JOB, step, step, str(path))
    yield Recorded(ledger, spec, checksums)
    ledger.close()


def _run(ledger: Ledger, **kw: Any) -> tuple[Start, list[StepResult]]:
    out = list(replay(ledger, JOB, **kw))
    start, steps = out[0], out[1:]
    assert isinstance(start, Start) and all(isinstance(s, StepResult) for s in steps)
    return start, steps  # type: ignore[return-value]


def flip_the_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner's policy loss with its sign flipped, in this process only."""
    real = learner_mod.policy_loss

    def flipped(*args: Any, **kwargs: Any) -> LossOutputs:
        out = real(*args, **kwargs)
        return replace(out, loss=-out.loss)

    monkeypatch.setattr(learner_mod, "policy_loss", flipped)


def _in(row: StepInputRow) -> StepInputIn:
    """A row as read, as `record_step_input` takes it."""
    return cast(StepInputIn, {k: v for k, v in row.items() if k != "created_at"})


def test_a_recorded_job_replays_bit_for_bit(recorded: Recorded) -> None:
    start, steps = _run(recorded.ledger)
    assert (start.step, start.source, start.same, start.not_comparable) == (0, "the initial model", True, [])
    assert [(s.step, s.same, s.got) for s in steps] == [(i, True, recorded.checksums[i]) for i in range(1, STEPS + 1)]
    assert steps[ROLLED_BACK - 1].restored_from == CHECKPOINT_AT
    # the checksums moved: every step changed the weights
    assert len(set(recorded.checksums)) == STEPS + 1
    _, upto = _run(recorded.ledger, to_step=2)
    assert [s.step for s in upto] == [1, 2]


def test_a_replay_from_a_later_step_starts_at_the_checkpoint_before_it(recorded: Recorded) -> None:
    start, steps = _run(recorded.ledger, from_step=3)
    assert start.step == CHECKPOINT_AT and start.path is not None and start.same
    assert start.checksum == recorded.checksums[CHECKPOINT_AT]
    assert [(s.step, s.same) for s in steps] == [(3, True), (4, True)]


def test_a_sign_flipped_loss_differs_at_the_first_step(recorded: Recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    flip_the_loss(monkeypatch)
    start, steps = _run(recorded.ledger)
    assert start.same  # the weights it starts from are the recorded ones
    assert [s.step for s in steps] == [1] and not steps[0].same  # stops at the first difference
    assert steps[0].differs[0].startswith("weights checksum")


def test_a_tampered_batch_and_damaged_bytes_are_named_at_their_step(recorded: Recorded) -> None:
    ledger = recorded.ledger
    row = ledger.step_input(JOB, 2)
    assert row is not None
    try:
        batch, rng = decode(row["data"], row["meta"])
        # a consistent forgery (digest recomputed): one reward swapped
        forged, meta = encode(batch.with_rewards(torch.tensor([[0.0, 1.0], [0.0, 1.0]])), rng)
        ledger.record_step_input({**_in(row), "data": forged, "meta": meta})
        _, steps = _run(ledger)
        assert [(s.step, s.same) for s in steps] == [(1, True), (2, False)]
        assert steps[1].differs[0].startswith("weights checksum")
        # bytes damaged in the ledger: refused before any step is taken on them
        ledger.record_step_input({**_in(row), "data": row["data"][:-8] + b"\0" * 8})
        _, steps = _run(ledger)
        assert steps[-1].step == 2 and steps[-1].differs[0].startswith("recorded batch damaged")
    finally:
        ledger.record_step_input(_in(row))
    assert all(s.same for s in _run(ledger)[1])


def test_other_software_is_named_up_front(recorded: Recorded) -> None:
    ledger = recorded.ledger
    row = ledger.step_input(JOB, 1)
    assert row is not None
    try:
        ident = {**row["identity"], "torch": "1.0.0"}
        ledger.record_step_input({**_in(row), "identity": ident})
        start, steps = _run(ledger)
        assert start.not_comparable and start.not_comparable[0].startswith("torch: '1.0.0' recorded")
        assert steps[0].not_comparable == start.not_comparable and steps[1].not_comparable == []
    finally:
        ledger.record_step_input(_in(row))


def test_what_cannot_be_replayed_says_why(recorded: Recorded, tmp_path: Path) -> None:
    ledger = recorded.ledger
    with pytest.raises(CannotReplay, match="no job"):
        list(replay(ledger, "nosuchjob000"))
    off = recorded.spec.model_copy(update={"record_steps": False})
    ledger.create_job("rp0000000002", "off", off.model_dump(mode="json"), state="finished")
    with pytest.raises(CannotReplay, match="record_steps false"):
        list(replay(ledger, "rp0000000002"))
    with pytest.raises(CannotReplay, match="outside the recorded steps"):
        list(replay(ledger, JOB, from_step=STEPS + 1))


def test_the_command_prints_each_step_and_exits_1_naming_the_first_difference(
    recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from asyncrl.cli import app

    db = str(recorded.ledger.url.render_as_string(hide_password=False))
    ok = CliRunner().invoke(app, ["replay", JOB, "--db", db])
    assert ok.exit_code == 0, ok.output
    assert "comparable" in ok.output and "steps 1..4 replayed bit for bit" in ok.output
    as_json = CliRunner().invoke(app, ["replay", JOB, "--db", db, "--json", "--to-step", "2"])
    out = json.loads(as_json.stdout)
    assert (out["bitwise"], out["first_differing_step"], [s["step"] for s in out["steps"]]) == (True, None, [1, 2])

    flip_the_loss(monkeypatch)
    bad = CliRunner().invoke(app, ["replay", JOB, "--db", db, "--json"])
    assert bad.exit_code == 1
    out = json.loads(bad.stdout)
    assert (out["bitwise"], out["first_differing_step"]) == (False, 1)
    assert out["differs"][0].startswith("weights checksum")
    gone = CliRunner().invoke(app, ["replay", "nosuchjob000", "--db", db])
    assert gone.exit_code == 1 and "no job 'nosuchjob000'" in gone.output


def test_a_lora_job_with_dropout_replays_its_recorded_rng(recorded: Recorded, tmp_path: Path) -> None:
    """LoRA dropout draws from torch's RNG in every step: the step's recorded RNG state is what
    makes the replay bitwise (and the checksum is of the adapter's tensors, as published)."""
    spec = JobSpec.model_validate(
        {**recorded.spec.model_dump(mode="json"), "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.5}}
    )
    job = "rp0000000003"
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.create_job(job, "lora", spec.model_dump(mode="json"), state="finished")
    torch.manual_seed(spec.seed)
    learner = Learner(spec, "cpu")
    ledger.record_policy_version(job, 0, weights_checksum(learner), 1)
    for step in (1, 2):
        torch.randn(step * 7)  # the loop draws between steps (whatever else runs): the state moves on
        batch, rng = _batch(learner.vocab_size, step), capture_rng("cpu")
        metrics = learner.step(batch, lr=1e-2)
        taken = Taken(metrics, False, 1e-2, rng)
        ledger.record_step_input(
            step_input(job, step, step, batch, taken, weights_checksum(learner), software_identity("cpu"))
        )
        ledger.record_train_step(job, step, step, metrics)
    out = list(replay(ledger, job))
    assert [(e.step, e.same) for e in out] == [(0, True), (1, True), (2, True)]
    ledger.close()
