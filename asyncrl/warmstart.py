"""Supervised warm start of the tiny model before RL.

Teacher forcing on ``prompt + answer + EOS``, loss on the answer and EOS tokens only, from a
deliberately imperfect teacher: with probability ``off_by_one`` an integer target is replaced by
``answer + 1``. The result knows the arithmetic but prefers the wrong neighbour: low greedy
accuracy, high pass@8 at temperature 1.0. That is the regime where GRPO has signal (most groups
of 8 samples mix right and wrong, so group-relative advantages are non-zero) and where the
verifier's exact-match reward can fix something supervised learning taught wrong.

Why not simply stop an exact teacher early: measured on the tiny model, an early-stopped warm
start has pass@8 of only about 0.5-0.6 at greedy 0.1-0.3, and GRPO then plateaus near that
pass@8 (held-out greedy about 0.4-0.5 after 300 steps); it sharpens what the policy can already
sample rather than teaching new answers.

    python -m asyncrl.warmstart --model /tmp/tiny --out /tmp/tiny-warm [--task arithmetic \
        --seed 0 --steps 1000 --lr 1e-3 --off-by-one 0.7]
    python -m asyncrl.warmstart --model /tmp/tiny --out /tmp/tiny-warm \
        --task-spec '{"datasets": [{"path": "my.jsonl"}], "prompt_field": "q", "answer_field": "a"}'

(`--task-spec`: a job spec's `task` section, as JSON or @file, for a user's own data.)

Prints and returns held-out greedy accuracy and pass@8 at temperature 1.0 (HF ``generate``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from shared.datasets import TaskSpec, load_task
from shared.prompts import renderer
from shared.tasks import Problem, extract_answer
from trainer_svc.logprobs import pad_batch, token_logprobs

# Tuned together with shared.tasks' arithmetic defaults (a+b with a, b <= 19) and the default
# 2-layer, 128-wide tiny model. Measured (seeds 0, 1, 2): held-out greedy 0.20 / 0.11 / 0.13,
# pass@8 0.89 / 0.92 / 0.93, about 20 s on 2 cores. In-process GRPO from there (groups of 8,
# 16 prompts/step, Adam lr 3e-5..3e-4) passes 0.6 held-out greedy within 20 steps and holds
# about 0.9; Adam at lr 1e-3 wrecks this policy within a few RL steps.
DEFAULT_STEPS = 1000
DEFAULT_LR = 1e-3  # peak; cosine decay to 0 so the final checkpoint is not a noisy snapshot
DEFAULT_BATCH = 32
DEFAULT_OFF_BY_ONE = 0.7
DEFAULT_N_TRAIN = 300
DEFAULT_N_TEST = 100

_INT = re.compile(r"-?\d+")


def encode_prompts(tokenizer: PreTrainedTokenizerBase, problems: list[Problem]) -> list[list[int]]:
    """Prompt token ids as a job renders them (shared.prompts: the chat template when the tokenizer
    has one, else the text with BOS first), so the warm start teaches the prompts RL will feed."""
    render = renderer(tokenizer)
    return [render(p).ids for p in problems]


def encode_answers(tokenizer: PreTrainedTokenizerBase, answers: list[str]) -> list[list[int]]:
    """Target completion ids: each answer's characters then EOS."""
    eos = tokenizer.eos_token_id
    return [tokenizer.encode(a, add_special_tokens=False) + [eos] for a in answers]


def teacher_answer(answer: str, off_by_one: float, rng: random.Random) -> str:
    """The imperfect teacher: an integer answer becomes ``answer + 1`` with prob. off_by_one."""
    if _INT.fullmatch(answer) and rng.random() < off_by_one:
        return str(int(answer) + 1)
    return answer


