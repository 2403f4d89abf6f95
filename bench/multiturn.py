"""Multi-turn and tools, demonstrated (`python -m bench multiturn`): a tool is how the tiny model succeeds.

The task: four-digit addition (`"4821+7390="` -> `"12211"`), far past what the tiny model adds
reliably, in a JSON Lines file of the user's own, scored by the built-in `exact_match`. The job
runs in the built-in `tools` environment with the calculator only, the way docs/tasks.md's
"Multi-turn and tools" starts one: the model may write

    <tool_call>{"name": "calculator", "arguments": {"expression": "4821+7390"}}</tool_call>

read the `<tool_response>` the environment appends, and answer. Nothing tells it to: the system
prompt is off (the tiny model's 256-token context holds no tool description).

1. **Supervised warm start** (`warm_start`): a 4-layer tiny Llama learns the call format from
   teacher episodes built by the same environment and codec the generator uses (so the ids are
   exactly what an episode holds: the model's turns end with EOS, the tool's reply is tokenized
   once), loss on the model's tokens only. The teacher calls the calculator in only
   `TEACHER_TOOL_SHARE` (half) of its episodes; in the rest it writes the sum straight away,
   which the model cannot learn to do. So the warm-started policy calls the tool on some
   problems, and is then nearly always right, and answers directly, and wrongly, on the others.
2. **RL in the pipeline**: every service as a process (asyncrl.demo.run_job), the job spec below
   with defaults for everything else. The reward is only exact match on the final answer: the
   tool's use is never rewarded as such, and the policy must find that calling it pays.
3. **The retokenization check** on this model and environment (`logprob_match`): episodes played
   by the vLLM engine through the generator's own episode runner (generator_svc.episodes), then
   the trainer's logprobs recomputed from their ids through TrainBatch.micro_batch: mean |Δ| on
   the model's tokens, and how many environment tokens carry a loss mask (must be 0).

Curves: per step, the share of training episodes with a successful tool call (`env/tool_success`,
sampled at temperature 1) and the reward; per evaluation round (held-out problems, greedy), the
reward and `env/tool_success`.

Results: results/multiturn.json (`logprob_match_mean_abs`, `env_tokens_with_loss`, `utilisation`
from results/episode_rate.json when that bench has run, `tool_success_start`, `tool_success_end`,
`held_out_start`, `held_out_end`, `machine`, `date`, and the curves), results/multiturn.md and
results/multiturn.png.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.claims import machine

console = Console()

N_TEST = 100
TEACHER_TOOL_SHARE = 0.5
SFT_STEPS = 1000
SFT_LR = 2e-3
SFT_BATCH = 32
RL_LR = 2e-4  # the tiny model's (the spec's default, 1e-6, suits billion-parameter models)
ENVIRONMENT: dict[str, Any] = {
    "name": "tools",
    "kwargs": {"tools": ["calculator"], "system_prompt": False},
    "limits": {"max_turns": 3},
}


def write_task(wd: Path, seed: int = 0) -> Path:
    """The user's data file: four-digit sums, shuffled."""
    rng = random.Random(seed)
    rows = [
        {"question": f"{a}+{b}=", "target": str(a + b)}
        for a, b in ((rng.randint(1000, 9999), rng.randint(1000, 9999)) for _ in range(4000))
    ]
    data = wd / "user" / "sums.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def task_section(data: Path) -> dict[str, Any]:
    return {"datasets": [{"path": str(data)}], "prompt_field": "question", "answer_field": "target", "n_test": N_TEST}


def job_spec(model: Path, data: Path, steps: int, eval_every: int, seed: int) -> dict[str, Any]:
    """What a user writes for this task; the rest is the defaults."""
    return {
        "name": f"multiturn-s{seed}",
        "model_path": str(model),
        "seed": seed,
        "steps": steps,
        "eval_every": eval_every,
        "prompts_per_step": 8,
        "algorithm": {"lr": RL_LR},
        "sampling": {"max_tokens": 96},
        "task": task_section(data),
        "reward": "exact_match",
        "environment": ENVIRONMENT,
    }


# --- the supervised warm start ---------------------------------------------------------------------


