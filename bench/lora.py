"""LoRA against full fine-tuning on the built-in arithmetic task (`python -m bench lora`).

Two short real jobs (broker, generator with vLLM, reward, trainer as processes; the demo's
warm-started tiny Llama and spec, sync mode so a version's swap is not hidden behind a generate
call), one full fine-tune and one LoRA (rank 8, alpha 16 on every attention and MLP projection),
interleaved in the order full, lora. From the ledger:

- the held-out curve (greedy, the demo's held-out split) of each;
- bytes per weight update: the manifest size of each published version (what every generator
  pulls at every step);
- update latency: seconds from a version's publication to the generator serving it (fetch,
  checksums, swap or adapter load, probe check, ledger write), median over versions.

LoRA's lr is 10x the full fine-tune's (the adapters start at B = 0 and move the model through a
rank-8 bottleneck; the usual practice); both lrs are in the results.
Writes results/lora.{json,md} and updates results/trainer.json's lora_update_bytes and
full_update_bytes (other keys kept).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from asyncrl.demo import prepare_model, run_job
from bench.claims import machine
from bench.suite import ours_curve
from broker.ledger import Ledger

LORA = {"rank": 8, "alpha": 16.0}
LR = {"full": 1e-4, "lora": 1e-3}


def _spec(model: Path, kind: str, steps: int, seed: int) -> dict[str, Any]:
    return {
        "name": f"lora-bench-{kind}", "model_path": str(model), "mode": "sync", "steps": steps, "seed": seed,
        "eval_every": max(1, steps // 6), "algorithm": {"lr": LR[kind]},
        "sampling": {"temperature": 1.0, "max_tokens": 8},
        **({"lora": LORA} if kind == "lora" else {}),
    }


def one_run(wd: Path, model: Path, kind: str, steps: int, seed: int) -> dict[str, Any]:
    t0 = time.time()
    run = run_job(wd / kind, _spec(model, kind, steps, seed), progress=False)
    if run.state != "finished":
        raise RuntimeError(f"{kind} job ended {run.state}: {run.error}")
    ledger = Ledger(run.db_url)
    curve, ends, breakdown = ours_curve(ledger, run.job_id, t0)
    versions = ledger.policy_versions(run.job_id)
    latency = list(ledger.swap_latencies(run.job_id).values())
    return {
        "kind": kind, "lr": LR[kind], "wall_s": run.wall_s, "curve": curve,
        "update_bytes": statistics.median(v["num_bytes"] for v in versions),
        "update_latency_s_median": statistics.median(latency), "update_latency_s_max": max(latency),
        "versions": len(versions), "step_s_median": statistics.median(
            b["t_s"] - a["t_s"] for a, b in zip(ends[1:], ends[2:], strict=False)),
        "publish_s_median": breakdown.get("publish"),
    }


def bench_lora(out_dir: str = "results", steps: int = 30, seed: int = 0) -> dict[str, Any]:
    wd = Path("runs/bench-lora").resolve()
    wd.mkdir(parents=True, exist_ok=True)
    model = prepare_model(wd, seed)
    runs = {kind: one_run(wd, model, kind, steps, seed) for kind in ("full", "lora")}
    full, lo = runs["full"], runs["lora"]
    res = {
        "lora": LORA, "steps": steps, "seed": seed, "runs": runs,
        "lora_update_bytes": lo["update_bytes"], "full_update_bytes": full["update_bytes"],
        "update_bytes_ratio": lo["update_bytes"] / full["update_bytes"],
        "update_latency_ratio": lo["update_latency_s_median"] / full["update_latency_s_median"],
        "machine": machine(), "date": time.strftime("%Y-%m-%d"),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora.json").write_text(json.dumps(res, indent=2) + "\n")
    # results/trainer.json is shared with the trainer's other figures: update this item's keys only.
    shared = out / "trainer.json"
    merged = json.loads(shared.read_text()) if shared.exists() else {}
    merged.update({k: res[k] for k in ("lora_update_bytes", "full_update_bytes", "machine", "date")})
    merged["update_bytes_unit"] = "bytes each generator pulls per weight update, median over versions (bench/lora.py)"
    shared.write_text(json.dumps(merged, indent=2) + "\n")
    lines = [
        f"# LoRA (rank {LORA['rank']}, alpha {LORA['alpha']:g}, all projections) vs full fine-tune, built-in "
        f"arithmetic task, {steps} sync steps, seed {seed}",
        "",
        "| | lr | bytes / update | update latency median (max) s | step s median | held-out start -> end | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in (full, lo):
        c = r["curve"]
        lines.append(f"| {r['kind']} | {r['lr']:g} | {r['update_bytes']:,.0f} | {r['update_latency_s_median']:.3f} "
                     f"({r['update_latency_s_max']:.3f}) | {r['step_s_median']:.2f} | "
                     f"{c[0]['reward']:.3f} -> {c[-1]['reward']:.3f} | {r['wall_s']:.0f} |")
    lines += ["", f"LoRA / full: bytes per update {res['update_bytes_ratio']:.4f}, update latency "
              f"{res['update_latency_ratio']:.2f}.", "", "Held-out curves (step: reward):", ""]
    for r in (full, lo):
        lines.append(f"- {r['kind']}: " + ", ".join(f"{p['step']}: {p['reward']:.3f}" for p in r["curve"]))
    (out / "lora.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return res
