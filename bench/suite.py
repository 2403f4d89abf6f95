"""The performance suite: time-to-reward against TRL, generator efficiency, broker and ledger
overhead, and scaling, measured in one run on this machine (`asyncrl bench suite`).

Sections (each a function below; results/suite.json holds them under these keys):

- `time_to_reward` (regime a, short completions) and `time_to_reward_long` (regime b,
  generation-dominated): ours beside TRL's GRPOTrainer (a virtual environment of its own,
  bench/peers/trl_grpo.py) on a task this project was not tuned on, given as a user gives one
  (a JSONL file, a reward file outside the project): (a) bench.own_task's two-digit add/sub,
  one-line answers, stop "\n", 8 tokens; (b) bench.scratchpad's chains written out one operation
  per line, completions of 132-195 tokens, 224 at most, the reward checking the last line. Same
  warm-started model, split, shape (8 prompts x 8 samples, lr 1e-4), temperature and length
  limits on both sides. Ours: async (the job spec a user writes, defaults for the rest), sync,
  and co-located (`"placement": "colocated", "mode": "sync"`, regime a). The target is TRL's
  final held-out reward; a policy's point on the curve is the end of the training step that
  produced it, in seconds since launch (start-up included; `train_s_to_target` leaves it out);
  TRL's evaluation time is taken off its clock, ours runs inside the pipeline and stays on ours.
  Each section has ours' per-step breakdown (the trainer's `time/*` metrics).
- `stale_drops`: stale-dropped / generated samples of a 2-generator job with the default spec.
- `generator`: tokens/s of the generator inside a running job (ledger rows: completion tokens
  per generate batch over the wall time between batches; the Prometheus counters give the
  engine-only rate) divided by tokens/s of the engine alone (bench.t_gen) on the same
  model, settings, batch and core. The job is sized so that the generator is the bottleneck.
- `broker`: bench.broker_overhead (one hop with codec + ledger vs raw XADD and redis-benchmark).
- `scaling`: seconds per step against generation length, group size and model size.
- `peer_scaling`: TRL's seconds per step at the same generation lengths and model (no target:
  a random-init model learns nothing; this is the cost of a step).
- `regime_scaling`: TRL / ours seconds per step at each regime's shape, per model size.
- `launcher`: s/step of a job started the README's way against the hand-pinned one.
- `gpu`: deploy/gpu_bench.py is the CUDA variant; recorded as unrun unless it was run.

Presets: `ci` (the smallest complete result, what tests/bench/test_suite.py runs), `quick`
(the default, well under 10 minutes once the TRL environment exists) and `full` (3 seeds,
longer runs; the committed results/suite.*).
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from asyncrl.demo import prepare_model, run_job
from bench import own_task
from bench.broker_overhead import bench_broker
from bench.claims import machine, run_pinned, split_cores
from bench.runs import ours_curve, run_finished, run_trl, trl_python, trl_task_run
from broker.ledger import Ledger
from broker.ledger.rows import SampleRow
from shared.datasets import TaskSpec, load_task

console = Console()

# The shape of the cost-of-a-step comparison with TRL (peer_scaling): 16 prompts x 8 samples.
TTR_SPEC: dict[str, Any] = {
    "group_size": 8,
    "prompts_per_step": 16,
    "algorithm": {"lr": 1e-4, "micro_batch_size": 64},
    "sampling": {"temperature": 1.0},
    "task": {"n_train": 300, "n_test": 100},
}
# (layers, hidden, heads, intermediate): random-init models for the cost-of-a-step sections.
MODELS: dict[str, tuple[int, int, int, int]] = {
    "2x128": (2, 128, 4, 256),
    "4x256": (4, 256, 4, 768),
    "6x384": (6, 384, 6, 1024),
}


@dataclass(frozen=True)
class Preset:
    ttr_steps: int  # regime (a)
    eval_every: int
    seeds: tuple[int, ...]
    scaling_steps: int
    gen_steps: int
    broker_samples: int
    peer_steps: int
    long_steps: int  # regime (b)
    long_eval_every: int
    long_warm_steps: int  # SFT steps of regime (b)'s warm start
    short_warm_steps: int | None  # SFT steps of regime (a)'s (None: bench.own_task's, its default)
    stale_steps: int  # the 2-generator job of stale_dropped_fraction
    gen_lengths: tuple[int, ...] = (16, 32, 64, 128, 192)
    # regime_scaling: TRL / ours s per step at each regime's shape, per model (empty: skipped)
    regime_models: tuple[str, ...] = ()
    sync_modes: bool = True  # ours in sync mode too (besides async and colocated)
    launcher_steps: int = 40  # each of the launcher-vs-pinned jobs


PRESETS: dict[str, Preset] = {
    "ci": Preset(
        ttr_steps=6,
        eval_every=2,
        seeds=(0,),
        scaling_steps=4,
        gen_steps=6,
        broker_samples=2_000,
        peer_steps=4,
        long_steps=3,
        long_eval_every=3,
        long_warm_steps=60,
        short_warm_steps=300,
        stale_steps=6,
        gen_lengths=(16, 32, 64),
        sync_modes=False,
        launcher_steps=16,
    ),
    "quick": Preset(
        ttr_steps=20,
        eval_every=2,
        seeds=(0,),
        scaling_steps=6,
        gen_steps=10,
        broker_samples=20_000,
        peer_steps=6,
        long_steps=10,
        long_eval_every=2,
        long_warm_steps=300,
        short_warm_steps=None,
        stale_steps=20,
        regime_models=("4x256",),
    ),
    "full": Preset(
        ttr_steps=40,
        eval_every=2,
        seeds=(0, 1, 2),
        scaling_steps=12,
        gen_steps=16,
        broker_samples=100_000,
        peer_steps=10,
        long_steps=20,
        long_eval_every=2,
        long_warm_steps=1000,
        short_warm_steps=None,
        stale_steps=60,
        regime_models=("2x128", "4x256", "6x384"),
        launcher_steps=48,
    ),
}


# --- helpers -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(wd: Path, name: str) -> Path:
    """A random-init model of the MODELS shape `name` (cached)."""
    layers, hidden, heads, inter = MODELS[name]
    out = wd / f"model-{name}"
    if not (out / "config.json").exists():
        run_pinned(
            [
                sys.executable,
                "-m",
                "asyncrl.tiny_model",
                "--out",
                str(out),
                "--layers",
                str(layers),
                "--hidden",
                str(hidden),
                "--heads",
                str(heads),
                "--intermediate",
                str(inter),
            ],
            None,
        )
    return out


def _first_at(curve: list[dict[str, float]], target: float) -> dict[str, float] | None:
    return next((p for p in curve if p["reward"] >= target), None)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# --- TRL's environment ---------------------------------------------------------------------


def _trl(
    py: Path,
    wd: Path,
    model: Path,
    seed: int,
    *,
    steps: int,
    eval_every: int,
    max_tokens: int,
    evaluate: bool = True,
    prompts_per_step: int = TTR_SPEC["prompts_per_step"],
) -> dict[str, Any]:
    """One TRL GRPOTrainer run on the built-in arithmetic task (both cores, 2 torch threads): the
    cost of a step; its result JSON."""
    train, test = load_task(TaskSpec(**TTR_SPEC["task"]), seed)
    return run_trl(
        py,
        wd / f"trl-{seed}-{max_tokens}-{time.time_ns()}",
        {
            "model_path": str(model),
            "seed": seed,
            "steps": steps,
            "train": [{"prompt": p.prompt, "answer": p.answer} for p in train],
            "test": [{"prompt": p.prompt, "answer": p.answer} for p in test],
            "group_size": TTR_SPEC["group_size"],
            "prompts_per_step": prompts_per_step,
            "micro_batch_size": TTR_SPEC["algorithm"]["micro_batch_size"],
            "lr": TTR_SPEC["algorithm"]["lr"],
            "temperature": TTR_SPEC["sampling"]["temperature"],
            "max_tokens": max_tokens,
            "eval_every": eval_every,
            "evaluate": evaluate,
        },
    )


# --- 1. time to reward, two regimes --------------------------------------------------------


def _ttr_summary(
    curve: list[dict[str, float]], step_ends: list[dict[str, float]], target: float | None, **extra: Any
) -> dict[str, Any]:
    """Time to target from a held-out curve and the end time of every step (both from launch)."""
    step_s = _median([b["t_s"] - a["t_s"] for a, b in zip(step_ends[1:], step_ends[2:], strict=False)])
    hit = _first_at(curve, target - 1e-9) if target is not None else None
    startup = step_ends[0]["t_s"] - (step_s or 0.0) if step_ends else None
    return {
        "curve": curve,
        "step_s_median": step_s,
        "startup_s": startup,
        "time_to_target_s": hit["t_s"] if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        # The same, less the start-up (engines, processes, imports): training time alone.
        "train_s_to_target": max(0.0, hit["t_s"] - startup) if hit and startup is not None else None,
        "final_reward": curve[-1]["reward"] if curve else None,
        **extra,
    }


@dataclass(frozen=True)
class Regime:
    """One of the suite's two time-to-reward regimes: a task file, a reward file outside the
    project, a warm-started model, and the sampling limits both sides get."""

    name: str
    about: str
    data: Path
    reward: Path
    model: Path
    task: dict[str, Any]
    shape: dict[str, Any]  # group_size, prompts_per_step, lr, max_tokens, temperature
    stop: list[str]

    def spec(self, job_mode: str, seed: int, steps: int, eval_every: int, **extra: Any) -> dict[str, Any]:
        """The job spec a user writes for this task (bench.own_task.own_spec's shape): the
        task, the reward file, the sampling limits; everything else is the defaults."""
        s = own_task.own_spec(self.model, self.data, self.reward, job_mode, 1, seed, steps, eval_every)
        s.update(
            name=f"suite-{self.name}-{extra.get('placement', job_mode)}-s{seed}-{time.time_ns()}",
            group_size=self.shape["group_size"],
            prompts_per_step=self.shape["prompts_per_step"],
            task=self.task,
            algorithm={"lr": self.shape["lr"]},
            sampling={
                "temperature": self.shape["temperature"],
                "max_tokens": self.shape["max_tokens"],
                **({"stop": self.stop} if self.stop else {}),
            },
        )
        return {**s, **extra}


def regime_short(wd: Path, warm_steps: int | None = None) -> Regime:
    """Regime (a): bench.own_task's task (two-digit add/sub JSONL, the user's reward file, stop
    "\\n"), its warm-started 4-layer model, its shape (8 prompts x 8 samples, 8 tokens)."""
    data, reward = own_task.write_task(wd)
    return Regime(
        "short",
        "two-digit add/sub from a user's JSONL file (bench.own_task), one-line answers",
        data,
        reward,
        own_task.prepare_own_model(wd, data, warm_steps),
        own_task.task_section(data),
        dict(own_task.SHAPE),
        list(own_task.STOP),
    )


def regime_long(wd: Path, warm_steps: int) -> Regime:
    """Regime (b): bench.scratchpad's worked chains (completions of 132-195 tokens), the 2 x 128
    tiny model after a short SFT warm start on the worked format."""
    from bench import scratchpad

    data, reward = scratchpad.write_task(wd)
    return Regime(
        "long",
        "chains of 11-13 single-digit +/- written out one operation per line (bench.scratchpad)",
        data,
        reward,
        scratchpad.prepare_model(wd, data, warm_steps),
        scratchpad.task_section(data),
        {"group_size": 8, "prompts_per_step": 8, "lr": 1e-4, "max_tokens": scratchpad.MAX_TOKENS, "temperature": 1.0},
        [],
    )


def _ours_run(wd: Path, spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """One job of ours; its curve, step ends, breakdown and completion lengths (or the error)."""
    try:
        ledger, job_id, t0 = run_finished(wd, spec, env)
    except RuntimeError as exc:
        return {"error": str(exc)[-2000:]}
    try:
        curve, ends, breakdown = ours_curve(ledger, job_id, t0)
        lengths = [r["num_completion_tokens"] for r in ledger.samples(job_id, kind="train")]
    finally:
        ledger.close()
    return {
        "job_id": job_id,
        "curve": curve,
        "step_ends": ends,
        "breakdown": breakdown,
        "completion_tokens_median": _median([float(x) for x in lengths]),
    }


def _summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rs if "error" not in r]
    hits = [r["time_to_target_s"] for r in ok]
    med = {
        k: _median([r[k] for r in ok if r.get(k) is not None])
        for k in (
            "train_s_to_target",
            "steps_to_target",
            "startup_s",
            "step_s_median",
            "final_reward",
            "completion_tokens_median",
        )
    }
    return {
        "reached": sum(h is not None for h in hits),
        "runs": len(ok),
        "errors": [r["error"] for r in rs if "error" in r],
        # A run that never reached the target counts as the whole run (ours is then a lower bound).
        "time_to_target_s": _median(
            [h if h is not None else r["curve"][-1]["t_s"] for h, r in zip(hits, ok, strict=True) if r["curve"]]
        ),
        **med,
    }


def time_to_reward(
    wd: Path,
    p: Preset,
    trl_py: Path | None,
    regime: Regime,
    modes: tuple[str, ...],
    trl_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Ours in `modes` (async: the default spec; sync; colocated: `placement: colocated`, sync)
    against TRL on one regime. The target is TRL's final held-out reward (its seed-mean curve's
    last point); times are from launch (start-up included) and, under train_s_to_target, without
    the start-up."""
    steps, every = (p.ttr_steps, p.eval_every) if regime.name == "short" else (p.long_steps, p.long_eval_every)
    extra = {"colocated": {"placement": "colocated", "mode": "sync"}}
    runs: dict[str, list[dict[str, Any]]] = {f"ours_{m}": [] for m in modes} | {"trl": []}
    for seed in p.seeds:
        if trl_py is not None:
            console.print(f"[bold]time to reward ({regime.name})[/]: TRL GRPOTrainer, seed {seed}")
            r = trl_task_run(
                trl_py,
                wd / f"trl-{regime.name}-{seed}-{time.time_ns()}",
                regime.model,
                regime.task,
                regime.reward,
                regime.shape,
                regime.stop,
                seed,
                steps,
                every,
                **(trl_extra or {}),
            )
            runs["trl"].append(
                {
                    "seed": seed,
                    "curve": r["curve"],
                    "eval_s_total": r["eval_s_total"],
                    "step_ends": [{"step": x["step"], "t_s": x["t_s"]} for x in r["train_reward"]],
                    "completion_tokens_median": r.get("completion_tokens_median"),
                    "versions": {k: r[k] for k in ("trl_version", "transformers_version", "torch_version")},
                    "generation": r["generation"],
                }
            )
        for m in modes:
            if any("error" in x for x in runs[f"ours_{m}"]):
                continue  # it failed on an earlier seed (a spec the job API refuses, say): once is enough
            console.print(f"[bold]time to reward ({regime.name})[/]: ours, {m}, seed {seed}")
            spec = regime.spec("sync" if m == "sync" else "async", seed, steps, every, **extra.get(m, {}))
            runs[f"ours_{m}"].append({"seed": seed, **_ours_run(wd, spec)})
    trl_mean = own_task.mean_curve([r["curve"] for r in runs["trl"]])
    target = trl_mean[-1]["reward"] if trl_mean else None
    for rs in runs.values():
        for i, r in enumerate(rs):
            if "error" not in r:
                rs[i] = {**r, **_ttr_summary(r["curve"], r["step_ends"], target)}
    summary = {name: _summary(rs) for name, rs in runs.items()}

    def ratio(key: str, ours: str) -> float | None:
        a, b = summary["trl"].get(key), summary[ours].get(key)
        return a / b if a and b else None

    names = list(modes)
    return {
        "regime": regime.name,
        "about": regime.about,
        "target": target,
        "target_is": "TRL's final held-out reward",
        "seeds": list(p.seeds),
        "steps": steps,
        "eval_every": every,
        "model": str(regime.model.name),
        "protocol": f"one greedy completion (max_tokens {regime.shape['max_tokens']}) per held-out problem, the "
        "regime's reward file; after step 0 and every eval_every steps; a point's time is the end of the "
        "step that produced the policy, seconds since launch; TRL's evaluation time is taken off its clock",
        "shape": regime.shape,
        "stop": regime.stop,
        "runs": runs,
        "summary": summary,
        "speedup_vs_trl": {m: ratio("time_to_target_s", f"ours_{m}") for m in names},
        "speedup_vs_trl_training_only": {m: ratio("train_s_to_target", f"ours_{m}") for m in names},
        "step_speed_vs_trl": {m: ratio("step_s_median", f"ours_{m}") for m in names},
        # The per-step breakdown of ours (median over seeds of each run's steady-state medians).
        "breakdown": {
            m: {
                k: _median(
                    [
                        r["breakdown"][k]
                        for r in runs[f"ours_{m}"]
                        if "error" not in r and r["breakdown"].get(k) is not None
                    ]
                )
                for k in sorted({k for r in runs[f"ours_{m}"] if "error" not in r for k in r["breakdown"]})
            }
            for m in names
        },
    }


