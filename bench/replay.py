"""`python -m bench replay`: finished jobs re-run from their ledger and checkpoints, bit for bit.

Three jobs of the demo's warm-started tiny model (real rewards, so every step's batch moves the
weights), each on a fleet started for it (asyncrl.demo run_job): sync with one generator, async
(k = 1) with one generator and async with two generator processes. Each is replayed here
(trainer_svc/replay.py, what `asyncrl replay` runs) from the initial model and from its middle
checkpoint, and every step's weights checksum is compared with the one the trainer published. Then
the sync job's first step is replayed with the policy loss's sign flipped in this process: the
gate must name step 1.

Writes results/correctness.json keys `replay_bitwise_sync`, `replay_bitwise_async_1gen`,
`replay_bitwise_async_2gen` (true: every step the same) and `replay` (per run: the first differing
step and what differed, the steps, what the records cost, the timings and the load average),
keeping the file's other keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl.demo import prepare_model, run_job
from bench.claims import machine
from bench.gates import update_correctness
from broker.ledger import Ledger

RUNS = (("sync", "sync", 1), ("async_1gen", "async", 1), ("async_2gen", "async", 2))


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" (")[0].strip()


@contextlib.contextmanager
def flipped_loss() -> Iterator[None]:
    """The learner's policy loss with its sign flipped, in this process, for the block."""
    from trainer_svc import learner

    real = learner.policy_loss

    def flipped(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        return dataclasses.replace(out, loss=-out.loss)

    learner.policy_loss = flipped  # type: ignore[assignment]
    try:
        yield
    finally:
        learner.policy_loss = real


def replayed(ledger: Ledger, job_id: str, **kw: Any) -> dict[str, Any]:
    """One replay's report (trainer_svc/replay.py `report`) and its wall time."""
    from trainer_svc.replay import replay, report

    t0 = time.monotonic()
    out = report(job_id, list(replay(ledger, job_id, **kw)))
    return {**out, "wall_s": time.monotonic() - t0, "loadavg": _loadavg()}


def record_cost(ledger: Ledger, job_id: str) -> dict[str, Any]:
    """What the job's step records take in the ledger, and the trainer's time writing them."""
    rows = [ledger.step_input(job_id, s) for s in ledger.step_input_steps(job_id)]
    stored = [len(r["data"]) for r in rows if r is not None]
    raw = [int(r["meta"]["raw_bytes"]) for r in rows if r is not None]
    record_s = [s["metrics"].get("time/record_s") for s in ledger.train_steps(job_id)]
    step_s = [s["metrics"].get("time/step_s") for s in ledger.train_steps(job_id)]
    return {
        "bytes_per_step": statistics.fmean(stored),
        "raw_bytes_per_step": statistics.fmean(raw),
        "record_s_median": statistics.median([x for x in record_s if x is not None]),
        "step_s_median": statistics.median([x for x in step_s if x is not None]),
    }


def bench_replay(out_dir: str = "results", steps: int = 10, workdir: str = "runs/bench-replay") -> dict[str, Any]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    model = prepare_model(wd, 0)
    every = max(1, steps // 2)
    details: dict[str, Any] = {}
    flags: dict[str, bool] = {}
    for name, mode, generators in RUNS:
        spec = {
            "name": f"replay-{name}",
            "model_path": str(model),
            "mode": mode,
            "max_staleness": 1,
            "steps": steps,
            "group_size": 8,
            "prompts_per_step": 8,
            "eval_every": 0,
            "checkpoint_every": every,
            "algorithm": {"lr": 1e-4},
            "sampling": {"temperature": 1.0, "max_tokens": 8},
        }
        t0 = time.monotonic()
        run = run_job(wd / name, spec, generators=generators, progress=False)
        if run.state != "finished":
            raise RuntimeError(f"job {name} ended {run.state}: {run.error}")
        train_s, load_train = time.monotonic() - t0, _loadavg()
        ledger = Ledger(os.environ.get("DATABASE_URL") or run.db_url)
        full = replayed(ledger, run.job_id)
        mid = replayed(ledger, run.job_id, from_step=every + 1)
        stale = [s["staleness"] for s in ledger.samples(run.job_id, status="trained")]
        details[name] = {
            "job_id": run.job_id,
            "generators": generators,
            "mode": mode,
            "steps": steps,
            "bitwise": full["bitwise"] and mid["bitwise"],
            "first_differing_step": full["first_differing_step"],
            "differs": full["differs"],
            "not_comparable": full["not_comparable"],
            "from_checkpoint": {k: mid[k] for k in ("bitwise", "first_differing_step", "differs", "start")},
            "trained_staleness_max": max(stale),
            "trained_staleness_mean": statistics.fmean(stale),
            "samples_by_generator": _by_generator(ledger, run.job_id),
            "record": record_cost(ledger, run.job_id),
            "train_wall_s": train_s,
            "train_loadavg": load_train,
            "replay_wall_s": full["wall_s"],
            "replay_loadavg": full["loadavg"],
        }
        flags[f"replay_bitwise_{name}"] = details[name]["bitwise"]
        print(json.dumps({name: details[name]}, indent=1, default=str), flush=True)
        if name == "sync":
            with flipped_loss():
                flip = replayed(ledger, run.job_id, to_step=2)
            details["sign_flipped_loss"] = {
                "job_id": run.job_id,
                "caught": not flip["bitwise"],
                "first_differing_step": flip["first_differing_step"],
                "differs": flip["differs"],
            }
        ledger.close()
    return update_correctness(
        out, {**flags, "replay": json.loads(json.dumps({**details, "machine": machine()}, default=str))}
    )


def _by_generator(ledger: Ledger, job_id: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in ledger.samples(job_id, status="trained"):
        counts[s["generator_id"]] = counts.get(s["generator_id"], 0) + 1
    return counts
