"""`python -m bench admission`: how much generation the staleness bound throws away.

Runs the README's demo job (`asyncrl demo`: the default spec of asyncrl/demo.py, k = 1, 16 prompts x
8 samples per step) with 1, 2 and 4 generators and reads the ledger of each job: training samples
generated, trained and dropped as staler than the bound (drop reason `staleness > k`), and the
completion-length distribution (tokens) of the trained samples against all generated ones. A
dropping rule that is biased shows as trained samples shorter than generated ones (long
completions finish later and are dropped more often).

`--label` names the code under test (e.g. `before` / `after`); each run's figures are merged into
results/admission.json under that label, so a before/after pair is two invocations on two
checkouts. `stale_dropped_fraction` (top level) is the 2-generator run of the `after` label.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from asyncrl.demo import run_demo
from bench.claims import machine
from broker.ledger import Ledger


def quartiles(xs: list[int]) -> dict[str, float]:
    """min, 25/50/75 % and max, and the mean, of `xs` (empty: {})."""
    if not xs:
        return {}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [float(xs[0])] * 3
    return {
        "min": float(min(xs)),
        "p25": q[0],
        "p50": q[1],
        "p75": q[2],
        "max": float(max(xs)),
        "mean": statistics.fmean(xs),
    }


def job_figures(ledger: Ledger, job_id: str) -> dict[str, Any]:
    """Generated, trained and stale-dropped training samples of one job, and their completion lengths."""
    rows = ledger.samples(job_id, kind="train")
    trained = [r for r in rows if r["status"] == "trained"]
    dropped = [r for r in rows if r["status"] == "dropped"]
    stale = [r for r in dropped if (r["drop_reason"] or "").startswith("staleness")]
    reasons: dict[str, int] = {}
    for r in dropped:
        key = (r["drop_reason"] or "").split(":")[0][:60]
        reasons[key] = reasons.get(key, 0) + 1
    return {
        "generated": len(rows),
        "trained": len(trained),
        "dropped": len(dropped),
        "stale_dropped": len(stale),
        "stale_dropped_fraction": len(stale) / len(rows) if rows else 0.0,
        "unused_at_end": len(rows) - len(trained) - len(dropped),  # still in flight when the job ended
        "drop_reasons": reasons,
        "completion_tokens_generated": quartiles([r["num_completion_tokens"] for r in rows]),
        "completion_tokens_trained": quartiles([r["num_completion_tokens"] for r in trained]),
        "completion_tokens_stale_dropped": quartiles([r["num_completion_tokens"] for r in stale]),
        "staleness_histogram": {str(k): v for k, v in ledger.staleness_histogram(job_id).items()},
    }


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def bench_admission(
    label: str,
    steps: int = 60,
    generators: tuple[int, ...] = (1, 2, 4),
    out_dir: str = "results",
    workdir: str = "runs/bench-admission",
) -> dict[str, Any]:
    """One demo job per generator count under code `label`; merges into out_dir/admission.{json,md}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "admission.json"
    result: dict[str, Any] = {}
    for n in generators:
        wd = Path(workdir) / label
        t0 = time.monotonic()
        summary = run_demo(workdir=str(wd), steps=steps, generators=n)
        ledger = Ledger(os.environ.get("DATABASE_URL") or f"sqlite:///{wd.resolve() / 'ledger.db'}")  # as run_job
        run = {
            "job_id": summary["job_id"],
            "steps": summary["steps"],
            "wall_s": time.monotonic() - t0,
            "mean_step_s": summary["mean_step_s"],
            **job_figures(ledger, summary["job_id"]),
        }
        print(json.dumps({label: {n: run}}, indent=1), flush=True)
        # merged after every run (a before/after pair may interleave, and a cut-short bench keeps its runs)
        result = json.loads(path.read_text()) if path.exists() else {}
        entry = result.setdefault("runs", {}).setdefault(label, {"generators": {}})
        entry.update({"commit": _commit(), "steps": steps, "spec": "asyncrl demo defaults"})
        entry["generators"][str(n)] = run
        result["machine"] = machine()
        after = result["runs"].get("after", {}).get("generators", {}).get("2")
        if after is not None:
            result["stale_dropped_fraction"] = after["stale_dropped_fraction"]
        path.write_text(json.dumps(result, indent=2) + "\n")
        (out / "admission.md").write_text(markdown(result))
    return result


def _q(d: dict[str, float]) -> str:
    return f"{d['p25']:.0f} / {d['p50']:.0f} / {d['p75']:.0f}, mean {d['mean']:.2f}" if d else "-"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Samples thrown away for staleness (`python -m bench admission`)",
        "",
        "The README's demo job (default spec: k = 1, 16 prompts x 8 samples per step, 8-token "
        "completions) with 1, 2 and 4 generators; figures from each job's ledger (training samples only). "
        "Completion lengths in tokens: p25 / p50 / p75, mean.",
        "",
        "| code | generators | steps | generated | trained | stale-dropped | fraction | length generated "
        "| length trained | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, run in result.get("runs", {}).items():
        for n, r in run["generators"].items():
            lines.append(
                f"| {label} ({run['commit']}) | {n} | {r['steps']} | {r['generated']} | {r['trained']} | "
                f"{r['stale_dropped']} | {r['stale_dropped_fraction']:.3f} | "
                f"{_q(r['completion_tokens_generated'])} | {_q(r['completion_tokens_trained'])} | "
                f"{r['mean_step_s']:.3f} |"
            )
    if "stale_dropped_fraction" in result:
        lines += ["", f"`stale_dropped_fraction` (2 generators, after): {result['stale_dropped_fraction']:.4f}"]
    return "\n".join(lines) + "\n"