def stale_dropped(wd: Path, steps: int) -> dict[str, Any]:
    """Samples dropped as staler than the bound over samples generated, in a job with two
    generators and the default spec (the demo's model; name, model and steps, nothing else)."""
    model = prepare_model(wd, 0)
    console.print("[bold]stale drops[/]: 2 generators, default spec")
    run = run_job(
        wd,
        {"name": f"suite-stale-{time.time_ns()}", "model_path": str(model), "steps": steps},
        generators=2,
        progress=False,
    )
    if run.state != "finished":
        return {"error": f"job ended {run.state}: {run.error}", "fraction": None}
    ledger = Ledger(run.db_url)
    try:
        generated = ledger.count_samples(run.job_id, kind="train")
        reasons: dict[str, int] = {}
        for r in ledger.samples(run.job_id, status="dropped", kind="train"):
            reasons[r["drop_reason"] or "?"] = reasons.get(r["drop_reason"] or "?", 0) + 1
    finally:
        ledger.close()
    stale = sum(n for why, n in reasons.items() if why.startswith("staleness"))
    return {
        "job_id": run.job_id,
        "generators": 2,
        "steps": steps,
        "generated": generated,
        "stale_dropped": stale,
        "dropped_by_reason": reasons,
        "fraction": stale / generated if generated else None,
    }


