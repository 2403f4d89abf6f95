"""One run of ours or of TRL's GRPOTrainer, and its held-out curve: what the benchmarks that
compare the two share (bench.suite, bench.own_task, bench.fleet, bench.lora).

- `run_finished`: one job of ours to its end (asyncrl.demo's runner), the services given extra
  environment variables (`environment`); `ours_curve`: its held-out curve, step ends and per-step
  time breakdown from the ledger.
- `trl_python`: the TRL virtual environment (TRL_VERSION, torch TORCH_VERSION); `run_trl`: one
  run of bench/peers/trl_grpo.py; `trl_task_run`: one on a job spec's task section.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from asyncrl.demo import run_job
from broker.ledger import Ledger
from shared.datasets import TaskSpec, load_task

console = Console()

TRL_VERSION = "1.16.0"  # works with torch 2.13 and Python 3.11 (verified here)
TORCH_VERSION = "2.13.0"  # the local CPU wheel; pinned in every pip command so no CUDA build comes
PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "trl_grpo.py"


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables for the services that run_job starts (they inherit ours)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_finished(wd: Path, spec: dict[str, Any], env: dict[str, str] | None = None) -> tuple[Ledger, str, float]:
    """Run one job of ours to its end (asyncrl.demo run_job, the services given `env`): its ledger,
    job id and launch time. Raises RuntimeError when the job does not finish."""
    t_launch = time.time()
    with environment(**(env or {})):
        run = run_job(wd, spec, progress=False)
    if run.state != "finished":
        raise RuntimeError(f"job {spec['name']} ended {run.state}: {run.error}")
    return Ledger(run.db_url), run.job_id, t_launch


def ours_curve(
    ledger: Ledger, job_id: str, t0: float, eval_set: str = "held_out"
) -> tuple[list[dict[str, float]], list[dict[str, float]], dict[str, float | None]]:
    """A finished job's held-out curve ({step, reward, t_s}: a point's time is the end of the step
    that produced the policy, seconds since `t0`), every step's end ({step, t_s}) and the median
    per-step time breakdown over the steady steps: every `time/*` metric the trainer records
    (wait, train, publish, ledger, ...), under its name without the prefix."""
    steps = ledger.train_steps(job_id)
    end = {s["step"]: s["created_at"].timestamp() - t0 for s in steps}
    curve = [
        {"step": e["step"], "reward": e["reward_mean"], "t_s": end.get(e["step"], e["created_at"].timestamp() - t0)}
        for e in ledger.evals(job_id, source="pipeline")
        if e["name"] == eval_set
    ]
    steady = steps[2:] or steps
    keys = sorted({k for s in steady for k in s["metrics"] if k.startswith("time/")})
    breakdown = {k.removeprefix("time/"): _median([s["metrics"][k] for s in steady if k in s["metrics"]]) for k in keys}
    return curve, [{"step": s["step"], "t_s": end[s["step"]]} for s in steps], breakdown


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def trl_python(venv: Path) -> Path:
    """The TRL venv's python, creating the venv when it lacks TRL_VERSION.

    torch first, from the local CPU wheel, and pinned again with trl so pip never swaps it for a
    CUDA build. Raises RuntimeError with pip's output when an install fails (no index, say).
    """
    py = venv / "bin" / "python"
    probe = f"import torch, trl; assert trl.__version__ == '{TRL_VERSION}', trl.__version__"
    if py.exists() and subprocess.run([str(py), "-c", probe], capture_output=True).returncode == 0:
        return py
    console.print(f"[bold]TRL environment[/] -> {venv} (torch=={TORCH_VERSION}, trl=={TRL_VERSION})")
    steps = [
        ["python3", "-m", "venv", str(venv)],
        [str(py), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"],
        [str(py), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}", f"trl=={TRL_VERSION}"],
    ]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            noise = "is ignored: it is neither a file nor a directory"
            err = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if noise not in ln)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return py


def run_trl(py: Path, run_dir: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run bench/peers/trl_grpo.py with `cfg` (its keys: that script's docstring; workdir,
    threads and t_launch are filled in here) in `run_dir`; its result JSON."""
    run_dir.mkdir(parents=True)
    cfg = {"threads": len(os.sched_getaffinity(0)), **cfg, "workdir": str(run_dir)}
    cfg["t_launch"] = time.time()
    (run_dir / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.run(
        [str(py), str(PEER_SCRIPT), "--config", str(run_dir / "config.json"), "--out", str(run_dir / "result.json")],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    (run_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed (log {run_dir / 'log.txt'}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads((run_dir / "result.json").read_text())


def trl_task_run(
    py: Path,
    run_dir: Path,
    model: Path,
    task: dict[str, Any],
    reward: Path,
    shape: dict[str, Any],
    stop: list[str],
    seed: int,
    steps: int,
    eval_every: int,
    **extra: Any,
) -> dict[str, Any]:
    """TRL's GRPOTrainer on a task section (the same train/test split as a job with that seed),
    a reward file and stop strings; its result JSON (bench/peers/trl_grpo.py)."""
    train, test = load_task(TaskSpec.model_validate(task), seed)

    def rows(ps: list[Any]) -> list[dict[str, Any]]:
        return [{"prompt": q.prompt, "answer": q.answer, "metadata": q.metadata} for q in ps]

    return run_trl(
        py,
        run_dir,
        {
            "model_path": str(model),
            "seed": seed,
            "steps": steps,
            "train": rows(train),
            "test": rows(test),
            "group_size": shape["group_size"],
            "prompts_per_step": shape["prompts_per_step"],
            "micro_batch_size": shape["group_size"] * shape["prompts_per_step"],
            "lr": shape["lr"],
            "temperature": shape["temperature"],
            "max_tokens": shape["max_tokens"],
            "eval_every": eval_every,
            "reward": f"{reward}:score",
            "stop": stop,
            **extra,
        },
    )
