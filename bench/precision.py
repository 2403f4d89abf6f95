"""What lower precision costs (issue 17 item 1): `python -m bench precision`.

On a ~13M-parameter Llama built here (asyncrl/tiny_model.py, briefly warm-started on the
arithmetic task so its next-token distributions are peaked like a trained model's, not the flat
ones of a random init):

(a) mismatch KL: the real vLLM CPU engine samples completions with behaviour logprobs (float32
    engine, and bfloat16 engine where the CPU build runs it); the trainer's logprobs on those same
    samples, float32 and bfloat16 mixed precision (trainer_svc/precision.py), give the k3 mismatch
    KL(mu || pi) per token (trainer_svc/algorithms.py `mismatch_k3`), the step metric `mismatch_kl`
    of a sync job (staleness 0).
(b) loss curves: the Learner (the trainer's own step) for N steps on the same batches, float32 and
    bfloat16, interleaved step by step so both see the same load on the shared cores; loss,
    mismatch_kl, grad norm and step time side by side, and how far the weights drift apart.

The engine needs a `__main__` guard, so it runs in a subprocess: `python -m bench.precision gen
MODEL DTYPE OUT`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MODEL = {"layers": 4, "hidden": 512, "heads": 8, "intermediate": 1408}
WARM_STEPS = 60  # supervised warm start: enough to peak the distributions, not to learn the task well
GROUP, PROMPTS_PER_STEP, STEPS, MAX_TOKENS = 8, 8, 12, 12
LR = 1e-4


def reward(got: str | None, answer: str) -> float:
    """1 for the right number, 1 / (1 + |error|) for another number, 0 for none: denser than exact
    match, so a barely warm-started model's groups still differ (the loss curves have a gradient)."""
    if got is None:
        return 0.0
    try:
        return 1.0 / (1.0 + abs(float(got) - float(answer)))
    except ValueError:
        return 0.0


def generate(model_dir: str, dtype: str, out: str) -> None:
    """Subprocess: sample GROUP completions of STEPS x PROMPTS_PER_STEP arithmetic prompts with the
    engine in `dtype`; write prompts, completions, behaviour logprobs and rewards as JSON."""
    from transformers import AutoTokenizer

    from asyncrl.warmstart import encode_prompts
    from generator_svc.engine import Engine
    from shared.datasets import TaskSpec, load_task
    from shared.schema import SamplingParams
    from shared.tasks import extract_answer

    tok = AutoTokenizer.from_pretrained(model_dir)
    train, _ = load_task(TaskSpec(name="arithmetic", n_train=STEPS * PROMPTS_PER_STEP, n_test=1), 0)
    prompts = encode_prompts(tok, train)
    engine = Engine(model_dir, seed=0, dtype=dtype, max_model_len=256, gpu_memory_utilization=0.2)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=0)
    t0 = time.perf_counter()
    groups = engine.generate(prompts, [params] * len(prompts), [GROUP] * len(prompts))
    seconds = time.perf_counter() - t0
    engine.close()
    rows = [
        [
            {
                "prompt_ids": s.prompt_ids,
                "completion_ids": s.completion_ids,
                "logprobs": s.logprobs,
                "finish_reason": s.finish_reason,
                "reward": reward(extract_answer(s.text), p.answer),
            }
            for s in g
        ]
        for g, p in zip(groups, train, strict=True)
    ]
    Path(out).write_text(json.dumps({"dtype": dtype, "generate_s": seconds, "groups": rows}))


def _engine_samples(model_dir: Path, dtype: str, work: Path) -> dict[str, Any] | str:
    """The engine's samples in `dtype`, or the error text when the engine could not run it."""
    out = work / f"gen_{dtype}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.precision", "gen", str(model_dir), dtype, str(out)],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    if proc.returncode != 0:
        return (proc.stdout + proc.stderr)[-2000:]
    return json.loads(out.read_text())


def _batches(groups: list[list[dict]]) -> list[Any]:
    """STEPS TrainBatches of PROMPTS_PER_STEP groups each, from the engine's samples."""
    import torch

    from shared.schema import Rollout, Scored, pack_f32, pack_i32
    from trainer_svc.batch import TrainBatch

    out = []
    for step in range(STEPS):
        samples = []
        for g, group in enumerate(groups[step * PROMPTS_PER_STEP : (step + 1) * PROMPTS_PER_STEP]):
            for i, s in enumerate(group):
                r = Rollout(
                    job_id="p",
                    msg_id=f"p/{step}/{g}/{i}",
                    group_id=f"p/{step}/{g}",
                    policy_version=0,
                    policy_version_max=0,
                    prompt_index=g,
                    sample_index=i,
                    group_size=GROUP,
                    generator_id="p",
                    prompt_ids=pack_i32(s["prompt_ids"]),
                    completion_ids=pack_i32(s["completion_ids"]),
                    logprobs=pack_f32(s["logprobs"]),
                    completion="",
                    answer="0",
                    finish_reason=s["finish_reason"],
                )
                samples.append(
                    Scored(
                        job_id="p",
                        msg_id=r.msg_id,
                        group_id=r.group_id,
                        policy_version=0,
                        rollout=r,
                        reward=s["reward"],
                    )
                )
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32).view(-1, GROUP)
        out.append(TrainBatch.of(samples, rewards))
    return out


