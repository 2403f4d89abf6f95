"""LoRA in the trainer (trainer_svc/lora.py): the merge math, which parameters train, checkpoints
(merged model + adapter), resume and roll-back, export, the spec and the wire field."""

from __future__ import annotations

import json
from pathlib import Path
from uuid import uuid4

import pytest
import torch
from pydantic import ValidationError

from shared.jobspec import JobSpec, LoraSpec
from shared.schema import LoraAdapter, PolicyAnnouncement, decode, encode
from trainer_svc import checkpoint, lora

P = "base_model.model."


def test_merged_state_by_hand():
    # W = [[1, 0], [0, 1]], A = [[1, 2]] (r=1, in=2), B = [[1], [-1]] (out=2); alpha 2, rank 1 -> scale 2.
    # B @ A = [[1, 2], [-1, -2]]; W + 2 B A = [[3, 4], [-2, -3]]. Untargeted tensors pass through, renamed.
    state = {
        f"{P}model.layers.0.q_proj.base_layer.weight": torch.eye(2),
        f"{P}model.layers.0.q_proj.lora_A.default.weight": torch.tensor([[1.0, 2.0]]),
        f"{P}model.layers.0.q_proj.lora_B.default.weight": torch.tensor([[1.0], [-1.0]]),
        f"{P}model.norm.weight": torch.tensor([5.0, 6.0]),
    }
    out = lora.merged_state(state, LoraSpec(rank=1, alpha=2.0, target_modules=["q_proj"]))
    assert set(out) == {"model.layers.0.q_proj.weight", "model.norm.weight"}
    assert torch.equal(out["model.layers.0.q_proj.weight"], torch.tensor([[3.0, 4.0], [-2.0, -3.0]]))
    assert torch.equal(out["model.norm.weight"], torch.tensor([5.0, 6.0]))


def test_saved_names():
    name = f"{P}model.layers.3.mlp.down_proj.lora_B.default.weight"
    assert lora.adapter_name(name) == f"{P}model.layers.3.mlp.down_proj.lora_B.weight"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0
    )


def _spec(model: Path, **lora_kw) -> JobSpec:
    return JobSpec(
        model_path=str(model),
        group_size=2,
        prompts_per_step=2,
        sampling={"max_tokens": 4},
        algorithm={"lr": 1e-2},
        lora={"rank": 4, "alpha": 8.0, **lora_kw},
    )


def _batch(vocab: int):
    from shared.schema import Rollout, Scored, pack_f32, pack_i32
    from trainer_svc.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        r = Rollout(
            job_id="j",
            msg_id=f"j/g{i // 2}/{i}",
            group_id=f"j/g{i // 2}",
            policy_version=0,
            policy_version_max=0,
            prompt_index=i // 2,
            sample_index=i % 2,
            group_size=2,
            generator_id="g",
            prompt_ids=pack_i32([1, 5, 6]),
            completion_ids=pack_i32(torch.randint(4, vocab, (4,), generator=g).tolist()),
            logprobs=pack_f32([-1.0] * 4),
            completion="",
            answer="0",
        )
        samples.append(
            Scored(job_id="j", msg_id=r.msg_id, group_id=r.group_id, policy_version=0, rollout=r, reward=float(i % 2))
        )
    return TrainBatch.of(samples, torch.tensor([s.reward for s in samples]).view(2, 2))


