"""`python -m bench trainer-mem`: peak memory per sample-token and tokens/s of one training
micro-step (forward + backward of the policy loss through trainer_svc's own functions) on a
~35M-parameter Llama with a 32k vocabulary, for the memory options of AlgorithmSpec
(issue 17 item 3): baseline, chunked logprobs (`logprob_chunk_tokens`), activation checkpointing
(`gradient_checkpointing`), both.

Memory on CPU: each configuration runs in a fresh subprocess; after a warm-up micro-step (which
also allocates the gradients, as after the first micro-batch of a step) the process's peak RSS is
reset (`/proc/self/clear_refs` 5) and the measured step's peak (VmHWM) minus the RSS at its start
is the step's peak memory: activations, logits and temporaries, not weights or gradients.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "baseline": {"logprob_chunk_tokens": 0, "gradient_checkpointing": False},
    "chunked": {"logprob_chunk_tokens": 128, "gradient_checkpointing": False},
    "checkpointing": {"logprob_chunk_tokens": 0, "gradient_checkpointing": True},
    "both": {"logprob_chunk_tokens": 128, "gradient_checkpointing": True},
}
MODEL = {
    "vocab_size": 32000,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "tie_word_embeddings": False,
}
BATCH, SEQ, PROMPT = 4, 512, 64


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def one(name: str, threads: int = 2, reps: int = 2) -> dict[str, Any]:
    """One configuration, in this (fresh) process."""
    import gc

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.jobspec import AlgorithmSpec
    from trainer_svc.algorithms import BatchNorm, LossConfig, LossInputs, policy_loss
    from trainer_svc.learner import enable_gradient_checkpointing
    from trainer_svc.logprobs import token_logprobs_and_entropy

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    spec = AlgorithmSpec(**CONFIGS[name])
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).float().train()
    if spec.gradient_checkpointing:
        assert enable_gradient_checkpointing(model)
    params = sum(p.numel() for p in model.parameters())
    cfg = LossConfig.from_spec(spec)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g)
    attn = torch.ones_like(ids)
    mask = torch.zeros(BATCH, SEQ - 1)
    mask[:, PROMPT - 1 :] = 1.0
    temp = torch.full((BATCH,), 1.0)
    adv = torch.randn(BATCH, generator=g)
    norm = BatchNorm.from_lengths([SEQ - PROMPT] * BATCH, max_len=SEQ - PROMPT)

    def step() -> None:
        lp, ent = token_logprobs_and_entropy(
            model, ids, attn, temp, entropy_grad=cfg.entropy_coef > 0, chunk_tokens=spec.logprob_chunk_tokens
        )
        out = policy_loss(LossInputs(lp, lp.detach() - 0.01, adv, mask, entropy=ent), cfg, norm)
        out.loss.backward()
        del lp, ent, out

    step()  # warm-up: allocator, thread pools, the gradients
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
    start = _status("VmRSS")
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    peak = _status("VmHWM") - start
    times = [first]
    for _ in range(reps - 1):
        gc.collect()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    tokens = BATCH * SEQ
    return {
        "config": name,
        **CONFIGS[name],
        "params": params,
        "batch": BATCH,
        "seq": SEQ,
        "vocab": MODEL["vocab_size"],
        "peak_bytes": peak,
        "peak_mem_per_token": peak / tokens,
        "step_s": min(times),
        "tokens_per_s": tokens / min(times),
    }


def demo_speed(threads: int = 2, reps: int = 20) -> dict[str, Any]:
    """Forward + backward of the logprobs at the demo's size (the tiny model's shape and
    104-token vocabulary, a 64-sample micro-batch of 24 tokens), unchunked vs chunked, interleaved:
    the default of `logprob_chunk_tokens` is chosen by this."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer_svc.logprobs import token_logprobs_and_entropy

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=104,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        )
    ).train()
    ids = torch.randint(0, 104, (64, 24))
    attn, temp = torch.ones_like(ids), torch.ones(64)
    times: dict[int, list[float]] = {0: [], 256: []}
    for r in range(reps + 2):
        for chunk in times:
            t0 = time.perf_counter()
            lp, _ = token_logprobs_and_entropy(model, ids, attn, temp, chunk_tokens=chunk)
            lp.sum().backward()
            if r >= 2:
                times[chunk].append(time.perf_counter() - t0)
    med = {c: sorted(v)[len(v) // 2] for c, v in times.items()}
    return {
        "shape": "2 layers, hidden 128, vocab 104, micro-batch 64 x 24",
        "median_ms_unchunked": 1000 * med[0],
        "median_ms_chunked_256": 1000 * med[256],
        "chunked_vs_unchunked": med[256] / med[0],
    }


def bench_trainer_mem(out_dir: str = "results", threads: int = 2) -> dict[str, Any]:
    """Every configuration in its own subprocess; results/trainer_mem.json and .md."""
    from bench.claims import machine, update_trainer_results

    rows = []
    for name in CONFIGS:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.trainer_mem", name, str(threads)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"trainer-mem {name} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    demo = demo_speed(threads)
    by = {r["config"]: r for r in rows}
    best = min(rows, key=lambda r: r["peak_mem_per_token"])
    res = {
        "model": {**MODEL, "params": rows[0]["params"]},
        "batch": BATCH,
        "seq": SEQ,
        "threads": threads,
        "method": "fresh subprocess per config; peak RSS (VmHWM after clear_refs 5) minus RSS at the start of "
        "one forward+backward of the policy loss (token_logprobs_and_entropy + policy_loss), after a "
        "warm-up step that allocates the gradients; tokens/s = batch x seq / best of 2 steps",
        "configs": rows,
        "demo_size_speed": demo,
        "peak_mem_per_token_before": by["baseline"]["peak_mem_per_token"],
        "peak_mem_per_token_after": best["peak_mem_per_token"],
        "after_config": best["config"],
        "machine": machine(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer_mem.json").write_text(json.dumps(res, indent=2) + "\n")
    update_trainer_results(
        out,
        res,
        ("peak_mem_per_token_before", "peak_mem_per_token_after"),
        "peak_mem_per_token_unit",
        "bytes of peak RSS growth per sample-token (bench/trainer_mem.py)",
    )
    base = by["baseline"]
    lines = [
        f"# Trainer memory per sample-token ({rows[0]['params'] / 1e6:.1f}M-param Llama, vocab "
        f"{MODEL['vocab_size']}, micro-batch {BATCH} x {SEQ} tokens, {threads} threads, CPU)",
        "",
        "| config | logprob_chunk_tokens | gradient_checkpointing | peak MiB | peak KiB / token | vs baseline "
        "| tokens/s | vs baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['logprob_chunk_tokens']} | {r['gradient_checkpointing']} | "
            f"{r['peak_bytes'] / 2**20:.0f} | {r['peak_mem_per_token'] / 1024:.1f} | "
            f"{r['peak_mem_per_token'] / base['peak_mem_per_token']:.2f}x | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x |"
        )
    lines += [
        "",
        res["method"] + ".",
        "",
        f"At the demo's size ({demo['shape']}) chunked logprobs take {demo['chunked_vs_unchunked']:.2f}x the "
        f"time of unchunked ({demo['median_ms_chunked_256']:.0f} vs {demo['median_ms_unchunked']:.0f} ms, "
        "median forward+backward), with logits of under 1 MB to save: so `logprob_chunk_tokens` defaults to 0 "
        "(off) and is a knob for large vocabularies. Timings share 2 cores with other work and vary by tens "
        "of per cent between runs; the memory figures do not.",
        "",
    ]
    (out / "trainer_mem.md").write_text("\n".join(lines))
    return res


if __name__ == "__main__":
    print(json.dumps(one(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)))
