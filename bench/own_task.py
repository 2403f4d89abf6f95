"""A user's own task beside TRL, and the collapse guard's calibration (`asyncrl bench own-task`).

The task is one this project was never tuned on, given the way the README's "Your own task" says
a user gives it: two-digit addition and subtraction (`"37-12="` -> `"25"`) in a JSON Lines file of
its own with its own column names (`question`, `target`, and `op`, `level` passed through to the
reward as metadata), a reward function in a file outside the project passed by import path (1 when
the first token of the completion's first line is the answer), and a stop string (`"\\n"`). The
model is a 4-layer tiny Llama warm-started on that file (asyncrl.warmstart --task-spec, its
imperfect teacher), the same for both sides.

Sections (results/own_task.json holds them under these keys):

- `curves`: the held-out curve (100 problems split off the file by the job's seed, one greedy
  completion each, the user's reward) of ours in sync, async k=1 and k=2 and of TRL's
  GRPOTrainer (bench/peers/trl_grpo.py, the same reward file and stop rule, the same train/test
  split, batch 8 prompts x 8 samples, lr, temperature, max tokens, both cores), 3 seeds each.
  Ours is started as a user would (the job spec below and nothing else: defaults for all the
  rest). A point's time is the end of the step that produced the policy, in seconds since the
  launch; TRL's evaluation time is taken off its clock (bench.suite).
- `gaps`: ours - TRL held-out reward at TRL's last step (mean over seeds), and the wall time to
  TRL's final held-out reward, ours / TRL, both on the seed-mean curves.
- `guard`: asyncrl.guard_calibration's replay of every healthy job's recorded metrics through
  the default guard (the own task's runs above plus async k=4, and the built-in arithmetic task
  in sync and k=1/2/4 as the demo starts it, 3 seeds each), and a live collapse (the demo's
  model at a destructive lr, default guard settings) that must trip.

Top-level keys: held_out_gap_sync, held_out_gap_async_k1, held_out_gap_async_k2,
wall_to_trl_final_sync, wall_to_trl_final_async_k1 (null where never reached), guard_false_trips,
guard_live_trip, machine, date.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from asyncrl.demo import prepare_model, run_job, warmstart_command
from bench.claims import machine
from bench.ecosystem import defaults_markdown
from bench.runs import ours_curve, run_finished, trl_python, trl_task_run
from broker.ledger import Ledger

console = Console()

REWARD_FILE = '''"""The user's reward: 1 when the first token of the completion's first line is the answer."""


def score(completion, answer, *, metadata, **kwargs):
    first_line = completion.strip().split("\\n")[0].split()
    return 1.0 if first_line and first_line[0] == answer else 0.0
'''
SHAPE: dict[str, Any] = {"group_size": 8, "prompts_per_step": 8, "lr": 1e-4, "max_tokens": 8, "temperature": 1.0}
STOP = ["\n"]
N_TEST = 100


def write_task(wd: Path) -> tuple[Path, Path]:
    """The user's data file and reward file (outside the project): (jsonl, reward.py)."""
    rows = [
        {"question": f"{a}-{b}=", "target": str(a - b), "op": "sub", "level": a // 10}
        for a in range(10, 50)
        for b in range(10, a + 1)
    ]
    rows += [
        {"question": f"{a}+{b}=", "target": str(a + b), "op": "add", "level": (a + b) // 10}
        for a in range(10, 30)
        for b in range(10, 30)
    ]
    random.Random(1234).shuffle(rows)
    data = wd / "user" / "addsub.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = wd / "user" / "addsub_reward.py"
    reward.write_text(REWARD_FILE)
    return data, reward


def task_section(data: Path) -> dict[str, Any]:
    return {"datasets": [{"path": str(data)}], "prompt_field": "question", "answer_field": "target", "n_test": N_TEST}


def prepare_own_model(wd: Path, data: Path, steps: int | None = None) -> Path:
    """4-layer tiny Llama, warm-started on the user's file (both cached); `steps` SFT steps, or
    asyncrl.warmstart's default (what results/own_task.json used)."""
    base, warm = wd / "own-base", wd / ("own-warm" if steps is None else f"own-warm-{steps}")
    if not (base / "config.json").exists():
        subprocess.run([sys.executable, "-m", "asyncrl.tiny_model", "--out", str(base), "--layers", "4"], check=True)
    if not (warm / "config.json").exists():
        console.print(f"[bold]warm start on the user's task[/] -> {warm}")
        subprocess.run(
            warmstart_command(
                base,
                warm,
                *(("--steps", str(steps)) if steps is not None else ()),
                "--task-spec",
                json.dumps(task_section(data)),
            ),
            check=True,
        )
    return warm


def own_spec(
    model: Path, data: Path, reward: Path, mode: str, k: int, seed: int, steps: int, eval_every: int
) -> dict[str, Any]:
    """The job spec a user writes for this task: everything else is the defaults."""
    return {
        "name": f"own-{mode}-k{k}-s{seed}",
        "model_path": str(model),
        "mode": mode,
        "max_staleness": k,
        "seed": seed,
        "steps": steps,
        "eval_every": eval_every,
        "group_size": SHAPE["group_size"],
        "prompts_per_step": SHAPE["prompts_per_step"],
        "algorithm": {"lr": SHAPE["lr"]},
        "sampling": {"temperature": SHAPE["temperature"], "max_tokens": SHAPE["max_tokens"], "stop": STOP},
        "task": task_section(data),
        "reward": f"{reward}:score",
    }


def trl_curve(
    py: Path, wd: Path, model: Path, data: Path, reward: Path, seed: int, steps: int, eval_every: int
) -> dict[str, Any]:
    """TRL on the same split, reward file and stop rule; its curve and step ends."""
    r = trl_task_run(
        py,
        wd / f"trl-own-{seed}-{time.time_ns()}",
        model,
        task_section(data),
        reward,
        SHAPE,
        STOP,
        seed,
        steps,
        eval_every,
    )
    ends = [x["t_s"] for x in r["train_reward"]]
    return {
        "curve": r["curve"],
        "step_s_median": statistics.median(b - a for a, b in zip(ends[1:], ends[2:], strict=False)),
        "startup_s": r["startup_s"],
        "wall_s": r["wall_s"],
        "eval_s_total": r["eval_s_total"],
        "trl_version": r["trl_version"],
    }


def mean_curve(curves: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per step present in every curve: mean reward and mean time over the seeds."""
    common = set.intersection(*({p["step"] for p in c} for c in curves)) if curves else set()
    out = []
    for step in sorted(common):
        pts = [next(p for p in c if p["step"] == step) for c in curves]
        out.append(
            {
                "step": step,
                "reward": statistics.fmean(p["reward"] for p in pts),
                "t_s": statistics.fmean(p["t_s"] for p in pts),
            }
        )
    return out


def _at_step(curve: list[dict[str, float]], step: int) -> float | None:
    """The reward of the last point at or before `step`."""
    pts = [p for p in curve if p["step"] <= step]
    return pts[-1]["reward"] if pts else None


def _time_to(curve: list[dict[str, float]], target: float) -> float | None:
    hit = next((p for p in curve if p["reward"] >= target - 1e-9), None)
    return hit["t_s"] if hit else None


def gaps(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """held_out_gap_<mode> and wall_to_trl_final_<mode> from the seed-mean curves."""
    trl = mean_curve([r["curve"] for r in runs["trl"]])
    out: dict[str, Any] = {"trl_final": trl[-1]["reward"] if trl else None}
    if not trl:
        return out
    last, final = int(trl[-1]["step"]), trl[-1]["reward"]
    # one seed-mean round's binomial standard error on the held-out set, and that of a difference
    # of two such means: the noise floor any gap below is inside
    n_seeds = len(runs["trl"])
    se = (final * (1 - final) / N_TEST / n_seeds) ** 0.5
    out["held_out_se"], out["gap_se"] = se, se * 2**0.5
    trl_time = _time_to(trl, final)
    out["trl_time_to_final_s"] = trl_time
    for mode in ("sync", "async_k1", "async_k2"):
        mean = mean_curve([r["curve"] for r in runs[mode]])
        at = _at_step(mean, last)
        ours_time = _time_to(mean, final)
        out[f"{mode}_at_trl_last_step"] = at
        out[f"held_out_gap_{mode}"] = at - final if at is not None else None
        out[f"{mode}_time_to_trl_final_s"] = ours_time
        out[f"wall_to_trl_final_{mode}"] = ours_time / trl_time if ours_time and trl_time else None
        # the last three held-out rounds averaged: less of one round's noise
        tail = [int(p["step"]) for p in trl[-3:]]
        ours_tail = [_at_step(mean, t) for t in tail]
        out[f"{mode}_gap_last3"] = (
            (statistics.fmean(x for x in ours_tail if x is not None) - statistics.fmean(p["reward"] for p in trl[-3:]))
            if None not in ours_tail
            else None
        )
        # per seed, to see the spread behind the means
        out[f"{mode}_gap_per_seed"] = [
            (_at_step(r["curve"], last) or 0.0) - (_at_step(t["curve"], last) or 0.0)
            for r, t in zip(runs[mode], runs["trl"], strict=False)
        ]
    return out


# --- this system's defaults against TRL's (results/ecosystem.json key `defaults_vs_trl`) -------

DEFAULTS_GOAL = -0.02  # issue 36: ours with its defaults at most this far below TRL with its own
# Candidate default changes, by name: overrides on top of the defaults spec ("defaults": none).
CANDIDATES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "constant": {"algorithm": {"lr_schedule": "constant"}},
    "linear": {"algorithm": {"lr_schedule": "linear"}},
    "cosine": {"algorithm": {"lr_schedule": "cosine"}},
    "linear_warmup10": {"algorithm": {"lr_schedule": "linear", "warmup_steps": 10}},
    "sync": {"mode": "sync"},
    "sync_constant": {"mode": "sync", "algorithm": {"lr_schedule": "constant"}},
    "sync_linear": {"mode": "sync", "algorithm": {"lr_schedule": "linear"}},
}
# What defaults_spec sets: what a user must (model, data, reward, the stop rule and length of the
# task's answers) and what the comparison fixes on both sides (steps, 8 x 8, lr, seed).
DEFAULTS_FIELDS = (
    "name",
    "model_path",
    "task",
    "reward",
    "sampling.max_tokens",
    "sampling.stop",
    "steps",
    "group_size",
    "prompts_per_step",
    "algorithm.lr",
    "seed",
)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over`'s keys put in, nested dicts merged key by key (neither is changed)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def defaults_spec(
    model: Path, data: Path, reward: Path, seed: int, steps: int, candidate: str = "defaults"
) -> dict[str, Any]:
    """The job spec with DEFAULTS_FIELDS only (every other field this system's default), with the
    candidate's overrides (CANDIDATES) on top."""
    spec = {
        "name": f"defaults-{candidate}-s{seed}",
        "model_path": str(model),
        "task": task_section(data),
        "reward": f"{reward}:score",
        "sampling": {"max_tokens": SHAPE["max_tokens"], "stop": STOP},
        "steps": steps,
        "group_size": SHAPE["group_size"],
        "prompts_per_step": SHAPE["prompts_per_step"],
        "algorithm": {"lr": SHAPE["lr"]},
        "seed": seed,
    }
    return deep_merge(spec, lookup_candidate(candidate))


def lookup_candidate(name: str) -> dict[str, Any]:
    try:
        return CANDIDATES[name]
    except KeyError:
        raise ValueError(f"unknown candidate '{name}'; valid: {sorted(CANDIDATES)}") from None


def ours_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """The settings a comparison with TRL turns on, as this system resolves `spec` (its defaults)."""
    from shared.jobspec import JobSpec

    js = JobSpec.model_validate(spec)
    a = js.algorithm
    return {
        "mode": js.mode,
        "max_staleness": js.max_staleness,
        "advantage": a.advantage,
        "loss": a.loss,
        "aggregation": a.aggregation,
        "rho": a.rho,
        "kl_coef": a.kl_coef,
        "lr_schedule": a.lr_schedule,
        "warmup_steps": a.warmup_steps,
        "min_lr_ratio": a.min_lr_ratio,
        "betas": list(a.betas),
        "eps": a.eps,
        "weight_decay": a.weight_decay,
        "max_grad_norm": a.max_grad_norm,
        "overlong": a.overlong,
        "temperature": js.sampling.temperature,
        "top_p": js.sampling.top_p,
        "top_k": js.sampling.top_k,
        "dtype": a.dtype,
        "gradient_checkpointing": a.gradient_checkpointing,
    }


def seed_gap(ours: list[float], trl: list[float]) -> dict[str, float | None]:
    """Mean over seeds of each side, their difference (ours - TRL) and its standard error from the
    seeds' spread (Welch: sqrt(s_o^2 / n_o + s_t^2 / n_t); None with fewer than 2 seeds a side)."""
    o, t = statistics.fmean(ours), statistics.fmean(trl)
    se = (
        (statistics.variance(ours) / len(ours) + statistics.variance(trl) / len(trl)) ** 0.5
        if len(ours) > 1 and len(trl) > 1
        else None
    )
    return {"ours_mean": o, "trl_mean": t, "gap": o - t, "gap_se": se}


def defaults_section(
    previous: dict[str, Any] | None,
    trl: list[float],
    measured: dict[str, dict[str, Any]],
    settings: dict[str, Any],
    steps: int,
) -> dict[str, Any]:
    """The `defaults_vs_trl` section: the candidates measured now (name -> {"held_out": per seed,
    ...}) over those of `previous` (kept unless measured again), every gap against `trl` (per seed);
    the headline (ours, gap, ...) is the "defaults" candidate's."""
    candidates = {**(previous or {}).get("candidates", {}), **measured}
    for c in candidates.values():
        c.update(seed_gap(c["held_out"], trl))
    out: dict[str, Any] = {
        "goal": DEFAULTS_GOAL,
        "steps": steps,
        "trl": trl,
        "candidates": candidates,
        "settings": settings,
    }
    d = candidates.get("defaults")
    if d:
        out.update(
            ours=d["held_out"],
            ours_mean=d["ours_mean"],
            trl_mean=d["trl_mean"],
            gap=d["gap"],
            gap_se=d["gap_se"],
            goal_met=d["gap"] >= DEFAULTS_GOAL,
        )
    if sync := candidates.get("sync"):  # the defaults but mode sync: the comparison
        out.update(ours_sync=sync["held_out"], gap_sync=sync["gap"], gap_sync_se=sync["gap_se"])
    return out


def run_defaults_vs_trl(
    *,
    candidates: tuple[str, ...] = ("defaults",),
    workdir: str = "runs/bench-own-task",
    out_dir: str = "results",
    seeds: int = 3,
    steps: int = 150,
    trl_venv: str = "runs/bench/trl-venv",
) -> dict[str, Any]:
    """Ours with its defaults (and each of `candidates`: CANDIDATES) and TRL's GRPOTrainer with its
    own (fp32), on the own task's task and warm start, `seeds` seeds, held-out greedy at the last
    step; merged into `out_dir`/ecosystem.{json,md} as `defaults_vs_trl`."""
    from bench.ecosystem import markdown, merge_results

    for c in candidates:
        lookup_candidate(c)
    t0, load0 = time.monotonic(), os.getloadavg()
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    data, reward = write_task(wd)
    model = prepare_own_model(wd, data)
    trl_py = trl_python(Path(trl_venv).resolve())
    measured: dict[str, dict[str, Any]] = {
        c: {"overrides": CANDIDATES[c], "held_out": [], "step_s_median": [], "job_ids": []} for c in candidates
    }
    trl: list[float] = []
    trl_step_s: list[float] = []
    trl_settings: dict[str, Any] = {}
    for seed in range(seeds):
        for c in candidates:
            console.print(f"[bold]defaults vs TRL[/]: ours {c}, seed {seed}")
            ledger, job_id, t_launch = run_finished(wd, defaults_spec(model, data, reward, seed, steps, c))
            curve, ends, _ = ours_curve(ledger, job_id, t_launch)
            m = measured[c]
            m["held_out"].append(_at_step(curve, steps))
            m["step_s_median"].append(
                statistics.median(b["t_s"] - a["t_s"] for a, b in zip(ends[1:], ends[2:], strict=False))
            )
            m["job_ids"].append(job_id)
            console.print(f"  held-out at step {steps}: {m['held_out'][-1]}")
        console.print(f"[bold]defaults vs TRL[/]: TRL with its defaults, seed {seed}")
        r = trl_task_run(
            trl_py,
            wd / f"trl-defaults-{seed}-{time.time_ns()}",
            model,
            task_section(data),
            reward,
            SHAPE,
            STOP,
            seed,
            steps,
            10,
            trl_defaults=True,
        )
        trl.append(_at_step(r["curve"], steps) or 0.0)
        ends_t = [x["t_s"] for x in r["train_reward"]]
        trl_step_s.append(statistics.median(b - a for a, b in zip(ends_t[1:], ends_t[2:], strict=False)))
        trl_settings = {"version": r["trl_version"], "fields_set": r["trl_fields_set"], "defaults": r["trl_settings"]}
        console.print(f"  held-out at step {steps}: {trl[-1]}")
    for m in measured.values():
        m["date"] = time.strftime("%Y-%m-%d")
    settings = {
        "ours_fields_set": list(DEFAULTS_FIELDS),
        "ours_defaults": ours_defaults(defaults_spec(model, data, reward, 0, steps)),
        "trl": trl_settings,
        "shape": {k: SHAPE[k] for k in ("group_size", "prompts_per_step", "lr", "max_tokens")},
        "stop": STOP,
        "n_test": N_TEST,
        "held_out": f"greedy, {N_TEST} problems split off the file by the seed, the user's reward, at step {steps}",
        "trl_step_s_median": statistics.median(trl_step_s),
        "machine": machine(),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "wall_s": round(time.monotonic() - t0, 1),
        "date": time.strftime("%Y-%m-%d"),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ecosystem.json"
    previous = json.loads(path.read_text()).get("defaults_vs_trl") if path.exists() else None
    section = defaults_section(previous, trl, measured, settings, steps)
    data_all = merge_results(path, {"defaults_vs_trl": section})
    (out / "ecosystem.md").write_text(markdown(data_all))
    console.print(defaults_markdown(section))
    return section


def _job_ids(db_url: str, name: str) -> list[str]:
    ledger = Ledger(db_url)
    try:
        return [j["id"] for j in ledger.list_jobs(limit=1_000_000) if j["name"] == name]
    finally:
        ledger.close()


def calibration(db_url: str, exclude: set[str]) -> dict[str, Any]:
    """asyncrl.guard_calibration over the ledger's jobs but `exclude`, with the default
    GuardSpec (run as its command: tools in broker/ import no service package); its JSON, with
    its markdown table under "markdown"."""
    ledger = Ledger(db_url)
    try:
        jobs = [j["id"] for j in ledger.list_jobs(limit=1_000_000) if j["id"] not in exclude]
    finally:
        ledger.close()
    with tempfile.TemporaryDirectory() as tmp:
        out, md = Path(tmp) / "calibration.json", Path(tmp) / "calibration.md"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "asyncrl.guard_calibration",
                "--url",
                db_url,
                *(a for j in jobs for a in ("--job", j)),
                "--out",
                str(out),
                "--md",
                str(md),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        result: dict[str, Any] = json.loads(out.read_text())
        result["markdown"] = md.read_text()
    return result


def live_collapse(wd: Path, model: Path) -> dict[str, Any]:
    """The demo's model at 20x the demo's lr with the guard at its defaults: does it trip?"""
    spec = {
        "name": "guard-live-default",
        "model_path": str(model),
        "mode": "async",
        "max_staleness": 1,
        "steps": 20,
        "group_size": 8,
        "prompts_per_step": 8,
        "eval_every": 0,
        "checkpoint_every": 2,
        "algorithm": {"lr": 2e-3},
        "sampling": {"max_tokens": 8},
    }
    run = run_job(wd, spec, progress=False)  # more trips than guard.max_trips fail the job: that is fine here
    ledger = Ledger(run.db_url)
    trips = [c["changes"] for c in ledger.job_changes(run.job_id) if c["actor"] == "trainer collapse guard"]
    rewards = [round(s["metrics"]["reward/mean"], 3) for s in ledger.train_steps(run.job_id)]
    return {
        "job_id": run.job_id,
        "state": run.state,
        "error": run.error,
        "tripped": bool(trips),
        "trips": trips,
        "rewards": rewards,
    }


def run_own_task(
    *,
    workdir: str = "runs/bench-own-task",
    out_dir: str = "results",
    seeds: int = 3,
    steps: int = 150,
    eval_every: int = 10,
    calibration_steps: int = 60,
    trl_venv: str = "runs/bench/trl-venv",
) -> dict[str, Any]:
    t0 = time.monotonic()
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    data, reward = write_task(wd)
    model = prepare_own_model(wd, data)
    trl_py = trl_python(Path(trl_venv).resolve())
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async_k1": [], "async_k2": [], "trl": []}
    for seed in range(seeds):
        for name, mode, k in (("sync", "sync", 1), ("async_k1", "async", 1), ("async_k2", "async", 2)):
            console.print(f"[bold]own task[/]: ours {name}, seed {seed}")
            ledger, job_id, t_launch = run_finished(wd, own_spec(model, data, reward, mode, k, seed, steps, eval_every))
            curve, ends, breakdown = ours_curve(ledger, job_id, t_launch)
            step_s = statistics.median(b["t_s"] - a["t_s"] for a, b in zip(ends[1:], ends[2:], strict=False))
            runs[name].append(
                {
                    "seed": seed,
                    "job_id": job_id,
                    "curve": curve,
                    "step_s_median": step_s,
                    "startup_s": ends[0]["t_s"] - step_s,
                    "breakdown": breakdown,
                }
            )
        console.print(f"[bold]own task[/]: TRL, seed {seed}")
        runs["trl"].append({"seed": seed, **trl_curve(trl_py, wd, model, data, reward, seed, steps, eval_every)})
    # the rest of the calibration matrix: healthy jobs whose only use is the guard replay
    for seed in range(seeds):
        console.print(f"[bold]guard calibration[/]: own task async k=4, seed {seed}")
        run_finished(wd, own_spec(model, data, reward, "async", 4, seed, calibration_steps, 0))
    demo_model = prepare_model(wd, 0)
    for seed in range(seeds):
        for mode, k in (("sync", 1), ("async", 1), ("async", 2), ("async", 4)):
            console.print(f"[bold]guard calibration[/]: arithmetic {mode} k={k}, seed {seed}")
            run_finished(
                wd,
                {
                    "name": f"arith-{mode}-k{k}-s{seed}",
                    "model_path": str(demo_model),
                    "mode": mode,
                    "max_staleness": k,
                    "seed": seed,
                    "steps": calibration_steps,
                    "eval_every": 0,
                    "algorithm": {"lr": 1e-4},
                    "sampling": {"temperature": 1.0, "max_tokens": 8},
                },
            )
    console.print("[bold]guard[/]: live collapse")
    live = live_collapse(wd, demo_model)
    db_url = f"sqlite:///{wd / 'ledger.db'}"
    cal = calibration(db_url, exclude={j for j in _job_ids(db_url, "guard-live-default")})
    result: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "task": {
            "data": "two-digit add/sub JSONL, columns question/target/op/level",
            "n_test": N_TEST,
            "reward": "user file: first token of the first line == target",
            "stop": STOP,
        },
        "shape": SHAPE,
        # ours: the default, resolved; TRL's mirrored settings follow it (bench/peers/trl_grpo.py)
        "lr_schedule": ours_defaults(own_spec(model, data, reward, "sync", 1, 0, steps, eval_every))["lr_schedule"],
        "steps": steps,
        "eval_every": eval_every,
        "seeds": seeds,
        "runs": runs,
        "gaps": gaps(runs),
        "guard": {"calibration": cal, "live": live},
    }
    g = result["gaps"]
    for key in (
        "held_out_gap_sync",
        "held_out_gap_async_k1",
        "held_out_gap_async_k2",
        "wall_to_trl_final_sync",
        "wall_to_trl_final_async_k1",
    ):
        result[key] = g.get(key)
    result["guard_false_trips"] = cal["total_trips"]
    result["guard_live_trip"] = live["tripped"]
    result["wall_s"] = time.monotonic() - t0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "own_task.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "own_task.md").write_text(report(result))
    console.print(report(result))
    return result


def _f(v: Any, d: int = 3) -> str:
    return "-" if v is None else f"{v:.{d}f}" if isinstance(v, float) else str(v)


def report(r: dict[str, Any]) -> str:
    g = r["gaps"]
    lines = [
        f"# Own task beside TRL ({r['date']}, {r['machine']['cores']} cores)",
        "",
        f"Task: {r['task']['data']}; reward: {r['task']['reward']}; stop {r['task']['stop']!r}; "
        f"{r['steps']} steps, {r['seeds']} seeds, held-out every {r['eval_every']} steps "
        f"({r['task']['n_test']} problems, greedy); lr schedule {r.get('lr_schedule', 'constant')} on both "
        "sides (ours: the default when measured).",
        "",
        "| | final held-out (seed mean) | gap vs TRL | per seed | s/step | wall to TRL's final (s) | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    trl_steps = [x["step_s_median"] for x in r["runs"]["trl"] if x.get("step_s_median")]
    lines.append(
        f"| TRL | {_f(g.get('trl_final'))} | | | {_f(statistics.median(trl_steps) if trl_steps else None)} | "
        f"{_f(g.get('trl_time_to_final_s'), 1)} | 1 |"
    )
    for mode in ("sync", "async_k1", "async_k2"):
        steps = [x["step_s_median"] for x in r["runs"][mode]]
        lines.append(
            f"| ours {mode} | {_f(g.get(f'{mode}_at_trl_last_step'))} | {_f(g.get(f'held_out_gap_{mode}'))} | "
            f"{', '.join(_f(x, 2) for x in g.get(f'{mode}_gap_per_seed', []))} | "
            f"{_f(statistics.median(steps))} | {_f(g.get(f'{mode}_time_to_trl_final_s'), 1)} | "
            f"{_f(g.get(f'wall_to_trl_final_{mode}'), 2)} |"
        )
    lines += [
        "",
        f"Noise: one seed-mean held-out round has a standard error of {_f(g.get('held_out_se'))}; a gap, "
        f"{_f(g.get('gap_se'))}. Gap over the last three rounds: "
        + ", ".join(f"{m} {_f(g.get(f'{m}_gap_last3'))}" for m in ("sync", "async_k1", "async_k2"))
        + ".",
        "",
        "This system with its own defaults against TRL with its own (not the settings mirrored here): "
        "[ecosystem.md](ecosystem.md#defaults_vs_trl).",
        "",
        "Held-out curves (seed mean; step: reward @ s):",
        "",
    ]
    for name, rs in r["runs"].items():
        mean = mean_curve([x["curve"] for x in rs])
        lines.append(f"- {name}: " + ", ".join(f"{p['step']}: {p['reward']:.2f} @ {p['t_s']:.0f}" for p in mean))
    live = r["guard"]["live"]
    lines += [
        "",
        "## Guard calibration (default GuardSpec, replayed over the healthy jobs)",
        "",
        r["guard"]["calibration"]["markdown"],
        f"Live collapse (lr 2e-3, default guard): tripped = {live['tripped']}; "
        f"trips {[(t['step'], t['kind']) for t in live['trips']]}; rewards per step {live['rewards']}",
        "",
    ]
    return "\n".join(lines)


def rerun_guard(path: str = "results/own_task.json", workdir: str = "runs/bench-own-task") -> dict[str, Any]:
    """Redo the guard section of a saved result with this checkout's guard: the live collapse job
    again, and the replay over the same ledger's healthy jobs (the earlier live jobs left out)."""
    result = json.loads(Path(path).read_text())
    wd = Path(workdir).resolve()
    live = live_collapse(wd, prepare_model(wd, 0))
    db_url = f"sqlite:///{wd / 'ledger.db'}"
    cal = calibration(db_url, exclude=set(_job_ids(db_url, "guard-live-default")))
    result["guard"] = {"calibration": cal, "live": live}
    result["guard_false_trips"], result["guard_live_trip"] = cal["total_trips"], live["tripped"]
    Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")
    Path(path).with_suffix(".md").write_text(report(result))
    return result


def rereport(path: str = "results/own_task.json") -> dict[str, Any]:
    """Recompute the gaps and the markdown of a saved result (after a change to this module's
    arithmetic, without rerunning the jobs)."""
    result = json.loads(Path(path).read_text())
    result["gaps"] = gaps(result["runs"])
    for key in (
        "held_out_gap_sync",
        "held_out_gap_async_k1",
        "held_out_gap_async_k2",
        "wall_to_trl_final_sync",
        "wall_to_trl_final_async_k1",
    ):
        result[key] = result["gaps"].get(key)
    Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")
    Path(path).with_suffix(".md").write_text(report(result))
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--defaults-vs-trl"]:
        # python -m bench.own_task --defaults-vs-trl [candidate,candidate,...] [seeds]
        names = tuple(sys.argv[2].split(",")) if sys.argv[2:] else ("defaults",)
        run_defaults_vs_trl(candidates=names, seeds=int(sys.argv[3]) if sys.argv[3:] else 3)
    elif sys.argv[1:] == ["--rereport"]:
        rereport()
    elif sys.argv[1:2] == ["--rerun-guard"]:
        rerun_guard(*sys.argv[2:])
    else:
        run_own_task()
