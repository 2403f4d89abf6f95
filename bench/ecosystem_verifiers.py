"""verifiers environments trained by module name (`python -m bench ecosystem-verifiers`): the
`verifiers_envs` section of results/ecosystem.json (merged: the other sections are kept).

Each environment is given the way a user gives it (docs/tasks.md): `task.name: "verifiers"`, its
module name and its args; the reward and (for the one with tools) the environment are left to their
defaults, so the environment's own rubric scores and a task with tools plays its episodes in the
`verifiers` environment. The environments are the two tiny packages of tests/vf_envs (a word to
reverse, single-turn; two numbers to add with a tool, multi-turn), on the fleet's PYTHONPATH; the
model is the tests' tiny 2-layer Llama (random weights: the rewards are near 0, what is measured is
that the jobs finish verified and log each rubric function as its own term). One standing fleet
(bench/standing.py: real broker, generator, reward service and trainer processes).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from bench.claims import machine
from bench.ecosystem import Target, markdown, merge_results, run_job

VF_ENVS = Path(__file__).resolve().parents[1] / "tests" / "vf_envs"
CASES: dict[str, dict[str, Any]] = {
    # single-turn: reversed_exactly (weight 1) + short_reply (weight 0.5)
    "vf_tiny_reverse": {
        "task": {"name": "verifiers", "env": "vf_tiny_reverse", "args": {"num_tasks": 40}, "n_test": 8},
    },
    # multi-turn, a calc toolset: correct (weight 1) + used_tool (weight 0.25). The tools' instructions
    # do not fit the tiny model's 256 positions (system_prompt off), and a turn ends at a digit or a
    # lowercase letter so that it is answered rather than cut at max_tokens.
    "vf_tiny_tools": {
        "task": {"name": "verifiers", "env": "vf_tiny_tools", "args": {"num_tasks": 40}, "n_test": 8},
        "environment": {"name": "verifiers", "kwargs": {"system_prompt": False}, "limits": {"max_total_tokens": 200}},
        "sampling": {"max_tokens": 16, "stop_token_ids": list(range(4, 40))},
    },
}


def job_spec(env: str, model: Path, steps: int) -> dict[str, Any]:
    return {
        "name": f"ecosystem-{env}",
        "model_path": str(model),
        "steps": steps,
        "group_size": 4,
        "prompts_per_step": 4,
        "eval_every": 0,
        "mode": "sync",
        "sampling": {"max_tokens": 8},
        **CASES[env],
    }


def bench_ecosystem_verifiers(
    out_dir: str = "results", steps: int = 0, workdir: str = "runs/bench-ecosystem-verifiers"
) -> dict[str, Any]:
    """Run each of CASES by module name on a fresh standing fleet and merge `verifiers_envs` into
    `out_dir`/ecosystem.json (and its .md)."""
    from importlib.metadata import version

    from asyncrl.tiny_model import build_tiny_model
    from bench.standing import standing_services

    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(wd / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    path = os.pathsep.join(p for p in (str(VF_ENVS), os.environ.get("PYTHONPATH", "")) if p)
    started = time.time()
    section: dict[str, Any] = {}
    with standing_services(wd / f"fleet-{time.time_ns()}", "vf", env={"PYTHONPATH": path}) as f:
        target = Target(f.api, f.ledger, model)
        for env in CASES:
            r = run_job(target, job_spec(env, model, steps or 3))
            step_rows = f.ledger.train_steps(r["job"])
            r["step_terms"] = {
                str(row["step"]): {k: round(v, 4) for k, v in row["metrics"].items() if k.startswith("reward/")}
                for row in step_rows
            }
            r["episode_metrics"] = sorted({k for row in step_rows for k in row["metrics"] if k.startswith("env/")})
            section[env] = r
    results = {
        "verifiers_envs": section,
        "verifiers_envs_machine": {
            **machine(),
            "wall_s": round(time.time() - started, 1),
            "verifiers_version": version("verifiers"),
        },
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = merge_results(out / "ecosystem.json", results)
    (out / "ecosystem.md").write_text(markdown(data))
    return results
