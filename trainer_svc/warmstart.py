"""Supervised warm start of the tiny model before RL.

Teacher forcing on ``prompt + answer + EOS`` with the loss on the answer and EOS tokens only,
for a deliberately small number of steps: the policy should learn the output format and be
right *sometimes*, low greedy accuracy but high pass@8, which is where GRPO's group-relative
advantages have signal (a group of all-wrong or all-right samples has zero advantage).

    python -m trainer_svc.warmstart --model /tmp/tiny --out /tmp/tiny-warm [--task arithmetic \
        --seed 0 --steps 150 --lr 3e-3]

Prints and returns held-out greedy accuracy and pass@8 at temperature 1.0 (HF ``generate``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from shared.tasks import Problem, extract_answer, load_task
from trainer_svc.logprobs import pad_batch, token_logprobs

# Measured on the defaults (tiny model 2x128, arithmetic a+b with a, b <= 19, seed 0): see the
# report in the PR; the figures are printed on every run.
DEFAULT_STEPS = 150
DEFAULT_LR = 3e-3
DEFAULT_BATCH = 32
DEFAULT_N_TRAIN = 300
DEFAULT_N_TEST = 100


def encode_prompts(tokenizer: PreTrainedTokenizerBase, problems: list[Problem]) -> list[list[int]]:
    """Prompt token ids, BOS first (the tokenizer adds it)."""
    return [tokenizer.encode(p.prompt) for p in problems]


def encode_answers(tokenizer: PreTrainedTokenizerBase, problems: list[Problem]) -> list[list[int]]:
    """Target completion ids: the answer's characters then EOS."""
    eos = tokenizer.eos_token_id
    return [tokenizer.encode(p.answer, add_special_tokens=False) + [eos] for p in problems]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
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

    greedy = model.generate(**batch, do_sample=False, **common)
    torch.manual_seed(seed)
    sampled = model.generate(
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
    seed: int = 0,
) -> dict[str, float]:
    """Fine-tune ``model_dir`` on the task's train split and save model + tokenizer to out_dir.

    Deterministic for a given seed (data order, sampling) on a given machine.

    Returns:
        ``{"greedy_acc", "pass_at_8", "sample_acc", "final_loss", "seconds"}``, accuracies on
        the held-out split.
    """
    t0 = time.perf_counter()
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train, test = load_task(
        task, seed=seed, n_train=n_train, n_test=n_test, path=path, test_path=test_path
    )
    prompts, answers = encode_prompts(tokenizer, train), encode_answers(tokenizer, train)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    loss = torch.zeros(())
    for _ in range(steps):
        idx = rng.sample(range(len(train)), min(batch_size, len(train)))
        input_ids, attention_mask, mask = pad_batch(
            [prompts[i] for i in idx], [answers[i] for i in idx], tokenizer.pad_token_id
        )
        logprobs = token_logprobs(model, input_ids, attention_mask)  # (B, L-1)
        loss = -(logprobs * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
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
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
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
        seed=a.seed,
    )
    print(json.dumps({k: round(v, 4) for k, v in metrics.items()}))


if __name__ == "__main__":
    main()
