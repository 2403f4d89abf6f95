"""GPU variant of the performance suite (bench.suite) for one machine with an NVIDIA GPU.

Needs the CUDA install (`pip install -e ".[cuda,dev]"`: CUDA torch and the `vllm` package), Redis
(REDIS_URL, else a local or private one, as for the demo) and nothing from the network: the model
is generated here with random init from a transformers config (a Llama of about 0.5B parameters
with the project's character tokenizer), so no download happens.

    python deploy/gpu_bench.py [--out results/suite_gpu.json] [--steps 12] [--layers 24 --hidden 1280]

Measures, in one run, the ratios of the CPU suite plus absolute figures:

- generator: tokens/s of the CUDA vLLM engine alone (bf16, the same batch as a step: 16 prompts x
  8 samples) and of the generator inside a running job, and their ratio (target >= 0.95);
- seconds per step of the whole system (trainer on CUDA in fp32 with AdamW, generator in bf16)
  against generation length, async k=1 and sync, and the system's tokens/s;
- broker and ledger overhead (bench.broker_overhead: device-independent, for the same table).

The time-to-reward comparison with TRL is a CPU-suite section only: a random-init model learns no
arithmetic, and the tiny warm-started model says nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# bf16 engine against the trainer's fp32 probe logprobs, as in deploy/compose.gpu.yml.
GPU_ENV = {"GEN_DTYPE": "bfloat16", "GEN_GPU_MEMORY_UTILIZATION": "0.35", "GEN_ENFORCE_EAGER": "false",
           "GEN_VERIFY_ATOL": "0.1", "TRAINER_DEVICE": "cuda"}


def build_model(out: Path, layers: int, hidden: int, heads: int, intermediate: int) -> int:
    """Random-init Llama + character tokenizer (trainer_svc.tiny_model); returns its parameter count."""
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "trainer_svc.tiny_model", "--out", str(out), "--layers", str(layers),
                        "--hidden", str(hidden), "--heads", str(heads), "--intermediate", str(intermediate)],
                       check=True, cwd=REPO)
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
    print(json.dumps({{"t_gen_s": statistics.median(times), "tokens_per_s": statistics.median(toks) / statistics.median(times)}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"engine run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def system(wd: Path, model: Path, mode: str, max_tokens: int, steps: int) -> dict[str, Any]:
    """One job on the whole system (asyncrl.demo.run_job) with the GPU settings; step figures."""
    from asyncrl.demo import run_job
    from bench.suite import _batch_rates, _environ
    from broker.ledger import Ledger

    spec = {"name": f"gpu-{mode}-{max_tokens}", "model_path": str(model), "mode": mode, "steps": steps,
            "eval_every": 0, "group_size": 8, "prompts_per_step": 16, "generation_batch": 16, "max_staleness": 1,
            "algorithm": {"lr": 1e-6}, "sampling": {"temperature": 1.0, "max_tokens": max_tokens}}
    with _environ(**GPU_ENV):
        run = run_job(wd, spec, progress=False)
    if run.state != "finished":
        raise RuntimeError(f"{spec['name']} ended {run.state}: {run.error}")
    ledger = Ledger(run.db_url)
    steady = ledger.train_steps(run.job_id)[2:]
    step_s = statistics.median(s["metrics"]["time/step_s"] for s in steady)
    tokens = statistics.median(s["metrics"]["tokens"] for s in steady)
    rate, _ = _batch_rates(ledger.samples(run.job_id, kind="train"))
    return {"mode": mode, "max_tokens": max_tokens, "step_s": step_s, "tokens_per_step": tokens,
            "system_tokens_per_s": tokens / step_s, "generator_tokens_per_s": rate}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/suite_gpu.json", help="JSON result file")
    ap.add_argument("--workdir", default="runs/gpu-bench")
    ap.add_argument("--steps", type=int, default=12, help="trainer steps per system run")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1280)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--intermediate", type=int, default=3584)
    ap.add_argument("--lengths", default="64,128,192", help="generation lengths (the model's context is 256)")
    a = ap.parse_args(argv)

    import torch  # CUDA torch; imported here so --help works anywhere

    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this is the GPU variant; on a CPU machine run `asyncrl bench suite`")
    sys.path.insert(0, str(REPO))
    from bench.broker_overhead import bench_broker
    from bench.claims import machine

    wd = Path(a.workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    model = wd / f"llama-{a.layers}x{a.hidden}"
    params = build_model(model, a.layers, a.hidden, a.heads, a.intermediate)
    lengths = [int(x) for x in a.lengths.split(",")]
    t0 = time.monotonic()
    alone = {t: engine_alone(model, t) for t in lengths}
    runs = [system(wd, model, "async", t, a.steps) for t in lengths]
    sync = system(wd, model, "sync", lengths[len(lengths) // 2], a.steps)
    for r in runs:
        r["engine_alone_tokens_per_s"] = alone[r["max_tokens"]]["tokens_per_s"]
        gen = r["generator_tokens_per_s"]
        r["generator_efficiency"] = gen / r["engine_alone_tokens_per_s"] if gen else None
    result = {
        "machine": {**machine(), "gpu": torch.cuda.get_device_name(0)}, "date": time.strftime("%Y-%m-%d"),
        "model": {"layers": a.layers, "hidden": a.hidden, "params": params, "engine_dtype": "bfloat16",
                  "trainer_dtype": "float32"},
        "async": runs, "sync": sync,
        "generator_efficiency": runs[-1]["generator_efficiency"],
        "broker": bench_broker(wd, samples=50_000),
        "wall_s": time.monotonic() - t0,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("model", "generator_efficiency")}, indent=2))
    for r in runs:
        print(f"{r['max_tokens']:>4} tokens: {r['step_s']:.3f} s/step, system {r['system_tokens_per_s']:,.0f} tok/s, "
              f"engine alone {r['engine_alone_tokens_per_s']:,.0f} tok/s, efficiency {r['generator_efficiency']}")
    print(f"sync at {sync['max_tokens']} tokens: {sync['step_s']:.3f} s/step; results in {out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
