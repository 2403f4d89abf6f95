"""Multi-turn episodes are trained on the ids vLLM sampled: the retokenization test.

An episode (shared/environments) is played against the vLLM engine the generator uses, with an
environment that answers every model turn, so the completion side interleaves model tokens and
environment tokens. The trainer then recomputes the logprobs of the whole sequence from the
episode's ids (never from its text) through `TrainBatch.micro_batch`, the path a training step
takes: on model tokens they must match vLLM's behaviour logprobs (mean |delta| <= 1e-3, fp32), and
environment tokens must carry no loss mask, no behaviour logprob and no importance weight.

vLLM starts engine processes and needs a ``__main__`` guard, so this file doubles as the script
the test runs in a subprocess: ``python tests/test_multiturn_logprobs.py MODEL_DIR OUT_JSON``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROMPTS = ["17+25=", "3+4=", "0+19=", "Hello, world! "]
EPISODES_PER_PROMPT = 4
TURNS = 3
TEMPERATURE = 1.0


class Answering:
    """An environment that answers each model turn with a line of its own, for TURNS turns."""

    def __init__(self) -> None:
        self.turns = 0

    def start(self, row):  # type: ignore[no-untyped-def]
        return row["prompt"]

    def step(self, turn):  # type: ignore[no-untyped-def]
        from shared.environments.base import StepResult

        self.turns += 1
        last = self.turns >= TURNS
        return StepResult(text="" if last else f"reply {self.turns}: go on", role="user", done=last)


def _episodes_with_engine(model_dir: str) -> list[dict]:
    """Play the episodes through generator_svc.engine.Engine, one model turn per generate call."""
    from transformers import AutoTokenizer

    from generator_svc.engine import Engine
    from shared.environments.episode import PlainCodec, run_episode
    from shared.environments.spec import EpisodeLimits
    from shared.schema import SamplingParams

    engine = Engine(model_dir, seed=0, dtype="float32", max_model_len=256, gpu_memory_utilization=0.2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    codec = PlainCodec(
        tokenize=lambda t: tok.encode(t, add_special_tokens=False),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        tokenize_prompt=lambda t: tok.encode(t),
    )
    seeds = iter(range(10_000))

    async def generate(context: list[int], room: int):  # type: ignore[no-untyped-def]
        # a turn ends at a digit or a lowercase letter (ids 4..39 of the tiny tokenizer, ~1/3 of the
        # vocabulary under a random model): "stop", never cut at max_tokens, so the episode goes on
        params = SamplingParams(
            temperature=TEMPERATURE, max_tokens=min(room, 40), seed=next(seeds), stop_token_ids=list(range(4, 40))
        )
        [[s]] = engine.generate([list(context)], [params], [1])
        return s.completion_ids, s.logprobs, s.finish_reason

    async def play() -> list:
        limits = EpisodeLimits(max_turns=TURNS, max_total_tokens=200)
        return [
            await run_episode(Answering(), {"prompt": p}, generate, codec, limits)
            for p in PROMPTS
            for _ in range(EPISODES_PER_PROMPT)
        ]

    episodes = asyncio.run(play())
    engine.close()
    return [
        {
            "prompt_ids": e.prompt_ids,
            "ids": e.ids,
            "mask": e.mask,
            "logprobs": e.logprobs,
            "turns": e.num_turns,
            "stop_reason": e.stop_reason,
        }
        for e in episodes
    ]


@pytest.mark.integration
@pytest.mark.slow
def test_multiturn_episode_logprobs_match_and_env_tokens_carry_nothing(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from asyncrl.tiny_model import build_tiny_model
    from shared.schema import Rollout, Scored, pack_f32, pack_i32
    from trainer_svc.algorithms import BatchNorm, LossConfig, LossInputs, policy_loss
    from trainer_svc.batch import TrainBatch
    from trainer_svc.logprobs import token_logprobs

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    out_json = tmp_path / "episodes.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(model_dir), str(out_json)],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    episodes = json.loads(out_json.read_text())
    assert len(episodes) == len(PROMPTS) * EPISODES_PER_PROMPT
    assert all(e["turns"] == TURNS and e["stop_reason"] == "done" for e in episodes), [
        (e["turns"], e["stop_reason"]) for e in episodes
    ]
    assert all(0 in e["mask"] and 1 in e["mask"] for e in episodes)  # both kinds of token in each

    # The episodes as the generator will publish them, and as the trainer batches them.
    samples = [
        Scored(
            job_id="j",
            msg_id=f"j/g{i}/0",
            group_id=f"j/g{i}",
            policy_version=0,
            reward=float(i % 2),
            rollout=Rollout(
                job_id="j",
                msg_id=f"j/g{i}/0",
                group_id=f"j/g{i}",
                policy_version=0,
                policy_version_max=0,
                prompt_index=0,
                sample_index=0,
                group_size=1,
                generator_id="g",
                prompt_ids=pack_i32(e["prompt_ids"]),
                completion_ids=pack_i32(e["ids"]),
                logprobs=pack_f32(e["logprobs"]),
                model_mask=bytes(e["mask"]),
                turns=e["turns"],
                completion="",
                answer="",
                temperature=TEMPERATURE,
            ),
        )
        for i, e in enumerate(episodes)
    ]
    batch = TrainBatch.of(samples, torch.tensor([[s.reward] for s in samples]))
    assert batch.model_token_counts() == [sum(e["mask"]) for e in episodes]
    ids, attn, behaviour, mask, temp = batch.micro_batch(0, len(batch), pad_id=0)
    env = torch.zeros_like(mask, dtype=torch.bool)  # environment tokens at their shifted positions
    for row, e in enumerate(episodes):
        p = len(e["prompt_ids"])
        env[row, p - 1 : p - 1 + len(e["ids"])] = torch.tensor(e["mask"]) == 0

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = token_logprobs(model, ids, attn, temp)
    on_model = mask.bool()
    diffs = (ours - behaviour)[on_model].abs()
    print(
        f"multi-turn logprob |vLLM - trainer| over {diffs.numel()} model tokens: "
        f"mean {diffs.mean().item():.3g} max {diffs.max().item():.3g}; {int(env.sum())} environment tokens"
    )
    assert diffs.numel() == sum(sum(e["mask"]) for e in episodes)
    assert diffs.mean().item() <= 1e-3 and diffs.max().item() <= 1e-2
    # environment tokens: no loss mask and no behaviour logprob ...
    assert int(env.sum()) > 0 and not bool((mask.bool() & env).any()) and bool((behaviour[env] == 0).all())

    # ... and no loss, gradient or importance weight: the loss with the environment tokens' logprobs
    # moved arbitrarily is the same loss, and their gradient is exactly zero.
    lp = ours.clone().requires_grad_(True)
    adv = torch.tensor([s.reward - 0.5 for s in samples])
    norm = BatchNorm.from_lengths(batch.model_token_counts(), max_len=64)
    cfg = LossConfig()
    out = policy_loss(LossInputs(lp, behaviour, adv, mask), cfg, norm)
    out.loss.backward()
    assert lp.grad is not None and bool((lp.grad[env] == 0).all()) and bool((lp.grad[on_model] != 0).any())
    moved = policy_loss(LossInputs(ours + 5.0 * env, behaviour, adv, mask), cfg, norm)
    assert torch.allclose(moved.loss, out.loss.detach())


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(_episodes_with_engine(sys.argv[1])))
