"""Does the trainer score tokens under the distribution they were sampled from? `python -m bench
correctness` (`--label before` for a checkout without the fix).

Real sync jobs (staleness 0, float32 on both sides) on the demo's warm-started tiny model, one per
truncated sampler: top_p 0.8, top_p 0.95, top_k 20, at temperature 1.0, on a standing fleet
(`python -m asyncrl.launch`, bench/fleet.py `WarmFleet`). At staleness 0 the trainer's weights are
the generator's, so the importance weight pi/mu of every token is 1 up to float rounding exactly
when both sides agree on the behaviour policy: the trainer's step metrics `is/mean` (goal 1.000)
and `mismatch_kl` (k3 KL(mu || pi), goal ~0) per step say whether they do.

Writes its own keys of results/correctness.json, keeping every other key there:
`is_mean_<sampler>_sync` and `mismatch_kl_<sampler>_sync` (the mean over the job's steps; with
`--label before`, the same keys suffixed `_before`), and `behaviour_policy_runs[<label>]`: per-step
figures, the commit and the load average.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.claims import machine
from bench.fleet import WarmFleet
from bench.gates import update_correctness

STEPS = 6
# name in the result keys -> the job's sampling section
SAMPLERS: dict[str, dict[str, Any]] = {
    "top_p_0_8": {"top_p": 0.8},
    "top_p_0_95": {"top_p": 0.95},
    "top_k_20": {"top_k": 20},
}


def job_spec(model: Path, name: str, sampling: dict[str, Any], steps: int) -> dict[str, Any]:
    """The demo's job (asyncrl/demo.py run_demo) in sync mode with a truncated sampler."""
    return {
        "name": f"correctness-{name}",
        "model_path": str(model),
        "mode": "sync",
        "max_staleness": 0,
        "steps": steps,
        "seed": 0,
        "eval_every": 0,
        "algorithm": {"lr": 1e-4, "dtype": "float32"},
        "sampling": {"temperature": 1.0, "max_tokens": 8, **sampling},
    }


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return proc.stdout.strip()


def bench_correctness(
    *, label: str = "after", steps: int = STEPS, out_dir: str = "results", workdir: str = "runs/bench-correctness"
) -> dict[str, Any]:
    from asyncrl.demo import prepare_model

    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    model = prepare_model(wd, seed=0)
    suffix = "" if label == "after" else f"_{label}"
    keys: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    fleet = WarmFleet(wd)
    try:
        for name, sampling in SAMPLERS.items():
            job_id, _ = fleet.submit(job_spec(model, name, sampling, steps))
            job = fleet.wait(job_id)
            if job["state"] != "finished":
                raise RuntimeError(f"job {name} ended {job['state']}; see {fleet.run}")
            metrics = [r["metrics"] for r in fleet.ledger.train_steps(job_id)]
            is_mean = [float(m["is/mean"]) for m in metrics]
            kl = [float(m["mismatch_kl"]) for m in metrics]
            keys[f"is_mean_{name}_sync{suffix}"] = statistics.fmean(is_mean)
            keys[f"mismatch_kl_{name}_sync{suffix}"] = statistics.fmean(kl)
            runs[name] = {"sampling": sampling, "is_mean_per_step": is_mean, "mismatch_kl_per_step": kl}
            fleet.idle()
    finally:
        fleet.close()
    runs["meta"] = {
        "commit": _commit(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "steps": steps,
        "machine": machine(),
        "threads": os.environ.get("TRAINER_THREADS", ""),
    }
    # the other label's runs stay: before and after are measured by different checkouts
    path = Path(out_dir) / "correctness.json"
    earlier = json.loads(path.read_text()).get("behaviour_policy_runs", {}) if path.exists() else {}
    update_correctness(Path(out_dir), {**keys, "behaviour_policy_runs": {**earlier, label: runs}})
    return {**keys, "runs": runs}