def _mismatch(model: Any, batches: list[Any], dtype: str) -> dict[str, float]:
    """Token-mean k3 KL(mu || pi) and mean |log pi - log mu| of the trainer in `dtype` on every
    batch's model tokens (the behaviour logprobs are the engine's)."""
    import torch

    from trainer_svc.algorithms import mismatch_k3
    from trainer_svc.logprobs import token_logprobs
    from trainer_svc.precision import autocast

    kl = gap = n = 0.0
    gap_max = 0.0
    with torch.no_grad(), autocast("cpu", dtype)():
        for b in batches:
            ids, attn, behaviour, mask, temp = b.micro_batch(0, len(b), 0)
            lp = token_logprobs(model, ids, attn, temp)
            kl += float(mismatch_k3(lp, behaviour, mask).sum())
            d = (lp - behaviour).abs() * mask
            gap += float(d.sum())
            gap_max = max(gap_max, float(d.max()))
            n += float(mask.sum())
    return {"mismatch_kl": kl / n, "logprob_gap_mean": gap / n, "logprob_gap_max": gap_max, "tokens": n}


def _curves(model_dir: Path, batches: list[Any], threads: int) -> dict[str, Any]:
    """STEPS Learner steps per dtype on the same batches, interleaved; metrics and seconds per step."""
    import torch

    from shared.jobspec import JobSpec
    from trainer_svc.learner import Learner

    learners = {}
    for dtype in ("float32", "bfloat16"):
        spec = JobSpec(
            model_path=str(model_dir),
            group_size=GROUP,
            prompts_per_step=PROMPTS_PER_STEP,
            sampling={"max_tokens": MAX_TOKENS},
            algorithm={"lr": LR, "micro_batch_size": GROUP * PROMPTS_PER_STEP, "dtype": dtype},
        )
        torch.manual_seed(0)
        learners[dtype] = Learner(spec, "cpu")
    torch.set_num_threads(threads)
    curves: dict[str, list[dict[str, float]]] = {d: [] for d in learners}
    for b in batches:
        for dtype, learner in learners.items():
            t0 = time.perf_counter()
            m = learner.step(b)
            curves[dtype].append(
                {
                    "loss": m["loss"],
                    "mismatch_kl": m["mismatch_kl"],
                    "grad_norm": m["grad_norm"],
                    "entropy": m["entropy"],
                    "step_s": time.perf_counter() - t0,
                }
            )
    w32, w16 = (learners[d].model.state_dict() for d in ("float32", "bfloat16"))
    num = sum(float((w16[k] - w32[k]).pow(2).sum()) for k in w32)
    moved = sum(float((w32[k] - w0).pow(2).sum()) for k, w0 in _initial(model_dir).items())
    return {"curves": curves, "weight_drift_l2": num**0.5, "fp32_update_l2": moved**0.5}


