"""Co-located vs split placement on this box: s/step of one demo-sized job three ways.

`python -m bench.colocated` runs the same job (the demo's tiny warm-started model, 16 prompts x 8
samples, 8-token completions, lr 1e-4) as split async (k=1, the default), split sync and
co-located sync (`placement: colocated`: generator and trainer take turns on every core), each
through `asyncrl.demo.run_job`, and reads s/step from the ledger as the suite's launcher section
does (median interval between train steps after the tenth), with the step's wait / train split
and each job service's CPU seconds. Writes results/colocated.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from asyncrl.demo import prepare_model, run_job
from broker.ledger import Ledger

MODES = (
    ("split_async", {"mode": "async", "max_staleness": 1}),
    ("split_sync", {"mode": "sync"}),
    ("colocated_sync", {"mode": "sync", "placement": "colocated"}),
)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def measure(wd: Path, steps: int, label: str, extra: dict[str, Any]) -> dict[str, Any]:
    model = prepare_model(wd, 0)
    spec = {
        "name": label,
        "model_path": str(model),
        "steps": steps,
        "eval_every": 0,
        "algorithm": {"lr": 1e-4},
        "sampling": {"temperature": 1.0, "max_tokens": 8},
        **extra,
    }
    db = f"sqlite:///{wd / f'{label}-{time.time_ns()}.db'}"
    os.environ["DATABASE_URL"] = db
    try:
        run = run_job(wd, spec, progress=False)
    finally:
        del os.environ["DATABASE_URL"]
    if run.state != "finished":
        raise RuntimeError(f"{label} ended {run.state}: {run.error}")
    ledger = Ledger(db)
    try:
        rows = ledger.train_steps(run.job_id)
    finally:
        ledger.close()
    ends = [r["created_at"].timestamp() for r in rows][10:]
    steady = rows[11:]
    return {
        "step_s": _median([b - a for a, b in zip(ends, ends[1:], strict=False)]),
        "wait_s": _median([r["metrics"]["time/wait_s"] for r in steady]),
        "train_s": _median([r["metrics"]["time/train_s"] for r in steady]),
        "publish_s": _median([r["metrics"]["time/publish_s"] for r in steady]),
        "reward_last10": statistics.mean(r["metrics"]["reward/mean"] for r in rows[-10:]),
        "wall_s": run.wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.colocated", description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds of the three modes")
    ap.add_argument("--workdir", type=Path, default=Path("runs/bench-colocated"))
    ap.add_argument("--out", type=Path, default=Path("results/colocated.json"))
    args = ap.parse_args(argv)
    wd = args.workdir.resolve()
    wd.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in MODES}
    for _ in range(args.repeats):
        for label, extra in MODES:
            r = measure(wd, args.steps, label, extra)
            runs[label].append(r)
            print(
                f"{label:15s} s/step {r['step_s']:.3f} (wait {r['wait_s']:.3f} train {r['train_s']:.3f} "
                f"publish {r['publish_s']:.3f}) reward {r['reward_last10']:.3f}",
                flush=True,
            )
    out: dict[str, Any] = {"cores": len(os.sched_getaffinity(0)), "steps": args.steps, "runs": runs}
    for label, _ in MODES:
        out[f"{label}_step_s"] = _median([r["step_s"] for r in runs[label] if r["step_s"]])
    a, s, c = (out[f"{m}_step_s"] for m, _ in MODES)
    out["colocated_over_split_sync"] = c / s if c and s else None
    out["colocated_over_split_async"] = c / a if c and a else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