# --- 2. generator efficiency ---------------------------------------------------------------


class _Scraper:
    """Polls a Prometheus endpoint in a thread; keeps the last values of the series it wants."""

    def __init__(self, url: str, names: tuple[str, ...]):
        self.url, self.names = url, names
        self.values: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                text = httpx.get(self.url, timeout=1.0).text
            except httpx.HTTPError:
                continue
            for name in self.names:
                m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
                if m:
                    self.values[name] = float(m.group(1))

    def __enter__(self) -> _Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)


def batch_rates(rows: list[SampleRow], skip: int = 2) -> tuple[float | None, int]:
    """Tokens/s over the wall time between generate batches (rows of one batch share a stamp)."""
    batches: dict[float, int] = {}
    for r in rows:
        t = round(r["created_at"].timestamp(), 3)
        batches[t] = batches.get(t, 0) + r["num_completion_tokens"]
    ts = sorted(batches)[skip:]
    if len(ts) < 3:
        return None, len(ts)
    # Tokens of every batch after the first, over the time from the first batch to the last.
    return sum(batches[t] for t in ts[1:]) / (ts[-1] - ts[0]), len(ts)


def generator_efficiency(wd: Path, p: Preset) -> dict[str, Any]:
    model = _model(wd, "2x128")
    max_tokens, prompts, n = 64, 16, 8
    gen_core, _ = split_cores()
    console.print("[bold]generator efficiency[/]: the engine alone")
    run_pinned(
        [
            sys.executable,
            "-m",
            "bench.t_gen",
            "--model",
            str(model),
            "--prompts",
            str(prompts),
            "--n",
            str(n),
            "--max-tokens",
            str(max_tokens),
            "--reps",
            "5",
            "--out",
            str(wd / "gen_alone.json"),
        ],
        gen_core,
        {"VLLM_CPU_OMP_THREADS_BIND": str(gen_core) if gen_core is not None else "auto"},
    )
    alone = json.loads((wd / "gen_alone.json").read_text())
    loaded = _engine_alone_beside_load(wd, model, prompts, n, max_tokens, gen_core)
    console.print("[bold]generator efficiency[/]: the generator inside a running job")
    port = _free_port()
    spec = {
        "name": "suite-generator",
        "model_path": str(model),
        "steps": p.gen_steps,
        "eval_every": 0,
        "group_size": n,
        "prompts_per_step": prompts,
        "generation_batch": prompts,
        "max_staleness": 1,
        "algorithm": {"lr": 1e-6},
        "sampling": {"temperature": 1.0, "max_tokens": max_tokens},
    }
    names = (
        "asyncrl_generator_tokens_total",
        "asyncrl_generator_generate_seconds_sum",
        "asyncrl_generator_generate_seconds_count",
    )
    with _Scraper(f"http://127.0.0.1:{port}/metrics", names) as scraper:
        ledger, job_id, _ = run_finished(wd, spec, {"GEN_METRICS_PORT": str(port)})
    rate, batches = batch_rates(ledger.samples(job_id, kind="train"))
    prom = scraper.values
    steps = ledger.train_steps(job_id)[2:]
    engine_rate = (
        prom["asyncrl_generator_tokens_total"] / prom["asyncrl_generator_generate_seconds_sum"]
        if prom.get("asyncrl_generator_generate_seconds_sum")
        else None
    )
    return {
        "shape": {"model": "llama 2x128 random init", "prompts": prompts, "group_size": n, "max_tokens": max_tokens},
        "standalone_tokens_per_s": alone["tokens_per_s"],
        "in_system_tokens_per_s": rate,
        "batches_measured": batches,
        "efficiency": rate / alone["tokens_per_s"] if rate else None,
        "engine_only_tokens_per_s": engine_rate,
        # Control: the engine alone again, while a one-thread torch training loop (the trainer's
        # kind of load) runs on the other core. What it loses is what the hardware takes from
        # the generator when the trainer computes beside it, not the service's own overhead.
        "standalone_beside_load_tokens_per_s": loaded,
        "efficiency_vs_loaded_alone": rate / loaded if rate and loaded else None,
        "engine_only_efficiency": engine_rate / alone["tokens_per_s"] if engine_rate else None,
        "prometheus": prom,
        # Near 1: the trainer waited for data, so the generator set the pace.
        "trainer_wait_share": _median([s["metrics"]["time/wait_s"] / s["metrics"]["time/step_s"] for s in steps]),
        "step_s_median": _median([s["metrics"]["time/step_s"] for s in steps]),
        "job_id": job_id,
    }


