"""Benchmarks that back the async claims, each in one invocation on this machine.

`async`: T_gen (the engine alone on one step's batch), T_train (the trainer alone on one batch:
optimizer step + weight publish), then the whole system in sync and in async mode on the same job
and model; prints async / max(T_gen, T_train) and measured / theoretical speed-up, and where the
step time goes. The generator is pinned to the first core and the trainer (1 torch thread) to the
last, in the component runs and in the system runs alike.

`parity`: learning curves of sync vs async (k = 1, 2, 4 with AIPO, and k = 4 without importance
correction) on the synthetic task, over seeds: held-out reward per step and per second.

Results go to results/<name>.json, results/<name>.md and PNG plots.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from asyncrl.demo import prepare_model, run_job
from bench.gates import update_correctness
from broker.ledger import Ledger
from broker.ledger.rows import TrainStepRow

console = Console()


def update_trainer_results(out: Path, res: dict[str, Any], keys: tuple[str, ...], unit_key: str, unit: str) -> None:
    """results/trainer.json is shared by the trainer's benches (memory, packing, precision, LoRA):
    update `keys` of `res` (plus machine and date) and this bench's unit note only."""
    shared = out / "trainer.json"
    merged = json.loads(shared.read_text()) if shared.exists() else {}
    merged.update({k: res[k] for k in (*keys, "machine", "date")})
    merged[unit_key] = unit
    shared.write_text(json.dumps(merged, indent=2) + "\n")


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": len(os.sched_getaffinity(0)), "cpu": cpu, "gpu": None, "python": platform.python_version()}


def run_pinned(cmd: list[str], core: int | None, env: dict[str, str] | None = None) -> None:
    def preexec() -> None:
        if core is not None:
            os.sched_setaffinity(0, {core})

    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, preexec_fn=preexec, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


def split_cores() -> tuple[int | None, int | None]:
    cores = sorted(os.sched_getaffinity(0))
    return (cores[0], cores[-1]) if len(cores) > 1 else (None, None)


def _steady(steps: list[TrainStepRow], skip: int) -> list[TrainStepRow]:
    """Steps after the first `skip` (engine start-up, first weight loads) and not at an eval."""
    return steps[skip:] if len(steps) > skip + 2 else steps[1:]


