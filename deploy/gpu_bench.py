"""GPU variant of the performance suite (bench.suite) for one machine with an NVIDIA GPU.

Needs the CUDA install (`pip install -e ".[cuda,dev]"`: CUDA torch and the `vllm` package), Redis
(REDIS_URL, else a local or private one, as for the demo) and nothing from the network: the model
is generated here with random init from a transformers config (a Llama of about 0.5B parameters
with the project's character tokenizer), so no download happens.

    python deploy/gpu_bench.py [--out results/suite_gpu.json] [--steps 12] [--layers 24 --hidden 1280]
        [--timeout 420] [--trl-python /path/to/cuda-trl-venv/bin/python] [--dry-run]

One prepared script: the phases below run in order inside `--timeout` seconds (default 420, so a
15-minute device slot leaves room for a rerun); a phase that would start past the budget is
recorded as skipped, a phase that fails is recorded with its error, and the result file is
rewritten after every phase, so a run cut short still leaves what it measured. `--dry-run`
checks the arguments, the plan and every job spec it would submit (shared.jobspec) on any
machine, CPU only, and prints the plan (tests/bench/test_suite.py runs it).

Phases:

- `sleep_wake`: co-located phase switching on one GPU: the CUDA vLLM engine generates a step's
  batch, sleeps (level 1: weights offloaded to host memory, KV cache freed), a training phase
  runs on the same device (the model's fp32 parameters, gradients and AdamW state brought in
  from host memory, one optimizer step, offloaded again), then the engine wakes up; each
  transition timed, `--sleep-rounds` times. Needs the engine's sleep/wake (generator_svc/engine.py
  with `placement: colocated`); recorded as unavailable otherwise.
- `generator`: tokens/s of the CUDA vLLM engine alone (bf16, the same batch as a step: 16 prompts
  x 8 samples) and of the generator inside a running job, and their ratio (target >= 0.95);
- `system`: seconds per step of the whole system (trainer on CUDA in fp32 with AdamW, generator
  in bf16) against generation length, async k=1 and sync, and the system's tokens/s; and one job
  with `"placement": "colocated", "mode": "sync"` (both roles on the one GPU);
- `regimes`: the CPU suite's two time-to-reward regimes (bench.suite.time_to_reward: (a) the
  own task's short completions, (b) the scratchpad's 132-195-token completions) with the GPU
  settings, ours async; beside TRL when `--trl-python` names a CUDA TRL environment (the target
  is then TRL's final held-out reward), else ours alone (curves, s/step, start-up);
- `broker`: bench.broker_overhead (device-independent, for the same table).

Unrun so far: no machine this project has measured on had an NVIDIA GPU (results/suite.md says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# bf16 engine against the trainer's fp32 probe logprobs, as in deploy/compose.gpu.yml.
GPU_ENV = {
    "GEN_DTYPE": "bfloat16",
    "GEN_GPU_MEMORY_UTILIZATION": "0.35",
    "GEN_ENFORCE_EAGER": "false",
    "GEN_VERIFY_ATOL": "0.1",
    "TRAINER_DEVICE": "cuda",
}


def build_model(out: Path, layers: int, hidden: int, heads: int, intermediate: int) -> int:
    """Random-init Llama + character tokenizer (asyncrl.tiny_model); returns its parameter count."""
    if not (out / "config.json").exists():
        subprocess.run(
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
                str(intermediate),
            ],
            check=True,
            cwd=REPO,
        )
    cfg = json.loads((out / "config.json").read_text())
    h, i, n, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    return n * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h


def engine_alone(model: Path, max_tokens: int, prompts: int = 16, n: int = 8, reps: int = 5) -> dict[str, Any]:
    """Tokens/s of the CUDA engine alone on one step's batch, with the service's GPU settings."""
    code = f"""