def test_lora_learner_trains_only_the_adapters_and_checkpoints_resume_restore(tmp_path, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer_svc.learner import Learner
    from trainer_svc.weights import probe

    spec = _spec(tiny_model, target_modules=["q_proj", "v_proj", "down_proj"])
    learner = Learner(spec, "cpu")
    base_before = {k: v.clone() for k, v in learner.model.state_dict().items() if ".lora_" not in k}
    trained = [n for n, _ in lora.trainable(learner.model)]
    assert trained and all(".lora_" in n for n in trained)
    assert sum(len(g["params"]) for g in learner.optimizer.param_groups) == len(trained)
    for _ in range(2):
        learner.step(_batch(learner.vocab_size))
    after = learner.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # the base is frozen
    assert any(after[n].abs().sum() > 0 for n in trained if ".lora_B." in n)  # B left zero: it moved

    adapter, (ids, lp) = learner.snapshot()
    assert set(adapter) == {lora.adapter_name(n) for n in trained}  # what is published: the adapter only

    ck = checkpoint.step_dir(tmp_path, "job", 2)
    weights, optim = learner.full_state()
    checkpoint.save(ck, learner.model, learner.tokenizer, optim, {"step": 2, "policy_version": 2}, model_state=weights)
    assert (ck / "config.json").exists() and (ck / lora.ADAPTER_DIR / "adapter_model.safetensors").exists()
    config = json.loads((ck / lora.ADAPTER_DIR / "adapter_config.json").read_text())
    assert (
        config["r"] == 4
        and config["lora_alpha"] == 8.0
        and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    )
    # the merged model and base + adapter (as PEFT loads it) are both the trained policy
    merged = probe(AutoModelForCausalLM.from_pretrained(ck))[1]
    assert merged == pytest.approx(lp, abs=1e-5)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), ck / lora.ADAPTER_DIR)
    assert probe(peft)[1] == pytest.approx(lp, abs=1e-6)

    # resume: base from the job's model, adapter and optimizer from the checkpoint; the next step agrees
    resumed = Learner(spec, "cpu", ck)
    resumed.restore(ck, weights=False)
    assert resumed.snapshot()[1][1] == pytest.approx(lp, abs=1e-7)
    batch = _batch(learner.vocab_size)
    assert resumed.step(batch)["loss"] == pytest.approx(learner.step(batch)["loss"], abs=1e-6)
    # roll back to the initial policy (B = 0: the job's model), then to the checkpoint
    resumed.restore(None)
    assert resumed.snapshot()[1][1] == pytest.approx(
        probe(AutoModelForCausalLM.from_pretrained(tiny_model))[1], abs=1e-6
    )
    resumed.restore(ck)
    assert resumed.snapshot()[1][1] == pytest.approx(lp, abs=1e-7)


def test_export_of_a_lora_checkpoint_has_merged_model_and_adapter(tmp_path, tiny_model):
    from broker.admin import export
    from broker.ledger import Ledger
    from shared.settings import AdminSettings
    from trainer_svc.learner import Learner

    spec = _spec(tiny_model)
    learner = Learner(spec, "cpu")
    learner.step(_batch(learner.vocab_size))
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    job_id = f"job{uuid4().hex[:8]}"
    ledger.create_job(job_id, "t", spec.model_dump(mode="json"))
    ck = checkpoint.step_dir(tmp_path / "ck", job_id, 1)
    weights, optim = learner.full_state()
    checkpoint.save(ck, learner.model, learner.tokenizer, optim, {"step": 1, "policy_version": 1}, model_state=weights)
    ledger.record_checkpoint(job_id, 1, 1, str(ck))
    settings = AdminSettings(database_url=str(ledger.url), export_dir=str(tmp_path / "exports"))
    dest = Path(export(ledger, settings, job_id, 1)["path"])
    files = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()}
    assert {
        "config.json",
        "model.safetensors",
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
    } <= files
    assert not any(f.startswith("trainer_state") for f in files)


def test_lora_spec_validation():
    spec = JobSpec(model_path="/m", lora={"rank": 16})
    assert spec.lora.alpha == 16.0 and "down_proj" in spec.lora.target_modules
    assert JobSpec(model_path="/m").lora is None  # full fine-tune by default
    for bad, where in (
        ({"rank": 0}, "rank"),
        ({"rank": 1024}, "rank"),
        ({"alpha": 0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": ["q_proj; rm"]}, "target_modules"),
        ({"ranks": 8}, "ranks"),
    ):
        with pytest.raises(ValidationError, match=where):
            JobSpec(model_path="/m", lora=bad)


def test_announcement_carries_the_adapter_description():
    from shared.transport import build_manifest

    manifest = build_manifest(3, [("w", [2], "float32", 8)], bytearray(8))
    adapter = LoraAdapter(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"])
    ann = PolicyAnnouncement(
        job_id="j",
        msg_id="j/v3",
        policy_version=3,
        manifest=manifest,
        transport="tcp",
        address="127.0.0.1:1",
        lora=adapter,
    )
    assert decode(encode(ann), PolicyAnnouncement).lora == adapter
    assert JobSpec(model_path="/m", lora={"rank": 8, "target_modules": ["q_proj", "v_proj"]}).lora.adapter() == adapter