def teacher_episodes(
    model_dir: Path, rows: list[dict[str, str]], share: float, seed: int
) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, completion ids, model mask) of a teacher episode per row, played through the
    tools environment and the job's codec: a calculator call then the result in `share` of them,
    else the sum written straight away."""
    from transformers import AutoTokenizer

    from shared.environments.episode import codec_for, run_episode
    from shared.environments.registry import load_environment
    from shared.environments.spec import EnvironmentSpec

    tok = AutoTokenizer.from_pretrained(model_dir)
    codec = codec_for(tok, "auto")
    spec = EnvironmentSpec.model_validate(ENVIRONMENT)
    make_env = load_environment(spec)
    rng = random.Random(seed)

    async def one(row: dict[str, str]) -> tuple[list[int], list[int], list[int]]:
        a_plus_b = row["question"].rstrip("=")
        turns = (
            [
                json.dumps({"name": "calculator", "arguments": {"expression": a_plus_b}}).join(
                    ("<tool_call>", "</tool_call>")
                ),
                row["target"],
            ]
            if rng.random() < share
            else [row["target"]]
        )
        script = iter(turns)

        async def generate(context: list[int], room: int):  # type: ignore[no-untyped-def]
            ids = [*tok(next(script), add_special_tokens=False)["input_ids"], tok.eos_token_id]
            return ids, [0.0] * len(ids), "stop"

        ep = await run_episode(
            make_env(), {"prompt": row["question"], "answer": row["target"]}, generate, codec, spec.limits
        )
        assert ep.stop_reason == "done", ep.stop_reason
        return ep.prompt_ids, ep.ids, ep.mask

    async def every() -> list[tuple[list[int], list[int], list[int]]]:
        return [await one(r) for r in rows]

    return asyncio.run(every())


def warm_start(
    base: Path,
    out: Path,
    rows: list[dict[str, str]],
    *,
    steps: int = SFT_STEPS,
    share: float = TEACHER_TOOL_SHARE,
    lr: float = SFT_LR,
    seed: int = 0,
) -> dict[str, float]:
    """Teacher forcing on teacher episodes, loss on the model's tokens only; AdamW, cosine lr."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    episodes = teacher_episodes(base, rows, share, seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(base)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    rng = random.Random(seed)
    t0, loss_value = time.perf_counter(), float("nan")
    model.train()
    for _ in range(steps):
        batch = rng.sample(episodes, SFT_BATCH)
        seqs = [p + c for p, c, _ in batch]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tok.pad_token_id)
        labels = torch.full((len(seqs), width), -100)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (p, c, m) in enumerate(batch):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            attn[i, : len(p) + len(c)] = 1
            labels[i, len(p) : len(p) + len(c)] = torch.tensor([t if k else -100 for t, k in zip(c, m, strict=True)])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return {
        "sft_steps": steps,
        "sft_lr": lr,
        "sft_final_loss": loss_value,
        "sft_seconds": time.perf_counter() - t0,
        "teacher_tool_share": share,
    }


# --- the retokenization check ------------------------------------------------------------------------


def logprob_match(model_dir: Path, rows: list[dict[str, str]], episodes_per_row: int = 4) -> dict[str, Any]:
    """Episodes of the tools environment played by vLLM through generator_svc.episodes.run_groups,
    then the trainer's logprobs recomputed from their ids: |Δ| on model tokens, and environment
    tokens that carry a loss mask. Run in a subprocess of its own (vLLM's engine)."""
    import torch
    from transformers import AutoModelForCausalLM

    from generator_svc.engine import Engine
    from generator_svc.episodes import run_groups
    from generator_svc.service import episode_codec
    from shared.environments.registry import load_environment
    from shared.environments.spec import EnvironmentSpec
    from shared.schema import PromptGroup, Rollout, SamplingParams, Scored, pack_f32, pack_i32
    from trainer_svc.batch import TrainBatch
    from trainer_svc.logprobs import token_logprobs

    spec = EnvironmentSpec.model_validate(ENVIRONMENT)
    engine = Engine(str(model_dir), seed=0, dtype="float32", max_model_len=256)
    groups = [
        PromptGroup(
            job_id="j",
            msg_id=f"g{i}",
            group_id=f"g{i}",
            policy_version=0,
            prompt_index=i,
            prompt=r["question"],
            answer=r["target"],
            n=episodes_per_row,
            sampling=SamplingParams(temperature=1.0, max_tokens=96),
        )
        for i, r in enumerate(rows)
    ]
    limits = spec.limits.model_copy(update={"max_total_tokens": 256})
    played = run_groups(engine, load_environment(spec), limits, episode_codec(str(model_dir), "auto", {}), groups)
    engine.close()
    samples = [s for g in played.samples if not isinstance(g, str) for s in g]
    scored = [
        Scored(
            job_id="j",
            msg_id=f"m{i}",
            group_id="g",
            policy_version=0,
            reward=0.0,
            rollout=Rollout(
                job_id="j",
                msg_id=f"m{i}",
                group_id="g",
                policy_version=0,
                policy_version_max=0,
                prompt_index=0,
                sample_index=0,
                group_size=1,
                generator_id="g",
                prompt_ids=pack_i32(s.prompt_ids),
                completion_ids=pack_i32(s.completion_ids),
                logprobs=pack_f32(s.logprobs),
                model_mask=s.model_mask,
                turns=s.turns,
                completion="",
                answer="",
                temperature=1.0,
            ),
        )
        for i, s in enumerate(samples)
    ]
    batch = TrainBatch.of(scored, torch.zeros(len(scored), 1))
    ids, attn, behaviour, mask, temp = batch.micro_batch(0, len(batch), pad_id=0)
    env = torch.zeros_like(mask, dtype=torch.bool)
    for row, s in enumerate(samples):
        p = len(s.prompt_ids)
        env[row, p - 1 : p - 1 + len(s.completion_ids)] = torch.tensor(list(s.model_mask)) == 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = token_logprobs(model, ids, attn, temp)
    diffs = (ours - behaviour)[mask.bool()].abs()
    return {
        "episodes": len(samples),
        "turns_mean": statistics.fmean(s.turns for s in samples),
        "model_tokens": int(diffs.numel()),
        "env_tokens": int(env.sum()),
        "logprob_match_mean_abs": float(diffs.mean()),
        "logprob_match_max_abs": float(diffs.max()),
        "env_tokens_with_loss": int((mask.bool() & env).sum()),
        "env_tokens_with_behaviour_logprob": int((behaviour[env] != 0).sum()),
    }