import json, statistics, time
from generator_svc.engine import Engine
from shared.schema import SamplingParams
from shared.tasks import synthetic_arithmetic
if __name__ == "__main__":
    e = Engine({str(model)!r}, seed=0, dtype="bfloat16", gpu_memory_utilization=0.35, enforce_eager=False)
    prompts = [p.prompt for p in synthetic_arithmetic(0, n_train={prompts}, n_test=1)[0]]
    params = [SamplingParams(temperature=1.0, max_tokens={max_tokens})] * len(prompts)
    e.generate(prompts, params, [{n}] * len(prompts))
    times, toks = [], []
    for _ in range({reps}):
        t0 = time.perf_counter()
        out = e.generate(prompts, params, [{n}] * len(prompts))
        times.append(time.perf_counter() - t0)
        toks.append(sum(len(s.completion_ids) for g in out for s in g))
    e.close()
    print(json.dumps({{
        "t_gen_s": statistics.median(times),
        "tokens_per_s": statistics.median(toks) / statistics.median(times),
    }}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"engine run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def system(wd: Path, model: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """One job on the whole system (asyncrl.demo.run_job) with the GPU settings; step figures."""
    from asyncrl.demo import run_job
    from bench.runs import environment
    from bench.suite import batch_rates
    from broker.ledger import Ledger

    spec = {**spec, "model_path": str(model)}
    with environment(**GPU_ENV):
        run = run_job(wd, spec, progress=False)
    if run.state != "finished":
        raise RuntimeError(f"{spec['name']} ended {run.state}: {run.error}")
    ledger = Ledger(run.db_url)
    steady = ledger.train_steps(run.job_id)[2:]
    step_s = statistics.median(s["metrics"]["time/step_s"] for s in steady)
    tokens = statistics.median(s["metrics"]["tokens"] for s in steady)
    rate, _ = batch_rates(ledger.samples(run.job_id, kind="train"))
    return {
        "mode": spec["mode"],
        "placement": spec.get("placement", "split"),
        "max_tokens": spec["sampling"]["max_tokens"],
        "step_s": step_s,
        "tokens_per_step": tokens,
        "system_tokens_per_s": tokens / step_s,
        "generator_tokens_per_s": rate,
    }


SLEEP_WAKE = """
import json, statistics, sys, time
import torch
from transformers import AutoModelForCausalLM
from generator_svc.engine import Engine
from shared.schema import SamplingParams
from shared.tasks import synthetic_arithmetic
if __name__ == "__main__":
    model, max_tokens, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    e = Engine(model, seed=0, dtype="bfloat16", gpu_memory_utilization=0.35, enforce_eager=False,
               enable_sleep_mode=True)
    prompts = [p.prompt for p in synthetic_arithmetic(0, n_train=16, n_test=1)[0]]
    sp = [SamplingParams(temperature=1.0, max_tokens=max_tokens)] * len(prompts)
    e.generate(prompts, sp, [8] * len(prompts))
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
    def to(device):
        net.to(device)
        for st in opt.state.values():
            for k, v in st.items():
                if torch.is_tensor(v):
                    st[k] = v.to(device)
        for p in net.parameters():
            if p.grad is not None:
                p.grad = p.grad.to(device)
        torch.cuda.synchronize()
    rows = []
    for _ in range(rounds):
        r = {}
        t = time.perf_counter()
        out = e.generate(prompts, sp, [8] * len(prompts))
        r["generate_s"] = time.perf_counter() - t
        free0 = torch.cuda.mem_get_info()[0]
        t = time.perf_counter(); e.sleep(); torch.cuda.synchronize(); r["sleep_s"] = time.perf_counter() - t
        r["freed_gib"] = (torch.cuda.mem_get_info()[0] - free0) / 2**30
        t = time.perf_counter(); to("cuda"); r["trainer_onload_s"] = time.perf_counter() - t
        ids = [g[0].prompt_ids + g[0].completion_ids for g in out]
        width = max(map(len, ids))
        x = torch.tensor([i + [0] * (width - len(i)) for i in ids], device="cuda")
        t = time.perf_counter()
        loss = net(input_ids=x, labels=x).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=False); torch.cuda.synchronize()
        r["train_step_s"] = time.perf_counter() - t
        t = time.perf_counter(); to("cpu"); r["trainer_offload_s"] = time.perf_counter() - t
        t = time.perf_counter(); e.wake_up(); torch.cuda.synchronize(); r["wake_s"] = time.perf_counter() - t
        rows.append(r)
    e.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(json.dumps({"available": True, "rounds": rows, "median": med,
                      "switch_s": med["sleep_s"] + med["wake_s"] + med["trainer_onload_s"] + med["trainer_offload_s"]}))
"""


def sleep_wake(model: Path, max_tokens: int, rounds: int) -> dict[str, Any]:
    """The SLEEP_WAKE rounds in a child process (a fresh CUDA context); its JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", SLEEP_WAKE, str(model), str(max_tokens), str(rounds)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"sleep/wake run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _specs(a: argparse.Namespace, lengths: list[int]) -> dict[str, dict[str, Any]]:
    """Every job spec of the system phase (model path filled in at run time)."""
    out = {}
    for t in lengths:
        out[f"async-{t}"] = system_spec("async", t, a.steps)
    mid = lengths[len(lengths) // 2]
    out[f"sync-{mid}"] = system_spec("sync", mid, a.steps)
    out[f"colocated-{mid}"] = system_spec("sync", mid, a.steps, placement="colocated")
    return out


def system_spec(mode: str, max_tokens: int, steps: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": f"gpu-{extra.get('placement', mode)}-{max_tokens}",
        "model_path": "MODEL",
        "mode": mode,
        "steps": steps,
        "eval_every": 0,
        "group_size": 8,
        "prompts_per_step": 16,
        "generation_batch": 16,
        "max_staleness": 1,
        "algorithm": {"lr": 1e-6},
        "sampling": {"temperature": 1.0, "max_tokens": max_tokens},
        **extra,
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/suite_gpu.json", help="JSON result file")
    ap.add_argument("--workdir", default="runs/gpu-bench")
    ap.add_argument("--steps", type=int, default=12, help="trainer steps per system run")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1280)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--intermediate", type=int, default=3584)
    ap.add_argument("--lengths", default="64,128,192", help="generation lengths (the model's context is 256)")
    ap.add_argument("--sleep-rounds", type=int, default=3, help="generate/sleep/train/wake rounds")
    ap.add_argument("--regime-steps", type=int, default=20, help="trainer steps per regime run")
    ap.add_argument("--trl-python", default=None, help="python of a CUDA TRL environment (regimes beside TRL)")
    ap.add_argument("--phases", default="sleep_wake,generator,system,regimes,broker", help="which phases, in order")
    ap.add_argument(
        "--timeout",
        type=float,
        default=420.0,
        help="seconds for the whole run: a phase that would start later is skipped",
    )
    ap.add_argument("--dry-run", action="store_true", help="check the arguments, plan and job specs; run nothing")
    a = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths must be comma-separated integers, got {a.lengths!r}")
    if not lengths or any(t < 1 or t > 224 for t in lengths):
        ap.error("--lengths must be between 1 and 224 (the model's context is 256 positions)")
    unknown = set(a.phases.split(",")) - set(PHASES)
    if unknown:
        ap.error(f"unknown phase(s) {sorted(unknown)}; valid: {', '.join(PHASES)}")
    if a.timeout <= 0 or a.steps < 3 or a.sleep_rounds < 1 or a.regime_steps < 2:
        ap.error("--timeout must be > 0, --steps >= 3, --sleep-rounds >= 1, --regime-steps >= 2")
    a.lengths = lengths
    return a


PHASES = ("sleep_wake", "generator", "system", "regimes", "broker")


def dry_run(a: argparse.Namespace) -> dict[str, Any]:
    """The plan and every job spec validated by shared.jobspec (errors listed, not raised: a
    field another branch adds may not be there yet)."""
    sys.path.insert(0, str(REPO))
    from pydantic import ValidationError

    from shared.jobspec import JobSpec

    checks = {}
    for name, spec in _specs(a, a.lengths).items():
        try:
            JobSpec.model_validate({**spec, "model_path": "/models/x"})
            checks[name] = None
        except ValidationError as exc:
            checks[name] = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return {
        "dry_run": True,
        "phases": a.phases.split(","),
        "lengths": a.lengths,
        "timeout_s": a.timeout,
        "steps": a.steps,
        "regime_steps": a.regime_steps,
        "trl_python": a.trl_python,
        "spec_errors": checks,
    }


def main(argv: list[str] | None = None) -> None:
    a = _parse(argv)
    if a.dry_run:
        print(json.dumps(dry_run(a), indent=2))
        return

    import torch  # CUDA torch; imported here so --help and --dry-run work anywhere

    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this is the GPU variant; on a CPU machine run `asyncrl bench suite`")
    sys.path.insert(0, str(REPO))
    from bench.broker_overhead import bench_broker
    from bench.claims import machine

    t0 = time.monotonic()
    wd = Path(a.workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    model = wd / f"llama-{a.layers}x{a.hidden}"
    params = build_model(model, a.layers, a.hidden, a.heads, a.intermediate)
    lengths = a.lengths
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "machine": {**machine(), "gpu": torch.cuda.get_device_name(0)},
        "date": time.strftime("%Y-%m-%d"),
        "model": {
            "layers": a.layers,
            "hidden": a.hidden,
            "params": params,
            "engine_dtype": "bfloat16",
            "trainer_dtype": "float32",
        },
        "timeout_s": a.timeout,
        "phases": {},
    }

    def phase(name: str, fn: Callable[[], Any]) -> None:
        left = a.timeout - (time.monotonic() - t0)
        if name not in a.phases.split(","):
            return
        if left <= 0:
            result["phases"][name] = {"status": "skipped", "why": f"past the {a.timeout:.0f} s budget"}
        else:
            t = time.monotonic()
            try:
                result[name] = fn()
                result["phases"][name] = {"status": "done", "s": time.monotonic() - t}
            except Exception as exc:  # one phase's failure must not lose the others' figures
                result["phases"][name] = {"status": "failed", "s": time.monotonic() - t, "error": str(exc)[-3000:]}
        result["wall_s"] = time.monotonic() - t0
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"[gpu_bench] {name}: {result['phases'][name]['status']} at {result['wall_s']:.0f} s", flush=True)

    phase("sleep_wake", lambda: sleep_wake(model, lengths[len(lengths) // 2], a.sleep_rounds))

    def generator() -> dict[str, Any]:
        return {str(t): engine_alone(model, t) for t in lengths}

    phase("generator", generator)

    def system_phase() -> dict[str, Any]:
        runs: dict[str, Any] = {}
        for name, spec in _specs(a, lengths).items():
            try:
                runs[name] = system(wd, model, spec)
            except RuntimeError as exc:
                runs[name] = {"error": str(exc)[-2000:]}
            alone = result.get("generator", {}).get(str(spec["sampling"]["max_tokens"]))
            gen = runs[name].get("generator_tokens_per_s")
            if alone and gen:
                runs[name]["engine_alone_tokens_per_s"] = alone["tokens_per_s"]
                runs[name]["generator_efficiency"] = gen / alone["tokens_per_s"]
        return runs

    phase("system", system_phase)

    def regimes() -> dict[str, Any]:
        from bench.runs import environment
        from bench.suite import PRESETS, regime_long, regime_short, time_to_reward

        p = PRESETS["quick"]
        p = type(p)(**{**p.__dict__, "seeds": (0,), "ttr_steps": a.regime_steps, "long_steps": a.regime_steps})
        trl_py = Path(a.trl_python) if a.trl_python else None  # a CUDA TRL environment, made by hand
        rwd = wd / "regimes"
        rwd.mkdir(exist_ok=True)
        with environment(**GPU_ENV):
            return {
                r.name: time_to_reward(rwd, p, trl_py, r, ("async",), trl_extra={"use_cpu": False})
                for r in (regime_short(rwd), regime_long(rwd, p.long_warm_steps))
            }

    phase("regimes", regimes)
    phase("broker", lambda: bench_broker(wd, samples=50_000))
    sw = result.get("sleep_wake") or {}
    sysr = result.get("system") or {}
    result["colocated_switch_s"] = sw.get("switch_s")
    result["colocated_over_sync"] = next(
        (
            sysr[k]["step_s"] / sysr[s]["step_s"]
            for k in sysr
            if k.startswith("colocated")
            for s in sysr
            if s.startswith("sync")
            if sysr[k].get("step_s") and sysr[s].get("step_s")
        ),
        None,
    )
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(
        json.dumps(
            {k: result.get(k) for k in ("model", "colocated_switch_s", "colocated_over_sync", "phases")},
            indent=2,
            default=str,
        )
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