def bench_async(
    workdir: str = "runs/bench",
    steps: int = 20,
    prompts: int = 16,
    n: int = 8,
    max_tokens: int = 32,
    out_dir: str = "results",
) -> dict[str, Any]:
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    model = wd / "bench-model"
    if not (model / "config.json").exists():
        # Sized so generation and training each take about a second per step on one core.
        run_pinned(
            [
                sys.executable,
                "-m",
                "asyncrl.tiny_model",
                "--out",
                str(model),
                "--layers",
                "4",
                "--hidden",
                "256",
                "--heads",
                "4",
                "--intermediate",
                "768",
            ],
            None,
        )
    gen_core, train_core = split_cores()
    shape = ["--prompts", str(prompts), "--n", str(n), "--max-tokens", str(max_tokens)]
    console.print("[bold]T_gen[/]: the engine alone on one step's batch")
    run_pinned(
        [sys.executable, "-m", "bench.t_gen", "--model", str(model), *shape, "--out", str(wd / "t_gen.json")],
        gen_core,
        {"VLLM_CPU_OMP_THREADS_BIND": str(gen_core) if gen_core is not None else "auto"},
    )
    t_gen = json.loads((wd / "t_gen.json").read_text())
    console.print("[bold]T_train[/]: the trainer alone on one batch")
    run_pinned(
        [
            sys.executable,
            "-m",
            "bench.t_train",
            "--model",
            str(model),
            *shape,
            "--threads",
            "1",
            "--out",
            str(wd / "t_train.json"),
        ],
        train_core,
    )
    t_train = json.loads((wd / "t_train.json").read_text())

    spec = {
        "model_path": str(model),
        "steps": steps,
        "group_size": n,
        "prompts_per_step": prompts,
        "eval_every": 0,
        "task": {"n_train": 300, "n_test": 16},
        "sampling": {"max_tokens": max_tokens},
        "algorithm": {"lr": 1e-6},
    }
    runs = {}
    for mode, k in (("sync", 0), ("async", 1)):
        console.print(f"[bold]system, {mode}[/] ({steps} steps)")
        run = run_job(wd, {**spec, "name": f"bench-{mode}", "mode": mode, "max_staleness": max(k, 1)}, progress=False)
        if run.state != "finished":
            raise RuntimeError(f"{mode} run ended {run.state}: {run.error}")
        runs[mode] = _steady(Ledger(run.db_url).train_steps(run.job_id), skip=3)

    def med(mode: str, key: str) -> float:
        return statistics.median(s["metrics"][key] for s in runs[mode])

    tg, tt = t_gen["t_gen_s"], t_train["t_train_s"]
    sync_s, async_s = med("sync", "time/step_s"), med("async", "time/step_s")
    bound = max(tg, tt)
    theoretical = (tg + tt) / bound
    result = {
        "t_gen_s": tg,
        "t_train_s": tt,
        "sync_step_s": sync_s,
        "async_step_s": async_s,
        "async_over_max": async_s / bound,
        "speedup": sync_s / async_s,
        "theoretical_speedup": theoretical,
        "speedup_over_theoretical": (sync_s / async_s) / theoretical,
        "breakdown": {
            mode: {k: med(mode, f"time/{k}") for k in ("wait_s", "train_s", "publish_s", "ledger_s")} for mode in runs
        },
        "generator_tokens_per_s": t_gen["tokens_per_s"],
        "shape": {
            "prompts_per_step": prompts,
            "group_size": n,
            "max_tokens": max_tokens,
            "steps": steps,
            "model": "llama 4x256, 3.5M params, fp32",
        },
        "pinning": "generator (vLLM OpenMP) on the first core, trainer (1 torch thread) on the last core",
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    _report_async(result, Path(out_dir))
    update_correctness(Path(out_dir), {"async_over_max": result["async_over_max"]})
    return result


def _report_async(r: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "async.json").write_text(json.dumps(r, indent=2))
    rows = [
        ("T_gen (engine alone, one batch)", f"{r['t_gen_s']:.3f} s", ""),
        ("T_train (trainer alone, one batch)", f"{r['t_train_s']:.3f} s", ""),
        ("sync step (steady state)", f"{r['sync_step_s']:.3f} s", ""),
        ("async step, k=1 (steady state)", f"{r['async_step_s']:.3f} s", ""),
        ("async / max(T_gen, T_train)", f"{r['async_over_max']:.3f}", "target <= 1.10"),
        ("measured speed-up sync/async", f"{r['speedup']:.3f}", ""),
        ("theoretical (T_gen+T_train)/max", f"{r['theoretical_speedup']:.3f}", ""),
        ("measured / theoretical", f"{r['speedup_over_theoretical']:.3f}", "target >= 0.90"),
    ]
    table = Table(title="async vs sync")
    for col in ("figure", "value", "target"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    bd = Table(title="where a trainer step's time goes (median s)")
    for col in ("mode", "waiting for data", "train", "publish weights", "ledger"):
        bd.add_column(col)
    for mode, b in r["breakdown"].items():
        bd.add_row(mode, *(f"{b[k]:.3f}" for k in ("wait_s", "train_s", "publish_s", "ledger_s")))
    console.print(bd)
    md = [
        "| figure | value | target |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
        "| mode | waiting for data (s) | train (s) | publish weights (s) | ledger (s) |",
        "|---|---|---|---|---|",
        *[
            f"| {m} | " + " | ".join(f"{b[k]:.3f}" for k in ("wait_s", "train_s", "publish_s", "ledger_s")) + " |"
            for m, b in r["breakdown"].items()
        ],
        "",
        f"Machine: {r['machine']}; {r['pinning']}; {r['date']}.",
    ]
    (out / "async.md").write_text("\n".join(md) + "\n")


def bench_swap(workdir: str = "runs/swap", steps: int = 12, generators: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    """Seconds from the end of a trainer step (its version published) until every generator
    serves that version, on the demo model, for 1 and 2 generators (median over versions)."""
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    model = prepare_model(wd, 0)
    out: dict[str, Any] = {}
    for g in generators:
        console.print(f"[bold]swap latency[/], {g} generator(s)")
        spec = {
            "name": f"swap-{g}",
            "model_path": str(model),
            "steps": steps,
            "eval_every": 0,
            "algorithm": {"lr": 1e-4},
            "sampling": {"max_tokens": 8},
        }
        run = run_job(wd, spec, generators=g, progress=False)
        if run.state != "finished":
            raise RuntimeError(f"swap run with {g} generators ended {run.state}: {run.error}")
        lat = [dt for v, dt in Ledger(run.db_url).swap_latencies(run.job_id).items() if v > 0]
        out[str(g)] = {"median_s": statistics.median(lat), "max_s": max(lat), "versions": len(lat)}
    return out


PARITY_MODES: dict[str, dict[str, Any]] = {
    "sync": {"mode": "sync"},
    "async_k1": {"mode": "async", "max_staleness": 1},
    "async_k2": {"mode": "async", "max_staleness": 2},
    "async_k4": {"mode": "async", "max_staleness": 4},
    "async_k4_no_is": {"mode": "async", "max_staleness": 4, "algorithm": {"lr": 1e-4, "loss": "reinforce"}},
}


def bench_parity(
    workdir: str = "runs/parity",
    steps: int = 40,
    seeds: tuple[int, ...] = (0, 1, 2),
    modes: tuple[str, ...] = tuple(PARITY_MODES),
    out_dir: str = "results",
) -> dict[str, Any]:
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for seed in seeds:
        model = prepare_model(wd / f"seed{seed}", seed)
        for mode in modes:
            console.print(f"[bold]parity[/] {mode} seed {seed}")
            spec = {
                "name": f"parity-{mode}-{seed}",
                "model_path": str(model),
                "steps": steps,
                "seed": seed,
                "eval_every": 5,
                "algorithm": {"lr": 1e-4},
                "sampling": {"max_tokens": 8},
                **PARITY_MODES[mode],
            }
            run = run_job(wd / f"seed{seed}", spec, progress=False)
            ledger = Ledger(run.db_url)
            evals = [e for e in ledger.evals(run.job_id, source="pipeline") if e["name"] == "held_out"]
            steps_rows = ledger.train_steps(run.job_id)
            if run.state != "finished" or not steps_rows:
                raise RuntimeError(f"parity run {mode} seed {seed} ended {run.state}: {run.error}")
            start = steps_rows[0]["created_at"]
            curves[mode].append(
                {
                    "seed": seed,
                    "state": run.state,
                    "held_out": [(e["step"], e["reward_mean"]) for e in evals],
                    "held_out_time_s": [((e["created_at"] - start).total_seconds(), e["reward_mean"]) for e in evals],
                    "wall_s_to_final": (steps_rows[-1]["created_at"] - start).total_seconds(),
                }
            )
    result: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "steps": steps,
        "seeds": list(seeds),
    }
    for mode, runs in curves.items():
        finals = [r["held_out"][-1][1] for r in runs if r["held_out"]]
        result[mode] = {
            "final_reward_mean": statistics.mean(finals) if finals else None,
            "final_reward_std": statistics.pstdev(finals) if len(finals) > 1 else 0.0,
            "wall_s_to_final": statistics.mean(r["wall_s_to_final"] for r in runs if r["wall_s_to_final"]),
            "seeds": [r["seed"] for r in runs],
            "runs": runs,
        }
    _report_parity(result, modes, Path(out_dir))
    return result


def _report_parity(r: dict[str, Any], modes: tuple[str, ...], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps(r, indent=2, default=str))
    table = Table(title=f"learning parity ({r['steps']} steps, seeds {r['seeds']})")
    for col in ("mode", "final held-out (mean ± std)", "wall s to final step"):
        table.add_column(col)
    md = ["| mode | final held-out reward (mean ± std) | wall s to final step |", "|---|---|---|"]
    for m in modes:
        row = (m, f"{r[m]['final_reward_mean']:.3f} ± {r[m]['final_reward_std']:.3f}", f"{r[m]['wall_s_to_final']:.1f}")
        table.add_row(*row)
        md.append(f"| {row[0]} | {row[1]} | {row[2]} |")
    console.print(table)
    md.append(f"\nMachine: {r['machine']}; {r['date']}.")
    (out / "parity.md").write_text("\n".join(md) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for m in modes:
        for i, run in enumerate(r[m]["runs"]):
            xs, ys = zip(*run["held_out"], strict=True) if run["held_out"] else ((), ())
            ts, ys2 = zip(*run["held_out_time_s"], strict=True) if run["held_out_time_s"] else ((), ())
            color = f"C{modes.index(m)}"
            a1.plot(xs, ys, color=color, alpha=0.7, label=m if i == 0 else None)
            a2.plot(ts, ys2, color=color, alpha=0.7, label=m if i == 0 else None)
    a1.set_xlabel("trainer step")
    a2.set_xlabel("seconds since the first step")
    for a in (a1, a2):
        a.set_ylabel("held-out reward (greedy)")
        a.set_ylim(-0.02, 1.02)
        a.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "parity.png", dpi=100)
    plt.close(fig)
