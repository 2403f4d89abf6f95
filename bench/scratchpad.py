"""A generation-dominated task for the suite's regime (b): the model writes its working out.

The prompt is a chain of single-digit additions and subtractions (`"7+3-2+5="`); the completion
reduces it one operation per line, copying what is left (`"10-2+5\\n8+5\\n13"`), so a completion
of an 11-13 operation chain is about 130-200 characters: tokens, with the tiny model's character
tokenizer. The reward (a plug-in file outside the project, like bench.own_task's) checks only the
final line against the chain's value. The data file's answer column is the whole worked
solution, which is what the SFT warm start (asyncrl.warmstart --task-spec) teaches; the
reward reads the value off its last line.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

REWARD_FILE = '''"""Scratchpad reward: 1 when the completion's last non-empty line is the chain's value."""


def score(completion, answer, *, metadata, **kwargs):
    lines = [ln.strip() for ln in completion.strip().split("\\n") if ln.strip()]
    return 1.0 if lines and lines[-1] == answer.strip().split("\\n")[-1].strip() else 0.0
'''
N_TEST = 100
MAX_TOKENS = 224  # prompt (at most 29 characters + BOS) + 224 stays inside the model's 256 positions
OPS = (11, 13)  # operations per chain, inclusive: completions of about 130-200 tokens


def chain(rng: random.Random, n_ops: int) -> tuple[str, str]:
    """One problem: (prompt, worked solution). Values stay in 0..99 (an operation that would
    leave that range takes the other sign)."""
    value = rng.randint(1, 9)
    ops: list[tuple[str, int]] = []
    v = value
    for _ in range(n_ops):
        d = rng.randint(1, 9)
        op = rng.choice("+-")
        if (op == "+" and v + d > 99) or (op == "-" and v - d < 0):
            op = "-" if op == "+" else "+"
        v = v + d if op == "+" else v - d
        ops.append((op, d))
    prompt = f"{value}" + "".join(f"{o}{d}" for o, d in ops) + "="
    lines, v = [], value
    for i, (o, d) in enumerate(ops):
        v = v + d if o == "+" else v - d
        lines.append(f"{v}" + "".join(f"{o2}{d2}" for o2, d2 in ops[i + 1 :]))
    return prompt, "\n".join(lines)


def write_task(wd: Path, n: int = 2000, seed: int = 4321) -> tuple[Path, Path]:
    """The data file (columns question/solution/ops) and the reward file: (jsonl, reward.py)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(*OPS)
        q, sol = chain(rng, k)
        rows.append({"question": q, "solution": sol, "ops": k})
    data = wd / "user" / "scratchpad.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = wd / "user" / "scratchpad_reward.py"
    reward.write_text(REWARD_FILE)
    return data, reward


def task_section(data: Path) -> dict[str, Any]:
    return {"datasets": [{"path": str(data)}], "prompt_field": "question", "answer_field": "solution", "n_test": N_TEST}


WARM_BATCH = 8  # problems per SFT step: 200-token sequences make a step of 32 cost ~1 s on 2 busy cores


def prepare_model(wd: Path, data: Path, steps: int) -> Path:
    """The default tiny Llama (2 x 128), warm-started on the worked solutions for `steps` SFT
    steps of WARM_BATCH problems (both cached per step count): short of perfect on purpose, so
    GRPO has signal."""
    base, warm = wd / "scratch-base", wd / f"scratch-warm-{steps}"
    if not (base / "config.json").exists():
        subprocess.run([sys.executable, "-m", "asyncrl.tiny_model", "--out", str(base)], check=True)
    if not (warm / "config.json").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "asyncrl.warmstart",
                "--model",
                str(base),
                "--out",
                str(warm),
                "--steps",
                str(steps),
                "--batch-size",
                str(WARM_BATCH),
                "--task-spec",
                json.dumps(task_section(data)),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return warm
