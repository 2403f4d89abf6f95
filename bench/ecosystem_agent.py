"""`python -m bench ecosystem-agent`: an agent program written with the `openai` client trains a job
through the job's OpenAI-compatible endpoint (issue 36: results/ecosystem.json `openai_endpoint`).

The agent (`AGENT_LOOP` below, as a user writes it): takes an episode from the job API, asks the
model (turn 1), runs its one tool (`add`: the calculator over the problem, a `tool` message with its
result), asks again (turn 2), and posts the reward: the mean of its two answers being right.
Many agents run at once (threads), on a standing fleet started the user's way, the demo's
warm-started model, a sync job (so the importance weights' mean must be 1: the trainer's logprobs
of the recorded ids equal the engine's), `--steps` steps (default 50).

Figures: `is_mean_sync` (mean over steps of the trainer's `is/mean`; goal 1.000 +- 0.001),
`episodes` (trained), `verify_ok`, the held-out reward is not measured (the job has no eval);
`overhead_ms_per_call`: each call's time at the agent minus its time in the generator (the
generator's own path: from its reader taking the call off Redis to the answer pushed, the wait
for an engine call in progress and the engine's own time included) in the same run, mean and
median: what the endpoint adds (HTTP, the API, the Redis hops, the JSON).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from bench.claims import machine
from bench.ecosystem import markdown, merge_results

console = Console(stderr=True)


def calculator(problem: str) -> str:
    """The agent's tool: the arithmetic problem ("37-12=") evaluated; digits and + - only."""
    expr = problem.strip().rstrip("=").replace(" ", "")
    if not expr or any(c not in "0123456789+-" for c in expr):
        return "error: not an expression"
    total, sign, num = 0, 1, ""
    for c in expr + "+":
        if c.isdigit():
            num += c
        else:
            total += sign * int(num or 0)
            sign, num = (1 if c == "+" else -1), ""
    return str(total)


ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Evaluate an expression of integers with + and -.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def agent_loop(api: str, job_id: str, done: threading.Event, out: list[dict[str, Any]], errors: list[str]) -> None:
    """One agent: play episodes until `done`."""
    from openai import OpenAI

    http = httpx.Client(timeout=120)
    try:
        while not done.is_set():
            task = http.post(f"{api}/jobs/{job_id}/episodes", params={"wait_s": 1}).raise_for_status().json()
            if task["episode_id"] is None:
                continue
            client = OpenAI(base_url=task["base_url"], api_key="none", max_retries=0)
            messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
            calls = []
            for turn in range(2):
                t0 = time.perf_counter()
                resp = client.chat.completions.create(
                    model=task["model"], messages=messages, tools=[ADD_TOOL], max_tokens=8
                )
                client_ms = (time.perf_counter() - t0) * 1000
                calls.append({"client_ms": client_ms, "generator_ms": (resp.model_extra or {})["generator_ms"]})
                message = resp.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if turn == 0:  # the tool: checks the problem with the calculator
                    messages.append({"role": "tool", "content": calculator(task["prompt"])})
            answers = [(messages[i].get("content") or "").strip().split("\n")[0] for i in (1, 3)]
            right = [float(a == task["answer"]) for a in answers]
            reward = sum(right) / 2  # each turn's answer right: the second sees the tool's result
            end = http.post(
                task["base_url"].removesuffix("/v1") + "/end",
                json={"reward": reward, "details": {"first_right": right[0], "final_right": right[1]}},
            )
            end.raise_for_status()
            out.append({"reward": reward, "calls": calls, "version": task["policy_version"]})
    except Exception as exc:  # noqa: BLE001 - reported in the results
        if not done.is_set():
            errors.append(f"{type(exc).__name__}: {exc}")


def agent_spec(model: Path, steps: int, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "model_path": str(model),
        "mode": "sync",
        "steps": steps,
        "group_size": 8,
        "prompts_per_step": 4,
        "eval_every": 0,
        "task": {"name": "arithmetic", "n_train": 300, "n_test": 50},
        "reward": "environment",
        "sampling": {"max_tokens": 8},
        "algorithm": {"lr": 1e-4},
        "environment": {"name": "agent", "limits": {"max_turns": 2, "max_total_tokens": 256, "step_timeout_s": 120}},
    }


