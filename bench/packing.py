"""`python -m bench packing`: one optimizer step (`Learner.step`, the trainer's own code) on a batch
with a long-tailed spread of completion lengths, padded micro-batches vs sequence packing
(issue 17 item 4): tokens/s (real tokens), the padding fraction (pad positions / positions the
model computes), peak memory per token, and the attention score pairs each layout computes.

The batch: GROUPS x N samples, prompts uniform in PROMPT_RANGE tokens, completions lognormal
(median COMPLETION_MEDIAN, sigma COMPLETION_SIGMA) cut at MAX_TOKENS, as RL completions are: most
short, a few at the cap. Padded: `micro_batch_size` samples per pass in batch order, each row as
long as the pass's longest sample. Packed: passes of at most `micro_batch_tokens` tokens.

Each measurement runs in a fresh subprocess (as bench/trainer_mem.py): a warm-up step on one group
(allocator, thread pools, the gradients), then the peak RSS is reset (`/proc/self/clear_refs` 5)
and the full step is timed; its peak RSS (VmHWM) minus the RSS at its start is the step's peak
memory. Padded and packed alternate, ROUNDS times each; figures are medians.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# A 19.7M-parameter Llama (16k vocabulary): the size class the issue names, a few minutes on 2
# quiet CPU cores (on cores shared with a heavy load one padded step took minutes).
MODEL = {
    "vocab_size": 16384,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
GROUPS, N = 8, 8
MAX_TOKENS, COMPLETION_MEDIAN, COMPLETION_SIGMA = 256, 40, 0.9
PROMPT_RANGE = (8, 48)
MICRO_BATCH_SIZE, MICRO_BATCH_TOKENS = 8, 512
ROUNDS = 3


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def build_model(out: Path) -> int:
    """A random-init Llama of MODEL's shape at `out`, with the tiny model's tokenizer (only its pad
    id is read); its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.tiny_model import build_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def batch_samples(seed: int = 0) -> list[Any]:
    """GROUPS x N scored samples with the long-tailed completion lengths described above."""
    import numpy as np

    from shared.schema import Rollout, Scored, pack_f32, pack_i32

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(GROUPS * N):
        c = int(np.clip(round(rng.lognormal(np.log(COMPLETION_MEDIAN), COMPLETION_SIGMA)), 1, MAX_TOKENS))
        p = int(rng.integers(*PROMPT_RANGE))
        r = Rollout(
            job_id="b",
            msg_id=f"b/g{i // N}/{i % N}",
            group_id=f"b/g{i // N}",
            policy_version=0,
            policy_version_max=0,
            prompt_index=i // N,
            sample_index=i % N,
            group_size=N,
            generator_id="b",
            prompt_ids=pack_i32([1, *rng.integers(4, MODEL["vocab_size"], p - 1)]),
            completion_ids=pack_i32(rng.integers(4, MODEL["vocab_size"], c)),
            logprobs=pack_f32(-rng.random(c) * 3),
            temperature=[1.0, 0.7][i % 2],
            finish_reason="length" if c == MAX_TOKENS else "stop",
            completion="",
            answer="",
        )
        samples.append(
            Scored(
                job_id="b",
                msg_id=r.msg_id,
                group_id=r.group_id,
                policy_version=0,
                rollout=r,
                reward=float(rng.random()),
            )
        )
    return samples


def _spec(model: Path, packing: bool):
    from shared.jobspec import JobSpec

    return JobSpec(
        model_path=str(model),
        group_size=N,
        prompts_per_step=GROUPS,
        sampling={"max_tokens": MAX_TOKENS},
        algorithm={"micro_batch_size": MICRO_BATCH_SIZE, "packing": packing, "micro_batch_tokens": MICRO_BATCH_TOKENS},
    )


def _batch(samples: list[Any]):
    import torch

    from trainer_svc.batch import TrainBatch

    groups = len(samples) // N
    return TrainBatch.of(samples, torch.tensor([s.reward for s in samples]).view(groups, N))