def _initial(model_dir: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def bench_precision(out_dir: str = "results", threads: int = 2) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.tiny_model import build_tiny_model
    from asyncrl.warmstart import warm_start
    from bench.claims import machine, update_trainer_results

    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-precision-"))
    raw = build_tiny_model(work / "raw", seed=0, **MODEL)
    model_dir = work / "warm"
    warm = warm_start(raw, model_dir, steps=WARM_STEPS, lr=1e-3, seed=0)
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())

    engines: dict[str, Any] = {}
    mismatch: dict[str, dict[str, float]] = {}
    batches_fp32 = None
    for engine_dtype in ("float32", "bfloat16"):
        got = _engine_samples(model_dir, engine_dtype, work)
        if isinstance(got, str):
            engines[engine_dtype] = {"error": got}
            continue
        engines[engine_dtype] = {"generate_s": got["generate_s"]}
        batches = _batches(got["groups"])
        if engine_dtype == "float32":
            batches_fp32 = batches
        for trainer_dtype in ("float32", "bfloat16"):
            mismatch[f"engine_{engine_dtype}/trainer_{trainer_dtype}"] = _mismatch(model, batches, trainer_dtype)
    if batches_fp32 is None:
        raise RuntimeError(f"the float32 engine failed:\n{engines['float32']['error']}")
    curves = _curves(model_dir, batches_fp32, threads)
    c32, c16 = curves["curves"]["float32"], curves["curves"]["bfloat16"]
    t32, t16 = _median([c["step_s"] for c in c32]), _median([c["step_s"] for c in c16])
    res = {
        "model": {
            **MODEL,
            "vocab_size": int(model.config.vocab_size),
            "params": params,
            "warm_start": {"steps": WARM_STEPS, **warm},
        },
        "samples": {
            "steps": STEPS,
            "groups_per_step": PROMPTS_PER_STEP,
            "group_size": GROUP,
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
        },
        "engines": engines,
        "mismatch": mismatch,
        "fp32_mismatch_kl": mismatch["engine_float32/trainer_float32"]["mismatch_kl"],
        "bf16_mismatch_kl": mismatch["engine_float32/trainer_bfloat16"]["mismatch_kl"],
        "learner": {
            "lr": LR,
            "loss": "aipo",
            "threads": threads,
            **curves,
            "median_step_s": {"float32": t32, "bfloat16": t16},
            "bf16_vs_fp32_step_time": t16 / t32,
        },
        "method": "mismatch KL: token mean of k3 = (r - 1) - log r, r = pi/mu, over every sampled token, mu the "
        "engine's behaviour logprobs (processed, temperature 1), pi the trainer's on the same tokens at "
        "the same weights (policy version 0: staleness 0); loss curves: the Learner's step on the float32 "
        "engine's batches, the two dtypes interleaved step by step",
        "machine": machine(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "seconds": time.perf_counter() - t_start,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "precision.json").write_text(json.dumps(res, indent=2) + "\n")
    update_trainer_results(
        out,
        res,
        ("bf16_mismatch_kl", "fp32_mismatch_kl"),
        "mismatch_kl_unit",
        "nats per token, k3 of KL(vLLM float32 engine || trainer), bench/precision.py",
    )
    (out / "precision.md").write_text(_markdown(res))
    return res


def _markdown(res: dict[str, Any]) -> str:
    m, L = res["model"], res["learner"]
    lines = [
        f"# Precision: what bfloat16 costs ({m['params'] / 1e6:.1f}M-param Llama, {m['layers']} layers, hidden "
        f"{m['hidden']}, warm-started {m['warm_start']['steps']} steps; CPU, {L['threads']} threads)",
        "",
        "## Mismatch KL between the vLLM engine and the trainer",
        "",
        "| engine | trainer | mismatch KL (k3, nats/token) | mean abs logprob gap | max | tokens |",
        "|---|---|---|---|---|---|",
    ]
    for key, v in res["mismatch"].items():
        eng, tr = (p.split("_", 1)[1] for p in key.split("/"))
        lines.append(
            f"| {eng} | {tr} | {v['mismatch_kl']:.3g} | {v['logprob_gap_mean']:.3g} | "
            f"{v['logprob_gap_max']:.3g} | {v['tokens']:.0f} |"
        )
    for eng, v in res["engines"].items():
        if "error" in v:
            lines += ["", f"The {eng} engine did not run: `{v['error'].strip().splitlines()[-1][:300]}`"]
    lines += [
        "",
        "## Learner steps on the same batches (float32 engine's samples)",
        "",
        "| step | loss fp32 | loss bf16 | mismatch_kl fp32 | mismatch_kl bf16 | grad norm fp32 | grad norm bf16 "
        "| s fp32 | s bf16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (a, b) in enumerate(zip(L["curves"]["float32"], L["curves"]["bfloat16"], strict=True), start=1):
        lines.append(
            f"| {i} | {a['loss']:.4g} | {b['loss']:.4g} | {a['mismatch_kl']:.3g} | {b['mismatch_kl']:.3g} | "
            f"{a['grad_norm']:.4g} | {b['grad_norm']:.4g} | {a['step_s']:.2f} | {b['step_s']:.2f} |"
        )
    lines += [
        "",
        f"Median step: float32 {L['median_step_s']['float32']:.2f} s, bfloat16 "
        f"{L['median_step_s']['bfloat16']:.2f} s ({L['bf16_vs_fp32_step_time']:.2f}x; CPU autocast, 2 cores "
        "shared with other work). After the last step the bfloat16 weights are "
        f"{L['weight_drift_l2']:.3g} (L2) from the float32 ones, whose own update from the start is "
        f"{L['fp32_update_l2']:.3g}.",
        "",
        res["method"] + ".",
        "",
        "Steps after the first train on samples of the initial policy (a fixed set), so their mismatch_kl "
        "also holds the policy's drift since; step 1's is the precision alone.",
        "",
        "CUDA-only and not run here (no GPU on this machine): `generator.quantization: fp8` (the CPU build "
        "refuses it at engine start, tested), CUDA autocast, FSDP2's MixedPrecisionPolicy (bfloat16 "
        "all-gathers, float32 reduce-scatter; trainer_svc/precision.py), and a bfloat16 engine on a GPU "
        "(other kernels than the CPU's). What ran: CPU autocast (1 rank here; 2 FSDP2 ranks over gloo in "
        "tests/trainer_svc/test_distributed.py) and vLLM's CPU engine in float32 and bfloat16.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "gen":
        generate(sys.argv[2], sys.argv[3], sys.argv[4])