_LOAD = """
import torch
torch.set_num_threads(1)
m = torch.nn.Sequential(torch.nn.Linear(256, 768), torch.nn.SiLU(), torch.nn.Linear(768, 256))
opt = torch.optim.AdamW(m.parameters())
x = torch.randn(2048, 256)
while True:
    opt.zero_grad()
    m(x).square().mean().backward()
    opt.step()
"""


def _engine_alone_beside_load(
    wd: Path, model: Path, prompts: int, n: int, max_tokens: int, gen_core: int | None
) -> float | None:
    """Engine-alone tokens/s while a torch training loop keeps the other core busy (None on 1 core)."""
    cores = sorted(os.sched_getaffinity(0))
    if gen_core is None or len(cores) < 2:
        return None
    other = cores[-1]
    console.print("[bold]generator efficiency[/]: the engine alone, a training loop on the other core")
    load = subprocess.Popen([sys.executable, "-c", _LOAD], preexec_fn=lambda: os.sched_setaffinity(0, {other}))
    try:
        run_pinned(
            [
                sys.executable,
                "-m",
                "bench.t_gen",
                "--model",
                str(model),
                "--prompts",
                str(prompts),
                "--n",
                str(n),
                "--max-tokens",
                str(max_tokens),
                "--reps",
                "5",
                "--out",
                str(wd / "gen_loaded.json"),
            ],
            gen_core,
            {"VLLM_CPU_OMP_THREADS_BIND": str(gen_core)},
        )
    finally:
        load.kill()
        load.wait()
    return float(json.loads((wd / "gen_loaded.json").read_text())["tokens_per_s"])