# --- the run -------------------------------------------------------------------------------------------


def _curves(db_url: str, job_id: str) -> dict[str, Any]:
    from broker.ledger import Ledger

    ledger = Ledger(db_url)
    try:
        steps = ledger.train_steps(job_id)
        evals = [e for e in ledger.evals(job_id, source="pipeline") if e["name"] == "held_out"]
    finally:
        ledger.close()
    train = [
        {
            "step": s["step"],
            "tool_success": s["metrics"].get("env/tool_success"),
            "tool_calls": s["metrics"].get("env/tool_calls"),
            "reward": s["metrics"].get("reward/mean"),
        }
        for s in steps
    ]
    held = [
        {"step": e["step"], "reward": e["reward_mean"], "tool_success": (e["metrics"] or {}).get("env/tool_success")}
        for e in evals
    ]
    return {"train": train, "held_out": held}


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def plot(curves: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    tr, ho = curves["train"], curves["held_out"]
    ax[0].plot([p["step"] for p in tr], [p["tool_success"] for p in tr], label="tool success (sampled, T=1)")
    ax[0].plot([p["step"] for p in tr], [p["reward"] for p in tr], label="train reward", alpha=0.7)
    ax[0].set(xlabel="trainer step", title="training episodes", ylim=(-0.02, 1.02))
    ax[0].legend()
    ax[1].plot([p["step"] for p in ho], [p["reward"] for p in ho], marker="o", label="held-out reward (greedy)")
    ax[1].plot([p["step"] for p in ho], [p["tool_success"] for p in ho], marker="s", label="held-out tool success")
    ax[1].set(xlabel="trainer step", title=f"held-out ({N_TEST} problems)", ylim=(-0.02, 1.02))
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def bench_multiturn(
    out_dir: str = "results", steps: int = 60, eval_every: int = 2, seed: int = 0, workdir: str = "runs/bench-multiturn"
) -> dict[str, Any]:
    from asyncrl.demo import run_job

    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    data = write_task(wd, seed)
    from shared.datasets import TaskSpec, load_task

    train, _ = load_task(TaskSpec.model_validate(task_section(data)), seed)  # the job's own split
    rows = [{"question": p.prompt, "target": p.answer} for p in train]
    base, warm = wd / "base", wd / f"warm-{SFT_STEPS}-{TEACHER_TOOL_SHARE}-{SFT_LR}"
    if not (base / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "asyncrl.tiny_model", "--out", str(base), "--layers", "4", "--seed", str(seed)],
            check=True,
        )
    sft: dict[str, Any] = {}
    if not (warm / "config.json").exists():
        console.print(f"[bold]supervised warm start[/] -> {warm}")
        sft = warm_start(base, warm, rows, seed=seed)
        (warm / "sft.json").write_text(json.dumps(sft))
    sft = sft or json.loads((warm / "sft.json").read_text())
    console.print(f"warm start: {sft}")

    check = wd / "logprob_match.json"
    subprocess.run(
        [sys.executable, "-m", "bench.multiturn", "logprob-match", str(warm), str(data), str(check)], check=True
    )
    match = json.loads(check.read_text())
    console.print(f"retokenization check: {match}")

    spec = job_spec(warm, data, steps, eval_every, seed)
    run = run_job(wd, spec)
    if run.state != "finished":
        raise RuntimeError(f"the job ended {run.state}: {run.error}")
    curves = _curves(run.db_url, run.job_id)
    tr, ho = curves["train"], curves["held_out"]
    rate_file = Path(out_dir) / "episode_rate.json"
    rate = json.loads(rate_file.read_text()) if rate_file.exists() else {}
    result = {
        "logprob_match_mean_abs": match["logprob_match_mean_abs"],
        "env_tokens_with_loss": match["env_tokens_with_loss"],
        "utilisation": rate.get("utilisation"),
        # training episodes (sampled): the first step's (generated by the warm-started policy)
        # and the last five steps'; held-out (greedy): the first and last rounds
        "tool_success_start": tr[0]["tool_success"] if tr else None,
        "tool_success_end": _mean([p["tool_success"] for p in tr[-5:]]),
        "held_out_start": ho[0]["reward"] if ho else None,
        "held_out_end": ho[-1]["reward"] if ho else None,
        "held_out_tool_success_start": ho[0]["tool_success"] if ho else None,
        "held_out_tool_success_end": ho[-1]["tool_success"] if ho else None,
        "train_reward_start": tr[0]["reward"] if tr else None,
        "train_reward_end": _mean([p["reward"] for p in tr[-5:]]),
        "job": {"spec": {k: v for k, v in spec.items() if k != "model_path"}, "wall_s": run.wall_s, "steps": steps},
        "warm_start": sft,
        "logprob_match": match,
        "curves": curves,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multiturn.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(curves, out / "multiturn.png")
    (out / "multiturn.md").write_text(markdown(result))
    console.print(markdown(result))
    return result


def _f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(r: dict[str, Any]) -> str:
    ho = r["curves"]["held_out"]
    lines = [
        "# Multi-turn and tools: the calculator demonstration",
        "",
        f"{r['date']}, {r['machine'].get('cores')} cores ({r['machine'].get('cpu')}). "
        "`python -m bench multiturn`: 4-digit addition, the built-in `tools` "
        "environment (calculator), exact-match reward; a 4-layer tiny Llama warm-started on teacher episodes "
        f"that call the tool in {r['warm_start']['teacher_tool_share']:.0%} of cases "
        f"({r['warm_start']['sft_steps']} steps), then {r['job']['steps']} RL steps in the pipeline.",
        "",
        "| figure | start | end |",
        "|---|---|---|",
        f"| tool success, training episodes (T=1; step 1, last 5 steps) | {_f(r['tool_success_start'])} | "
        f"{_f(r['tool_success_end'])} |",
        f"| train reward (step 1, last 5 steps) | {_f(r['train_reward_start'])} | {_f(r['train_reward_end'])} |",
        f"| held-out reward (greedy, {N_TEST} problems) | {_f(r['held_out_start'])} | {_f(r['held_out_end'])} |",
        f"| held-out tool success | {_f(r['held_out_tool_success_start'])} | {_f(r['held_out_tool_success_end'])} |",
        "",
        "Held-out rounds: "
        + ", ".join(f"step {p['step']}: {_f(p['reward'])} ({_f(p['tool_success'])} tool)" for p in ho),
        "",
        f"Retokenization check ({r['logprob_match']['episodes']} vLLM episodes, "
        f"{r['logprob_match']['turns_mean']:.2f} turns on average): mean |Δ logprob| on "
        f"{r['logprob_match']['model_tokens']} model tokens {r['logprob_match_mean_abs']:.2e} "
        f"(max {r['logprob_match']['logprob_match_max_abs']:.2e}); environment tokens with a loss mask: "
        f"{r['env_tokens_with_loss']} of {r['logprob_match']['env_tokens']}.",
        "",
        f"Utilisation with a 50 ms tool (results/episode_rate.json): {_f(r['utilisation'])}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # the retokenization check, in a process of its own (vLLM)
    if sys.argv[1:2] == ["logprob-match"]:
        model_dir, data_file, out_file = map(Path, sys.argv[2:5])
        test_rows = [json.loads(line) for line in data_file.read_text().splitlines()][:8]
        Path(out_file).write_text(json.dumps(logprob_match(model_dir, test_rows)))
