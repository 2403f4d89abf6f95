"""reasoning-gym datasets trained by name (`python -m bench ecosystem-gym`): the `reasoning_gym`
section of results/ecosystem.json (the run's settings beside it, `reasoning_gym_run`).

Each dataset is given the way a user gives it (docs/tasks.md): `task.name: "reasoning_gym"`, the
dataset's registered name and a config that keeps its problems short enough for the tiny model's
256 positions; the reward is left out, so the dataset's own `score_answer` scores. Per dataset: the
tiny 2-layer character-level Llama (asyncrl.tiny_model), warm-started on that task's training split
(asyncrl.warmstart --task-spec, its default imperfect teacher: an integer answer is taught as
answer + 1 with probability 0.7), then an RL job with the defaults but for the shape below, on one
standing fleet (bench/standing.py: real broker, generator, reward service and trainer processes).
Held-out reward before/after: the job's greedy evaluation of its held-out set (n_test problems from
the seeds after the training ones) at step 0 and at the last step, scored by `score_answer`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from asyncrl.demo import warmstart_command
from bench.claims import machine
from bench.standing import standing_services

console = Console()

DATASETS: dict[str, dict[str, Any]] = {
    # "How many times does the letter "e" appear in the text: "Verne"?" -> "2"
    "letter_counting": {"min_words": 1, "max_words": 1},
    # "Calculate 7 + 3." -> "10"
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    # "State the final answer to the following arithmetic problem: 4 - 1 =" -> "3"
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
}
SIZE = 150  # training problems; the one-digit pools hold about 200-240 distinct questions
N_TEST = 50
SHAPE: dict[str, Any] = {"group_size": 8, "prompts_per_step": 8, "lr": 1e-4, "max_tokens": 8, "temperature": 1.0}


def task_section(dataset: str) -> dict[str, Any]:
    return {"name": "reasoning_gym", "dataset": dataset, "config": DATASETS[dataset], "size": SIZE, "n_test": N_TEST}


def gym_spec(model: Path, dataset: str, seed: int, steps: int, eval_every: int) -> dict[str, Any]:
    """The job spec a user writes: the task by name, the shape; the reward left to the dataset."""
    return {
        "name": f"gym-{dataset}-s{seed}",
        "model_path": str(model),
        "seed": seed,
        "steps": steps,
        "eval_every": eval_every,
        "group_size": SHAPE["group_size"],
        "prompts_per_step": SHAPE["prompts_per_step"],
        "algorithm": {"lr": SHAPE["lr"]},
        "sampling": {"temperature": SHAPE["temperature"], "max_tokens": SHAPE["max_tokens"]},
        "task": task_section(dataset),
    }


def prepare_models(wd: Path, seed: int) -> dict[str, dict[str, Any]]:
    """The tiny base model (once) and a warm start per dataset (each cached): {dataset: {path,
    warm_start metrics}}."""
    base = wd / "tiny-base"
    if not (base / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "asyncrl.tiny_model", "--out", str(base), "--seed", str(seed)], check=True
        )
    out: dict[str, dict[str, Any]] = {}
    for dataset in DATASETS:
        warm = wd / f"warm-{dataset}"
        metrics_file = warm / "warm_start.json"
        if not metrics_file.exists():
            console.print(f"[bold]warm start[/] on reasoning_gym {dataset} -> {warm}")
            run = subprocess.run(
                warmstart_command(base, warm, "--seed", str(seed), "--task-spec", json.dumps(task_section(dataset))),
                check=True,
                capture_output=True,
                text=True,
            )
            metrics_file.write_text(run.stdout.strip().splitlines()[-1] + "\n")
        out[dataset] = {"path": warm, "warm_start": json.loads(metrics_file.read_text())}
    return out


def held_out(evals: Sequence[Mapping[str, Any]]) -> tuple[float | None, float | None, int | None]:
    """(reward at step 0, reward at the last evaluated step, that step) of the held_out set."""
    rounds = sorted((e["step"], e["reward_mean"]) for e in evals if e["name"] == "held_out")
    if not rounds:
        return None, None, None
    return rounds[0][1], rounds[-1][1], rounds[-1][0]


def bench_ecosystem_gym(
    *,
    workdir: str = "runs/bench-ecosystem-gym",
    out_dir: str = "results",
    steps: int = 60,
    eval_every: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """Train each of DATASETS by name and write results/ecosystem_gym.json (its `reasoning_gym`
    section: per dataset held_out_before / held_out_after, the job, the warm start's figures)."""
    t0 = time.monotonic()
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    models = prepare_models(wd, seed)
    section: dict[str, Any] = {}
    fleet_dir = wd / f"fleet-{time.strftime('%Y%m%d-%H%M%S')}"
    fleet_dir.mkdir()
    with standing_services(fleet_dir, "gym") as f:
        for dataset in DATASETS:
            spec = gym_spec(models[dataset]["path"], dataset, seed, steps, eval_every)
            t_job = time.monotonic()
            r = httpx.post(f"{f.api}/jobs", json=spec, timeout=60)
            if r.status_code != 201:
                raise RuntimeError(f"{dataset}: submission failed ({r.status_code}): {r.text}")
            job_id = str(r.json()["id"])
            console.print(f"[bold]reasoning_gym {dataset}[/]: job {job_id}, {steps} steps")
            while (job := httpx.get(f"{f.api}/jobs/{job_id}", timeout=30).json())["state"] not in (
                "finished",
                "failed",
                "stopped",
                "cancelled",
            ):
                failed = f.sup.failed()
                if failed:
                    raise RuntimeError("\n".join(f"{p.name}:\n{f.sup.tail(p.name)}" for p in failed))
                time.sleep(1)
            before, after, last = held_out(f.ledger.evals(job_id, source="pipeline"))
            verify = httpx.get(f"{f.api}/jobs/{job_id}/verify", timeout=120).json()
            section[dataset] = {
                "config": DATASETS[dataset],
                "size": SIZE,
                "n_test": N_TEST,
                "job_id": job_id,
                "state": job["state"],
                "steps": steps,
                "held_out_before": before,
                "held_out_after": after,
                "held_out_after_step": last,
                "delta": None if before is None or after is None else after - before,
                "verify_ok": bool(verify.get("ok")),
                "wall_s": round(time.monotonic() - t_job, 1),
                "warm_start": models[dataset]["warm_start"],
            }
            console.print(f"  held-out {before} -> {after} (step {last}); verify ok: {verify.get('ok')}")
    result = {
        "reasoning_gym": section,
        "model": "tiny 2-layer character-level Llama (asyncrl.tiny_model), warm-started per dataset "
        "(asyncrl.warmstart --task-spec, default imperfect teacher)",
        "shape": SHAPE,
        "reward": "each dataset's own score_answer (the built-in reward reasoning_gym, the task's default)",
        "held_out": f"{N_TEST} problems from the seeds after the {SIZE} training ones, greedy, step 0 and last step",
        "seed": seed,
        "reasoning_gym_version": _version(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_sections(out, result)
    return result


def write_sections(out: Path, result: dict[str, Any]) -> None:
    """Merge the run into `out`/ecosystem.json (`reasoning_gym` and `reasoning_gym_run`) and its page."""
    from bench.ecosystem import markdown, merge_results

    run = {k: v for k, v in result.items() if k != "reasoning_gym"}
    data = merge_results(out / "ecosystem.json", {"reasoning_gym": result["reasoning_gym"], "reasoning_gym_run": run})
    (out / "ecosystem.md").write_text(markdown(data))


def _version() -> str:
    from importlib.metadata import version

    return version("reasoning-gym")