# --- 4. scaling ----------------------------------------------------------------------------


def _step_cost(wd: Path, model_name: str, max_tokens: int, group: int, steps: int, prompts: int = 16) -> dict[str, Any]:
    model = _model(wd, model_name)
    spec = {
        "name": f"suite-scale-{model_name}-{max_tokens}-{group}-{prompts}",
        "model_path": str(model),
        "steps": steps,
        "eval_every": 0,
        "group_size": group,
        "prompts_per_step": prompts,
        "generation_batch": prompts,
        "max_staleness": 1,
        "algorithm": {"lr": 1e-6},
        "sampling": {"temperature": 1.0, "max_tokens": max_tokens},
    }
    ledger, job_id, _ = run_finished(wd, spec)
    rows = ledger.train_steps(job_id)
    steady = rows[2:] if len(rows) > 3 else rows[1:]
    med = {k: _median([s["metrics"][f"time/{k}"] for s in steady]) for k in ("step_s", "wait_s", "train_s")}
    return {
        "model": model_name,
        "max_tokens": max_tokens,
        "group_size": group,
        "steps": len(rows),
        "step_s": med["step_s"],
        "wait_s": med["wait_s"],
        "train_s": med["train_s"],
        "tokens_per_step": _median([s["metrics"]["tokens"] for s in steady]),
    }


def scaling(wd: Path, p: Preset) -> dict[str, Any]:
    center = ("2x128", 32, 8)
    cache: dict[tuple[str, int, int], dict[str, Any]] = {}

    def point(m: str, t: int, g: int) -> dict[str, Any]:
        if (m, t, g) not in cache:
            console.print(f"[bold]scaling[/]: model {m}, {t} tokens, groups of {g}")
            cache[(m, t, g)] = _step_cost(wd, m, t, g, p.scaling_steps)
        return cache[(m, t, g)]

    out = {
        "gen_length": [point(center[0], t, center[2]) for t in p.gen_lengths],
        "group_size": [point(center[0], center[1], g) for g in (4, 8, 16)],
        "model_size": [point(m, center[1], center[2]) for m in MODELS],
        "params": {m: _params(*MODELS[m]) for m in MODELS},
        "note": "random-init models (completions run to max_tokens), lr 1e-6, async k=1, 16 prompts/step",
    }
    return out


def _params(layers: int, hidden: int, heads: int, inter: int, vocab: int = 104) -> int:
    """Parameter count of the tiny_model Llama shape (untied embeddings, RMSNorm)."""
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def peer_scaling(wd: Path, p: Preset, trl_py: Path, ours: list[dict[str, Any]]) -> dict[str, Any]:
    model = _model(wd, "2x128")
    rows = []
    for pt in ours:
        t = pt["max_tokens"]
        console.print(f"[bold]peer scaling[/]: TRL, {t} tokens")
        trl_s = _trl_step_s(
            _trl(trl_py, wd, model, 0, steps=p.peer_steps, eval_every=p.peer_steps, max_tokens=t, evaluate=False)
        )
        rows.append(
            {
                "max_tokens": t,
                "ours_step_s": pt["step_s"],
                "trl_step_s": trl_s,
                "trl_over_ours": trl_s / pt["step_s"] if trl_s and pt["step_s"] else None,
            }
        )
    return {"gen_length": rows, "model": "llama 2x128 random init", "group_size": 8, "prompts_per_step": 16}


def _trl_step_s(r: dict[str, Any]) -> float | None:
    ends = [x["t_s"] for x in r["train_reward"]]
    return _median([b - a for a, b in zip(ends[1:], ends[2:], strict=False)])


def regime_scaling(wd: Path, p: Preset, trl_py: Path) -> dict[str, Any]:
    """TRL / ours seconds per step at each regime's shape (8 prompts x 8 samples; 8 tokens for
    (a), the scratchpad's 224 for (b)) for each model of `p.regime_models`: how the ratio moves
    with completion length and model size. Random-init models, so completions run to the limit."""
    rows = []
    for m in p.regime_models:
        for regime, t in (("short", 8), ("long", 224)):
            console.print(f"[bold]regime scaling[/]: model {m}, {t} tokens, ours and TRL")
            ours = _step_cost(wd, m, t, 8, p.scaling_steps, prompts=8)
            trl_s = _trl_step_s(
                _trl(
                    trl_py,
                    wd,
                    _model(wd, m),
                    0,
                    steps=p.peer_steps,
                    eval_every=p.peer_steps,
                    max_tokens=t,
                    evaluate=False,
                    prompts_per_step=8,
                )
            )
            rows.append(
                {
                    "regime": regime,
                    "model": m,
                    "params": _params(*MODELS[m]),
                    "max_tokens": t,
                    "ours_step_s": ours["step_s"],
                    "ours_wait_s": ours["wait_s"],
                    "ours_train_s": ours["train_s"],
                    "trl_step_s": trl_s,
                    "trl_over_ours": trl_s / ours["step_s"] if trl_s and ours["step_s"] else None,
                }
            )
    return {"points": rows, "group_size": 8, "prompts_per_step": 8, "note": "random init, lr 1e-6, async k=1"}


# --- launcher placement --------------------------------------------------------------------