@torch.no_grad()
def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: list[Problem],
    *,
    k: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    seed: int = 0,
) -> dict[str, float]:
    """Greedy accuracy and pass@k (k samples at ``temperature``, no top-k/top-p) on problems.

    A completion is correct when ``extract_answer`` of its text equals ``Problem.answer``.
    """
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generate from the last column
    try:
        batch = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    plen = batch["input_ids"].shape[1]
    common = dict(
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )

    def correct(out: torch.Tensor, reps: int) -> torch.Tensor:  # -> (N, reps) bool
        texts = tokenizer.batch_decode(out[:, plen:], skip_special_tokens=True)
        ok = [extract_answer(t) == problems[i // reps].answer for i, t in enumerate(texts)]
        return torch.tensor(ok).view(len(problems), reps)

    # a causal LM's (GenerationMixin's; PreTrainedModel does not declare it): the token ids, as
    # return_dict_in_generate is off
    generate = cast(Callable[..., torch.Tensor], model.generate)
    greedy = generate(**batch, do_sample=False, **common)
    torch.manual_seed(seed)
    sampled = generate(
        **batch,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        num_return_sequences=k,
        **common,
    )
    samples_ok = correct(sampled, k)
    return {
        "greedy_acc": correct(greedy, 1).float().mean().item(),
        f"pass_at_{k}": samples_ok.any(dim=1).float().mean().item(),
        "sample_acc": samples_ok.float().mean().item(),
    }


def warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    task: str = "arithmetic",
    n_train: int = DEFAULT_N_TRAIN,
    n_test: int = DEFAULT_N_TEST,
    path: str | None = None,
    test_path: str | None = None,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    batch_size: int = DEFAULT_BATCH,
    off_by_one: float = DEFAULT_OFF_BY_ONE,
    seed: int = 0,
    task_spec: TaskSpec | None = None,
) -> dict[str, float]:
    """Fine-tune ``model_dir`` on the task's train split; save model + tokenizer to ``out_dir``.

    Args:
        model_dir: HF directory (e.g. from ``asyncrl.tiny_model``).
        out_dir: created if missing.
        task, n_train, n_test, path, test_path: the task section (``shared.datasets.TaskSpec``).
        task_spec: a whole task section instead (a user's own datasets); the five above are
            then ignored.
        steps: optimizer steps (AdamW, no weight decay, cosine decay from ``lr`` to 0).
        lr: peak learning rate.
        batch_size: problems per step, drawn without replacement within a step.
        off_by_one: probability that an integer target is ``answer + 1``, redrawn every time a
            problem is used; 0 trains on the exact answers.
        seed: fixes data order, teacher noise and evaluation sampling (with the same torch build
            and thread count, the run is repeatable).

    Returns:
        ``{"greedy_acc", "pass_at_8", "sample_acc", "final_loss", "seconds"}``; accuracies on the
        held-out split.
    """
    if not 0.0 <= off_by_one <= 1.0:
        raise ValueError(f"off_by_one must be in [0, 1], got {off_by_one}")
    t0 = time.perf_counter()
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if task_spec is None:
        task_spec = TaskSpec.model_validate(
            {"name": task, "n_train": n_train, "n_test": n_test, "path": path, "test_path": test_path}
        )
    train, test = load_task(task_spec, seed)
    prompts = encode_prompts(tokenizer, train)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1.0 + math.cos(math.pi * i / max(steps, 1))))
    rng = random.Random(seed)
    model.train()
    loss = torch.zeros(())
    for _ in range(steps):
        idx = rng.sample(range(len(train)), min(batch_size, len(train)))
        targets = [teacher_answer(train[i].answer, off_by_one, rng) for i in idx]
        input_ids, attention_mask, mask = pad_batch(
            [prompts[i] for i in idx], encode_answers(tokenizer, targets), tokenizer.pad_token_id
        )
        logprobs = token_logprobs(model, input_ids, attention_mask)  # (B, L-1)
        loss = -(logprobs * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    metrics = evaluate(model, tokenizer, test, seed=seed)
    metrics["final_loss"] = loss.item()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    metrics["seconds"] = time.perf_counter() - t0
    return metrics


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path, help="HF directory to start from")
    p.add_argument("--out", required=True, type=Path, help="directory to write")
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--path", default=None, help="task data file (gsm8k)")
    p.add_argument("--test-path", default=None, help="held-out data file (gsm8k)")
    p.add_argument("--n-train", type=int, default=DEFAULT_N_TRAIN)
    p.add_argument("--n-test", type=int, default=DEFAULT_N_TEST)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    p.add_argument(
        "--off-by-one",
        type=float,
        default=DEFAULT_OFF_BY_ONE,
        help="probability that a training target is answer+1 (0: exact teacher)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--task-spec",
        default=None,
        help="a job spec's task section as JSON, or @file holding it (overrides --task/--path/--n-*)",
    )
    a = p.parse_args(argv)
    spec = None
    if a.task_spec is not None:
        text = Path(a.task_spec[1:]).read_text() if a.task_spec.startswith("@") else a.task_spec
        spec = TaskSpec.model_validate_json(text)
    metrics = warm_start(
        a.model,
        a.out,
        task=a.task,
        n_train=a.n_train,
        n_test=a.n_test,
        path=a.path,
        test_path=a.test_path,
        steps=a.steps,
        lr=a.lr,
        batch_size=a.batch_size,
        off_by_one=a.off_by_one,
        seed=a.seed,
        task_spec=spec,
    )
    print(json.dumps({k: round(v, 4) for k, v in metrics.items()}))


if __name__ == "__main__":
    main()
