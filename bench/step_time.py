"""The trainer's step time as a ratio to a plain step of the same model on the same tokens, both
measured in one process, interleaved: what the trainer's loss, metrics and bookkeeping cost on top
of the forward, backward and optimizer step any trainer pays. A ratio, not a time: it holds on a
slow machine, a fast one and a loaded one alike (both halves slow down together), so CI can gate
on it (tests/trainer_svc/test_step_time.py).

    python -m bench step-time [--runs 10]    # the ratio's spread over runs; results/correctness.json

`Learner.step` on a fixed batch (one micro-batch) against `plain_step`: logits, token log-probs
(a log-softmax and a gather), a masked mean, backward, clip, AdamW step. Each measurement is the
median of `reps` repetitions of each, taken in turn (learner, plain, learner, ...) so that a burst
of load hits both.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.tiny_model import build_tiny_model
from bench.gates import update_correctness
from bench.t_train import fake_batch
from shared.jobspec import JobSpec
from trainer_svc.batch import TrainBatch
from trainer_svc.learner import Learner
from trainer_svc.sink import flatten_batch

# The batch of one gate measurement: the demo model (2 layers, 128 wide), 8 groups of 4 samples
# of 24 tokens each, one micro-batch. A step takes tens of ms here: long against the timer and
# the scheduler's tick, short enough for 20 repetitions of each in a couple of seconds.
PROMPTS, GROUP, TOKENS = 8, 4, 24


@dataclass(frozen=True)
class StepTimes:
    """Medians over the repetitions (s) and their ratio, learner / plain."""

    learner_s: float
    plain_s: float

    @property
    def ratio(self) -> float:
        return self.learner_s / self.plain_s


def gate_learner(model_dir: str | Path) -> tuple[Learner, TrainBatch]:
    """A Learner on `model_dir` with the demo job's algorithm, and a fixed batch of fabricated
    rollouts (`bench.t_train.fake_batch`) that fits one micro-batch."""
    spec = JobSpec.model_validate(
        {
            "model_path": str(model_dir),
            "group_size": GROUP,
            "prompts_per_step": PROMPTS,
            "sampling": {"max_tokens": TOKENS},
            "algorithm": {"lr": 1e-6, "micro_batch_size": PROMPTS * GROUP},
        }
    )
    learner = Learner(spec, "cpu")
    samples, rewards = flatten_batch(fake_batch(PROMPTS, GROUP, TOKENS, learner.vocab_size))
    return learner, TrainBatch.of(samples, rewards)


def plain_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor
) -> None:
    """The step every trainer pays: the mean log-prob of the masked tokens, backward, clip,
    optimizer step. ids, attn (B, L); mask (B, L-1) over the shifted targets."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()  # (B, L-1, V)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, L-1)
    loss = -(logprobs * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def step_times(learner: Learner, batch: TrainBatch, reps: int = 20) -> StepTimes:
    """Median seconds of `learner.step(batch)` and of `plain_step` on the same model and tokens,
    `reps` of each taken in turn after one warm-up of each."""
    ids, attn, _, mask, _ = batch.micro_batch(0, len(batch), learner.pad_id)
    # its own optimizer: the learner's state stays the learner's; lr 1e-6 keeps the weights near
    opt = torch.optim.AdamW(learner.model.parameters(), lr=1e-6)
    ours: list[float] = []
    plain: list[float] = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        learner.step(batch)
        t1 = time.perf_counter()
        plain_step(learner.model, opt, ids, attn, mask)
        t2 = time.perf_counter()
        if rep:  # the first of each warms up (allocator, lazy inits)
            ours.append(t1 - t0)
            plain.append(t2 - t1)
    return StepTimes(statistics.median(ours), statistics.median(plain))


def bench_step_time(runs: int = 10, out_dir: str = "results") -> dict[str, Any]:
    """`runs` gate measurements in one process (1 torch thread, as the test): the ratio's spread,
    written to results/correctness.json as `step_time_ratio_*`."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        learner, batch = gate_learner(build_tiny_model(Path(tmp) / "m", seed=0))
        times = [step_times(learner, batch) for _ in range(runs)]
    ratios = [t.ratio for t in times]
    load = Path("/proc/loadavg").read_text().split()[:3]
    res = {
        "step_time_ratio_median": statistics.median(ratios),
        "step_time_ratio_min": min(ratios),
        "step_time_ratio_max": max(ratios),
        "step_time_ratio_runs": len(ratios),
        "step_time_ratio_loadavg": " ".join(load),
        "learner_step_ms_median": 1e3 * statistics.median(t.learner_s for t in times),
        "plain_step_ms_median": 1e3 * statistics.median(t.plain_s for t in times),
    }
    update_correctness(Path(out_dir), {k: v for k, v in res.items() if k.startswith("step_time_ratio")})
    return res