def launcher_vs_pinned(wd: Path, steps: int = 80) -> dict[str, Any]:
    """Seconds per step of one job started the README's way (`python -m asyncrl.launch --spec`,
    its default placement, and with --no-placement) against the same job through run_job, which
    pins the generator to the first core and the trainer to the last by hand. Median over the
    steps after the tenth (steady state)."""
    model = prepare_model(wd, 0)

    def spec(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "model_path": str(model),
            "mode": "async",
            "max_staleness": 1,
            "steps": steps,
            "eval_every": 0,
            "algorithm": {"lr": 1e-4},
            "sampling": {"temperature": 1.0, "max_tokens": 8},
        }

    def step_s(ledger: Ledger, job_id: str) -> float | None:
        ends = [s["created_at"].timestamp() for s in ledger.train_steps(job_id)][10:]
        return _median([b - a for a, b in zip(ends, ends[1:], strict=False)])

    out: dict[str, Any] = {"steps": steps}
    for label, extra in (("launcher", []), ("launcher_no_placement", ["--no-placement"])):
        console.print(f"[bold]launcher[/]: {label}")
        db = f"sqlite:///{wd / f'{label}.db'}"
        path = wd / f"{label}.json"
        path.write_text(json.dumps(spec(label)))
        env = {
            **os.environ,
            "DATABASE_URL": db,
            "STREAM_PREFIX": f"launch-{time.time_ns()}:",
            "BROKER_PORT": str(_free_port()),
        }
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "asyncrl.launch",
                "--spec",
                str(path),
                "--logdir",
                str(wd / f"logs-{label}"),
                *extra,
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{label} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        ledger = Ledger(db)
        try:
            out[f"{label}_step_s"] = step_s(ledger, ledger.list_jobs(limit=1)[0]["id"])
        finally:
            ledger.close()
    console.print("[bold]launcher[/]: hand-pinned")
    ledger, job_id, _t0 = run_finished(wd, spec("pinned"), {"DATABASE_URL": f"sqlite:///{wd / 'pinned.db'}"})
    out["pinned_step_s"] = step_s(ledger, job_id)
    for label in ("launcher", "launcher_no_placement"):
        a, b = out[f"{label}_step_s"], out["pinned_step_s"]
        out[f"{label}_over_pinned"] = a / b if a and b else None
    return out


# --- the suite -----------------------------------------------------------------------------