def run_agents(api: str, spec: dict[str, Any], agents: int) -> tuple[str, dict[str, Any], list, list, float]:
    """Submit `spec`, run `agents` agent threads until the job ends: (job id, job, played, errors, wall s)."""
    r = httpx.post(f"{api}/jobs", json=spec, timeout=30)
    r.raise_for_status()
    job_id = r.json()["id"]
    done, played, errors = threading.Event(), [], []  # type: ignore[var-annotated]
    threads = [
        threading.Thread(target=agent_loop, args=(api, job_id, done, played, errors), daemon=True)
        for _ in range(agents)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    ends = ("finished", "failed", "cancelled", "stopped")
    while (job := httpx.get(f"{api}/jobs/{job_id}", timeout=30).json())["state"] not in ends and not errors:
        time.sleep(1)
    wall = time.monotonic() - t0
    done.set()
    for t in threads:
        t.join(timeout=30)
    return job_id, job, played, errors, wall


def per_call(played: list[dict[str, Any]]) -> dict[str, Any]:
    calls = [c for p in played for c in p["calls"]]
    overhead = [c["client_ms"] - c["generator_ms"] for c in calls]
    if not calls:
        return {"calls": 0}
    return {
        "calls": len(calls),
        "client_ms_per_call": statistics.fmean(c["client_ms"] for c in calls),
        "generator_ms_per_call": statistics.fmean(c["generator_ms"] for c in calls),
        "overhead_ms_per_call": statistics.fmean(overhead),
        "overhead_ms_per_call_median": statistics.median(overhead),
    }


def bench_ecosystem_agent(
    steps: int = 50, agents: int = 16, out_dir: str = "results", workdir: str = "runs/bench-ecosystem-agent"
) -> dict[str, Any]:
    from asyncrl.demo import prepare_model
    from bench.standing import standing_services
    from broker.verify import verify

    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    model = prepare_model(wd, 0)
    load_before = os.getloadavg()
    with standing_services(wd / f"fleet-{int(time.time())}", "agent") as fleet:
        job_id, job, played, errors, wall = run_agents(fleet.api, agent_spec(model, steps, "openai-agent"), agents)
        load_after = os.getloadavg()
        rows = sorted(fleet.ledger.train_steps(job_id), key=lambda s: s["step"])
        is_means = [float(s["metrics"]["is/mean"]) for s in rows]
        trained = [s for s in fleet.ledger.samples(job_id, kind="train", limit=1_000_000) if s["status"] == "trained"]
        result = verify(fleet.ledger, job_id)
        # the hop alone: one agent, so the box is not busy with 16 agents' clients besides the fleet
        _, _, alone, _, _ = run_agents(fleet.api, agent_spec(model, 3, "openai-agent-alone"), 1)
    rewards = [float(s["reward"]) for s in trained]
    half = len(rewards) // 2
    section = {
        "job": job_id,
        "state": job["state"],
        "error": job.get("error"),
        "agent_errors": errors[:5],
        "steps": len(rows),
        "mode": "sync",
        "agents": agents,
        "episodes": len(trained),
        "episodes_played": len(played),
        "turns_per_episode": 2,
        "tool": "add (the agent's calculator; its result goes back as a `tool` message)",
        "is_mean_sync": statistics.fmean(is_means) if is_means else None,
        "is_mean_max_abs_dev": max((abs(x - 1) for x in is_means), default=None),
        "verify_ok": result.ok,
        "verify_violations": [v.message for v in result.violations][:5],
        "reward_first_half": statistics.fmean(rewards[:half]) if half else None,
        "reward_second_half": statistics.fmean(rewards[half:]) if half else None,
        **per_call(played),
        **{f"{k}_one_agent": v for k, v in per_call(alone).items()},
        "wall_s": wall,
        "load_before": load_before,
        "load_after": load_after,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    out = Path(out_dir)
    data = merge_results(out / "ecosystem.json", {"openai_endpoint": section})
    (out / "ecosystem.md").write_text(markdown(data))
    return section