def layout() -> dict[str, Any]:
    """What each layout computes for the batch: passes, positions, pad fraction, attention pairs."""
    from trainer_svc.dist import Ranks

    batch = _batch(batch_samples())
    lengths = batch.sample_lengths()
    real = sum(lengths)
    needed = sum(n * (n + 1) // 2 for n in lengths)  # causal query-key pairs within each sample
    padded = [max(lengths[lo:hi]) * (hi - lo) for lo, hi in Ranks().micro_batches(len(batch), MICRO_BATCH_SIZE)]
    pad_pairs = sum(
        (hi - lo) * m * (m + 1) // 2
        for (lo, hi) in Ranks().micro_batches(len(batch), MICRO_BATCH_SIZE)
        for m in [max(lengths[lo:hi])]
    )
    packs = [sum(lengths[i] for i in b) for b in Ranks().packed_micro_batches(lengths, MICRO_BATCH_TOKENS)]  # type: ignore[union-attr]
    return {
        "samples": len(lengths),
        "real_tokens": real,
        "completion_tokens": int(batch.completion_lens.sum()),
        "completion_len": {
            "min": int(batch.completion_lens.min()),
            "median": float(batch.completion_lens.median()),
            "mean": float(batch.completion_lens.float().mean()),
            "max": int(batch.completion_lens.max()),
            "at_cap": int(batch.truncated.sum()),
        },
        "padded": {
            "passes": len(padded),
            "positions": sum(padded),
            "padding_fraction": 1 - real / sum(padded),
            "largest_pass_positions": max(padded),
            "attention_pairs_vs_needed": pad_pairs / needed,
        },
        "packed": {
            "passes": len(packs),
            "positions": sum(packs),
            "padding_fraction": 1 - real / sum(packs),
            "largest_pass_positions": max(packs),
            # CPU (sdpa with a block-diagonal mask) computes every pair of the row; varlen
            # flash attention on CUDA computes only the needed ones (1.0)
            "attention_pairs_vs_needed": sum(n * (n + 1) // 2 for n in packs) / needed,
        },
    }


def one(mode: str, model: str, threads: int) -> dict[str, Any]:
    """One measured step in this (fresh) process."""
    import gc

    import torch

    from trainer_svc.learner import Learner

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    learner = Learner(_spec(Path(model), mode == "packed"), "cpu")
    samples = batch_samples()
    learner.step(_batch(samples[:N]), lr=0.0)  # warm-up on one group; lr 0: the weights stay
    batch = _batch(samples)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    start = _status("VmRSS")
    t0 = time.perf_counter()
    metrics = learner.step(batch, lr=0.0)
    seconds = time.perf_counter() - t0
    return {
        "mode": mode,
        "step_s": seconds,
        "peak_bytes": _status("VmHWM") - start,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
    }


def bench_packing(out_dir: str = "results", threads: int = 2, rounds: int = ROUNDS) -> dict[str, Any]:
    """Padded and packed steps alternating in fresh subprocesses; results/packing.{json,md} and this
    item's keys of results/trainer.json."""
    from bench.claims import machine, update_trainer_results

    lay = layout()
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {"padded": [], "packed": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        params = build_model(model)
        for _ in range(rounds):
            for mode in runs:
                proc = subprocess.run(
                    [sys.executable, "-m", "bench.packing", mode, str(model), str(threads)],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if proc.returncode != 0:
                    raise RuntimeError(f"packing {mode} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
                runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    real = lay["real_tokens"]
    rows = {}
    for mode, rs in runs.items():
        step_s = statistics.median(r["step_s"] for r in rs)
        peak = statistics.median(r["peak_bytes"] for r in rs)
        rows[mode] = {
            "step_s": step_s,
            "step_s_all": [r["step_s"] for r in rs],
            "tokens_per_s": real / step_s,
            "peak_bytes": peak,
            "peak_bytes_all": [r["peak_bytes"] for r in rs],
            "peak_mem_per_position": peak / lay[mode]["largest_pass_positions"],
            "peak_mem_per_real_token": peak * lay[mode]["passes"] / real,
            "loss": rs[0]["loss"],
            "grad_norm": rs[0]["grad_norm"],
            **lay[mode],
        }
    pad, pack = rows["padded"], rows["packed"]
    res = {
        "model": {**MODEL, "params": params},
        "batch": {k: lay[k] for k in ("samples", "real_tokens", "completion_tokens", "completion_len")},
        "shape": {
            "groups": GROUPS,
            "group_size": N,
            "max_tokens": MAX_TOKENS,
            "completion_median": COMPLETION_MEDIAN,
            "completion_sigma": COMPLETION_SIGMA,
            "prompt_range": list(PROMPT_RANGE),
            "micro_batch_size": MICRO_BATCH_SIZE,
            "micro_batch_tokens": MICRO_BATCH_TOKENS,
        },
        "threads": threads,
        "rounds": rounds,
        "load_average_1m": [load_before, os.getloadavg()[0]],  # the machine's load at the start and the end
        "method": "fresh subprocess per measurement, padded and packed alternating; each: Learner.step (lr 0) on one "
        "group as warm-up, then peak RSS reset (clear_refs 5) and one timed Learner.step on the whole batch; "
        "peak memory = VmHWM - RSS at the step's start; medians over the rounds; tokens/s = real "
        "(prompt + completion) tokens / step seconds",
        "padded": pad,
        "packed": pack,
        "speedup_packed_vs_padded": pack["tokens_per_s"] / pad["tokens_per_s"],
        # each round's padded and packed steps ran back to back: their ratio is less exposed to load
        "speedup_per_round": [a / b for a, b in zip(pad["step_s_all"], pack["step_s_all"], strict=True)],
        "loss_abs_diff": abs(pack["loss"] - pad["loss"]),
        "padding_fraction_padded": pad["padding_fraction"],
        "padding_fraction_packed": pack["padding_fraction"],
        "tokens_per_s_padded": pad["tokens_per_s"],
        "tokens_per_s_packed": pack["tokens_per_s"],
        "machine": machine(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packing.json").write_text(json.dumps(res, indent=2) + "\n")
    update_trainer_results(
        out,
        res,
        ("padding_fraction_padded", "padding_fraction_packed", "tokens_per_s_padded", "tokens_per_s_packed"),
        "tokens_per_s_unit",
        "real (prompt + completion) tokens per second of Learner.step (bench/packing.py)",
    )
    (out / "packing.md").write_text(_markdown(res))
    return res


def _markdown(res: dict[str, Any]) -> str:
    b, pad, pack = res["batch"], res["padded"], res["packed"]
    cl = b["completion_len"]
    lines = [
        f"# Sequence packing: one trainer step, padded vs packed ({res['model']['params'] / 1e6:.1f}M-param Llama, "
        f"vocab {res['model']['vocab_size']}, {res['threads']} threads, CPU)",
        "",
        f"Batch: {b['samples']} samples ({res['shape']['groups']} groups x {res['shape']['group_size']}), "
        f"{b['real_tokens']} real tokens; completions lognormal, min {cl['min']}, median {cl['median']:.0f}, mean "
        f"{cl['mean']:.0f}, max {cl['max']} ({cl['at_cap']} at the {res['shape']['max_tokens']}-token cap); prompts "
        f"{res['shape']['prompt_range'][0]}-{res['shape']['prompt_range'][1]} tokens. Padded: "
        f"micro_batch_size {res['shape']['micro_batch_size']}; packed: micro_batch_tokens "
        f"{res['shape']['micro_batch_tokens']}.",
        "",
        "| layout | passes | positions computed | padding fraction | attention pairs / needed | step s (median) "
        "| tokens/s | vs padded | peak MiB | peak KiB / position | peak KiB / real token | vs padded |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in (("padded", pad), ("packed", pack)):
        lines.append(
            f"| {name} | {r['passes']} | {r['positions']} | {r['padding_fraction']:.3f} | "
            f"{r['attention_pairs_vs_needed']:.2f} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / pad['tokens_per_s']:.2f}x | {r['peak_bytes'] / 2**20:.0f} | "
            f"{r['peak_mem_per_position'] / 1024:.1f} | {r['peak_mem_per_real_token'] / 1024:.1f} | "
            f"{r['peak_mem_per_real_token'] / pad['peak_mem_per_real_token']:.2f}x |"
        )
    lines += [
        "",
        res["method"] + ".",
        "",
        "Peak KiB / position: the step's peak over its largest pass's positions (as bench/trainer_mem.py counts "
        "per token). Peak KiB / real token: the peak times the passes over the batch's real tokens (the memory a "
        "real token costs while its pass runs). Attention pairs / needed: query-key pairs the layout computes over "
        "the causal pairs within samples; on CPU the packed row's block-diagonal mask still computes every pair of "
        "the row, with varlen flash attention on CUDA (attn_implementation flash_attention_2) only the needed ones "
        "(1.00): not measured here (no GPU).",
        "",
        f"Loss padded {pad['loss']:.6f}, packed {pack['loss']:.6f} (|diff| {res['loss_abs_diff']:.1e}). Step times "
        f"padded {', '.join(f'{s:.2f}' for s in pad['step_s_all'])} s, packed "
        f"{', '.join(f'{s:.2f}' for s in pack['step_s_all'])} s; packed speed-up per round (padded s / packed s, "
        f"run back to back) {', '.join(f'{x:.2f}x' for x in res['speedup_per_round'])}. The machine's 1-minute load "
        f"average was {res['load_average_1m'][0]:.1f} at the start and {res['load_average_1m'][1]:.1f} at the end "
        f"({res['threads']} threads): other work on shared cores moves the timings, not the memory and padding "
        "figures.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(one(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2)))