def run_suite(
    preset: str = "quick",
    *,
    workdir: str = "runs/bench-suite",
    out_dir: str = "results",
    trl_venv: str = "runs/bench/trl-venv",
    postgres_url: str | None = None,
) -> dict[str, Any]:
    """Run every section with `preset`; write suite.json, suite.md and PNGs to `out_dir`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}'; valid: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    t0 = time.monotonic()
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "preset": preset,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "pinning": "ours: generator (vLLM OpenMP) on the first core, trainer (1 torch thread) "
        "on the last; TRL: one process, 2 torch threads on both cores",
    }
    trl_py: Path | None = None
    try:
        t_venv = time.monotonic()
        trl_py = trl_python(Path(trl_venv).resolve())
        result["trl_env"] = {"python": str(trl_py), "setup_s": time.monotonic() - t_venv, "error": None}
    except RuntimeError as exc:
        result["trl_env"] = {"python": None, "setup_s": None, "error": str(exc)}
        console.print(f"[red]TRL environment unavailable[/]: {exc}")
    modes = ("async", "sync", "colocated") if p.sync_modes else ("async", "colocated")
    partial = Path(out_dir) / "suite.partial.json"  # every section as it finishes (a long run cut short keeps them)
    partial.parent.mkdir(parents=True, exist_ok=True)

    def keep(key: str, value: Any) -> None:
        result[key] = value
        partial.write_text(json.dumps(result, indent=2, default=str) + "\n")

    keep("time_to_reward", time_to_reward(wd, p, trl_py, regime_short(wd, p.short_warm_steps), modes))
    keep("time_to_reward_long", time_to_reward(wd, p, trl_py, regime_long(wd, p.long_warm_steps), modes[:-1]))
    keep("stale_drops", stale_dropped(wd, p.stale_steps))
    keep("generator", generator_efficiency(wd, p))
    console.print("[bold]broker and ledger overhead[/]")
    pg = postgres_url if postgres_url is not None else os.environ.get("TEST_POSTGRES_URL")
    keep("broker", bench_broker(wd, samples=p.broker_samples, postgres_url=pg or None))
    keep("scaling", scaling(wd, p))
    keep("launcher", launcher_vs_pinned(wd, steps=p.launcher_steps))
    # The gen-length points of `scaling` double as ours in the peer comparison of step cost.
    result["peer_scaling"] = (
        peer_scaling(wd, p, trl_py, result["scaling"]["gen_length"])
        if trl_py
        else {"gen_length": [], "error": result["trl_env"]["error"]}
    )
    result["regime_scaling"] = (
        regime_scaling(wd, p, trl_py)
        if trl_py and p.regime_models
        else {"points": [], "error": None if trl_py else result["trl_env"]["error"]}
    )
    result["gpu"] = {
        "status": "unrun",
        "script": "deploy/gpu_bench.py",
        "why": "no NVIDIA GPU on this machine (its --dry-run is checked by tests/bench/test_suite.py)",
    }
    ttr, ttr_long = result["time_to_reward"], result["time_to_reward_long"]
    # The keys read as written (issue: results/suite.json), at the top level.
    result["time_to_reward_s"] = {
        "ours": ttr["summary"]["ours_async"]["time_to_target_s"],
        "ours_sync": ttr["summary"].get("ours_sync", {}).get("time_to_target_s"),
        "ours_colocated": ttr["summary"]["ours_colocated"]["time_to_target_s"],
        "trl": ttr["summary"]["trl"]["time_to_target_s"],
    }
    result["time_to_reward_vs_trl"] = ttr["speedup_vs_trl"]["async"]
    result["time_to_reward_vs_trl_long"] = ttr_long["speedup_vs_trl"]["async"]
    result["startup_s"] = ttr["summary"]["ours_async"]["startup_s"]
    result["trl_startup_s"] = ttr["summary"]["trl"]["startup_s"]
    result["launcher_over_pinned"] = result["launcher"]["launcher_over_pinned"]
    result["colocated_vs_trl"] = ttr["speedup_vs_trl"]["colocated"]
    result["colocated_error"] = (ttr["summary"]["ours_colocated"]["errors"] or [None])[0]
    result["stale_dropped_fraction"] = result["stale_drops"]["fraction"]
    result["generator_efficiency"] = result["generator"]["efficiency"]
    result["broker_samples_per_s"] = result["broker"]["samples_per_s"]
    result["broker_overhead_ms"] = result["broker"]["overhead_ms"]
    result["wall_s"] = time.monotonic() - t0
    write_report(result, Path(out_dir))
    partial.unlink(missing_ok=True)
    return result


# --- report --------------------------------------------------------------------------------


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _regime_rows(ttr: dict[str, Any], label: str, goal: str) -> list[tuple[str, str, str]]:
    s, names = ttr["summary"], [k.removeprefix("ours_") for k in ttr["summary"] if k.startswith("ours_")]

    def each(key: str, d: int = 3) -> str:
        return " / ".join(_f(s[f"ours_{m}"].get(key), d) for m in names) + f" / {_f(s['trl'].get(key), d)}"

    who = " / ".join(names) + " / TRL"
    return [
        (
            f"{label}: time to TRL's final held-out reward ({_f(ttr['target'], 2)}), s from launch, {who}",
            each("time_to_target_s", 1),
            "",
        ),
        (
            "... speed-up vs TRL (TRL time / ours), " + " / ".join(names),
            " / ".join(_f(ttr["speedup_vs_trl"][m], 2) for m in names),
            goal,
        ),
        (
            "... start-up left out, " + " / ".join(names),
            " / ".join(_f(ttr["speedup_vs_trl_training_only"][m], 2) for m in names),
            "",
        ),
        (f"... start-up s, {who}", each("startup_s", 1), ""),
        (f"... s per step, {who}", each("step_s_median"), ""),
        (f"... median completion tokens, {who}", each("completion_tokens_median", 0), ""),
        (
            f"... steps to target (reached / runs), {who}",
            " / ".join(f"{_f(s[k]['steps_to_target'])} ({s[k]['reached']}/{s[k]['runs']})" for k in s),
            "",
        ),
        (f"... final held-out reward, {who}", each("final_reward", 2), ""),
    ]


def _rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    ttr = r["time_to_reward"]
    g, b = r["generator"], r["broker"]
    sd = r["stale_drops"]
    rows = [
        *_regime_rows(ttr, "(a) short completions", "<= 0.67x TRL's time: >= 1.5"),
        *_regime_rows(r["time_to_reward_long"], "(b) long completions", "<= 0.33x TRL's time: >= 3"),
        (
            "co-located sync vs TRL (TRL time / ours, regime a)",
            _f(r["colocated_vs_trl"], 2) if r["colocated_error"] is None else f"failed: {r['colocated_error'][:160]}",
            "",
        ),
        (
            "stale-dropped / generated samples, 2 generators, default spec",
            f"{_f(sd.get('fraction'), 4)} ({sd.get('stale_dropped')} of {sd.get('generated')})"
            if sd.get("fraction") is not None
            else f"failed: {str(sd.get('error'))[:160]}",
            "~0",
        ),
        (
            "generator tokens/s: in the system / engine alone",
            f"{_f(g['in_system_tokens_per_s'], 0)} / {_f(g['standalone_tokens_per_s'], 0)}",
            "",
        ),
        ("generator efficiency (in system / alone)", _f(g["efficiency"]), ">= 0.95"),
        ("... engine time only (Prometheus)", _f(g["engine_only_efficiency"]), ""),
        (
            "... vs the engine alone beside a training loop on the other core",
            f"{_f(g.get('efficiency_vs_loaded_alone'))} "
            f"({_f(g.get('standalone_beside_load_tokens_per_s'), 0)} tokens/s alone there)",
            "",
        ),
        (
            f"broker + ledger samples/s ({b['tokens_per_rollout']} tokens + logprobs, SQLite)",
            _f(b["samples_per_s"], 0),
            ">= 20,000",
        ),
        ("broker + ledger ms per sample", _f(b["overhead_ms"], 4), "<= 0.5"),
        (
            "s/step started the README's way / hand-pinned (without placement)",
            f"{_f(r['launcher']['launcher_over_pinned'], 2)} "
            f"({_f(r['launcher']['launcher_no_placement_over_pinned'], 2)})",
            "<= 1.10",
        ),
    ]
    if b.get("ours_postgres"):
        rows.append(("... with the PostgreSQL ledger (samples/s)", _f(b["ours_postgres"]["samples_per_s"], 0), ""))
    rows.append(
        ("raw XADD + XREADGROUP + XACK, same bytes (samples/s)", _f(b["raw_streams"]["samples_per_s"], 0), "medium")
    )
    if b.get("redis_benchmark"):
        rows.append(
            ("redis-benchmark XADD, same size (samples/s)", _f(b["redis_benchmark"]["samples_per_s"], 0), "medium")
        )
    return rows


def write_report(r: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps(r, indent=2, default=str) + "\n")
    rows = _rows(r)
    table = Table(title=f"performance suite ({r['preset']})")
    for col in ("figure", "value", "target"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    md = [
        f"# Performance suite ({r['preset']} preset, {r['date']})",
        "",
        "| figure | value | target |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
    ]
    sc = r["scaling"]
    md += [
        "Seconds per step (median, steady state) against one knob at a time:",
        "",
        "| knob | value | s/step | tokens/step | trainer waiting (s) | train (s) |",
        "|---|---|---|---|---|---|",
    ]
    for knob, key in (("generation length", "max_tokens"), ("group size", "group_size"), ("model", "model")):
        axis = {"generation length": "gen_length", "group size": "group_size", "model": "model_size"}[knob]
        for pt in sc[axis]:
            label = f"{pt[key]} ({sc['params'][pt['model']]:,} params)" if key == "model" else pt[key]
            md.append(
                f"| {knob} | {label} | {_f(pt['step_s'])} | {_f(pt['tokens_per_step'], 0)} | "
                f"{_f(pt['wait_s'])} | {_f(pt['train_s'])} |"
            )
    ps = r["peer_scaling"]
    if ps.get("gen_length"):
        md += [
            "",
            "Cost of a step, ours (async) vs TRL, same random-init model, 16 x 8 samples:",
            "",
            "| generation length | ours s/step | TRL s/step | TRL / ours |",
            "|---|---|---|---|",
        ]
        md += [
            f"| {x['max_tokens']} | {_f(x['ours_step_s'])} | {_f(x['trl_step_s'])} | {_f(x['trl_over_ours'], 2)} |"
            for x in ps["gen_length"]
        ]
    rs = r["regime_scaling"]
    if rs.get("points"):
        md += [
            "",
            "Cost of a step at each regime's shape (8 prompts x 8 samples), ours (async) vs TRL, by model "
            "(random init):",
            "",
            "| regime | max tokens | model (params) | ours s/step | TRL s/step | TRL / ours |",
            "|---|---|---|---|---|---|",
        ]
        md += [
            f"| {x['regime']} | {x['max_tokens']} | {x['model']} ({x['params']:,}) | {_f(x['ours_step_s'])} | "
            f"{_f(x['trl_step_s'])} | {_f(x['trl_over_ours'], 2)} |"
            for x in rs["points"]
        ]
    for key in ("time_to_reward", "time_to_reward_long"):
        t = r[key]
        md += [
            "",
            f"Regime {t['regime']} ({t['about']}; model {t['model']}, {t['steps']} steps, "
            f"{t['shape']['prompts_per_step']} x {t['shape']['group_size']} samples, max {t['shape']['max_tokens']} "
            "tokens): ours' per-step breakdown, median s of the steady steps (trainer metrics `time/*`):",
            "",
        ]
        cols = sorted({k for b in t["breakdown"].values() for k in b})
        md += ["| mode | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        md += [f"| {m} | " + " | ".join(_f(b.get(c)) for c in cols) + " |" for m, b in t["breakdown"].items()]
        for m, runs in t["runs"].items():
            for run in runs:
                if "error" in run:
                    md.append(f"\n{m}, seed {run['seed']}: failed: `{run['error'][-600:]}`")
    ttr = r["time_to_reward"]
    trl_env = r.get("trl_env", {})
    md += [
        "",
        f"Held-out protocol: {ttr['protocol']}. Seeds {ttr['seeds']}, {ttr['steps']} steps per run.",
        f"TRL: {_trl_versions(ttr)}; "
        f"environment {'ready' if trl_env.get('python') else 'unavailable: ' + str(trl_env.get('error'))[:200]}.",
        f"GPU variant: {r['gpu']['script']} ({r['gpu']['status']}: {r['gpu']['why']}); it measures co-located "
        "vLLM sleep(level=1)/wake_up around training phases and both regimes, as one script with a timeout.",
        f"Machine: {r['machine']}; {r['pinning']}. Suite wall time {r['wall_s']:.0f} s.",
    ]
    (out / "suite.md").write_text("\n".join(md) + "\n")
    _plots(r, out)


def _trl_versions(ttr: dict[str, Any]) -> str:
    runs = ttr["runs"]["trl"]
    if not runs:
        return "not run"
    v = runs[0]["versions"]
    return (
        f"trl {v['trl_version']}, transformers {v['transformers_version']}, torch {v['torch_version']}, "
        f"{runs[0]['generation']}"
    )


def _plots(r: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = {
        "ours_async": "ours, async k=1",
        "ours_sync": "ours, sync",
        "ours_colocated": "ours, co-located sync",
        "trl": "TRL GRPOTrainer",
    }
    for ax, key in zip(axes, ("time_to_reward", "time_to_reward_long"), strict=True):
        ttr = r[key]
        for i, (name, runs) in enumerate(ttr["runs"].items()):
            for j, run in enumerate(x for x in runs if "error" not in x):
                ax.plot(
                    [c["t_s"] for c in run["curve"]],
                    [c["reward"] for c in run["curve"]],
                    "o-",
                    color=f"C{i}",
                    alpha=0.8,
                    markersize=3,
                    label=labels[name] if j == 0 else None,
                )
        if ttr["target"] is not None:
            ax.axhline(ttr["target"], color="grey", linestyle=":", label=f"TRL's final {ttr['target']:.2f}")
        ax.set_xlabel("seconds since launch (start-up included)")
        ax.set_ylabel("held-out reward (greedy)")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(loc="lower right")
        ax.set_title(f"regime {ttr['regime']}: max {ttr['shape']['max_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(out / "suite_reward_time.png", dpi=100)
    plt.close(fig)

    sc = r["scaling"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, (axis, key, xlabel) in zip(
        axes,
        (
            ("gen_length", "max_tokens", "generation length (tokens)"),
            ("group_size", "group_size", "group size"),
            ("model_size", "model", "model parameters"),
        ),
        strict=True,
    ):
        pts = sc[axis]
        xs = [sc["params"][p["model"]] for p in pts] if key == "model" else [p[key] for p in pts]
        ax.plot(xs, [p["step_s"] or 0 for p in pts], "o-", label="ours (async)")
        if axis == "gen_length" and r["peer_scaling"].get("gen_length"):
            ps = r["peer_scaling"]["gen_length"]
            ax.plot([x["max_tokens"] for x in ps], [x["trl_step_s"] or 0 for x in ps], "s--", label="TRL")
            ax.legend()
        if key == "model":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("s per step")
        ax.set_ylim(bottom=0)
    fig.suptitle("cost of a step (16 prompts per step)")
    fig.tight_layout()
    fig.savefig(out / "suite_scaling.png", dpi=100)
    plt.close(fig)

    b, g = r["broker"], r["generator"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    bars = [("ours\n(SQLite)", b["ours_sqlite"]["samples_per_s"])]
    if b.get("ours_postgres"):
        bars.append(("ours\n(PostgreSQL)", b["ours_postgres"]["samples_per_s"]))
    bars.append(("raw\nXADD+READ", b["raw_streams"]["samples_per_s"]))
    if b.get("redis_benchmark"):
        bars.append(("redis-benchmark\nXADD", b["redis_benchmark"]["samples_per_s"]))
    a1.bar([x for x, _ in bars], [y for _, y in bars], color=["C0" if x.startswith("ours") else "C7" for x, _ in bars])
    a1.axhline(20_000, color="grey", linestyle=":", label="target 20k/s")
    a1.set_ylabel(f"samples/s ({b['tokens_per_rollout']}-token rollouts)")
    a1.legend()
    a2.bar(
        ["engine alone", "in the system"],
        [g["standalone_tokens_per_s"], g["in_system_tokens_per_s"] or 0],
        color=["C7", "C0"],
    )
    a2.set_ylabel("generator tokens/s")
    a2.set_title(f"efficiency {_f(g['efficiency'])}")
    fig.tight_layout()
    fig.savefig(out / "suite_broker_generator.png", dpi=100)
    plt.close(fig)
