"""The architectures users train, checked against vLLM's CPU build (`python -m bench ecosystem-arch`):
the `architectures` section of results/ecosystem.json.

Per architecture of `asyncrl.tiny_archs.ARCHITECTURES` (a tiny random model with its family's
tokenizer type and chat template), one engine (`generator_svc.engine.Engine`, LoRA slots on) in one
process, and the trainer's model beside it:

1. `mismatch_kl_initial`: chat-templated prompts sampled by vLLM (plain, and temperature 0.7 with
   top_p 0.9 and top_k 20); the trainer scores the sampled tokens (`trainer_svc.logprobs.
   sequence_logprobs`, the sampler's cut included) and the per-token k3 mismatch KL
   (`trainer_svc.algorithms.mismatch_k3`, the step metric `mismatch_kl`) is averaged.
2. Two full weight swaps, one after the other (every parameter moved by N(0, 0.02) each time),
   through the generator's own path: `flatten_weights` -> `build_manifest` -> `TcpWeightServer`
   -> `Engine.load_version`, each followed by the post-swap probe check
   (`generator_svc.service.probe_gap` against `trainer_svc.weights.probe`, tolerance
   `probe_atol` at float32: 1e-3). `fingerprint_ok`: the worse gap is within it, the same check
   failed before the first swap (so it can fail), and the engine's fingerprint changed.
3. `mismatch_kl_sync`: step 1 again on the swapped weights: what a sync-mode step sees.
4. `lora_ok`: every default LoRA target module (`LoraSpec().target_modules`) is found on the
   model (`trainer_svc.lora.wrap` raises naming any it lacks); `lora_swap_ok`: an adapter (B moved
   off zero) swapped in by `Engine.load_version(adapter=...)` passes the same probe check, and
   `mismatch_kl_lora` is step 1 with the adapter applied.

An architecture whose engine cannot start here gets `reason`: the exception's type and message.
Every architecture runs in its own process (`--check ARCH`): vLLM's engine holds process-wide state.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.claims import machine
from bench.ecosystem import ARCH_KL_GATE as KL_GATE
from bench.ecosystem import markdown, merge_results

PROMPTS = ["17+25=", "What is 3+4?", "Hello, world!", "Answer with the number only: 0+19="]
N_SAMPLES = 4
MAX_TOKENS = 16
# (temperature, top_p, top_k): plain sampling, and a truncated sampler (the trainer cuts its
# distribution the way vLLM's sampler does)
SAMPLERS = ((1.0, 1.0, 0), (0.7, 0.9, 20))
NOISE = 0.02  # the weight swap's move
SWAPS = (1, 2)  # the versions swapped in, one after the other
LORA_RANK = 8


def _mismatch_kl(engine: Any, model: Any, prompts: list[list[int]], pad_id: int) -> tuple[float, int]:
    """Mean k3 mismatch KL per token of vLLM's samples (max over SAMPLERS) and the tokens scored."""
    import torch

    from shared.schema import SamplingParams
    from trainer_svc.algorithms import mismatch_k3
    from trainer_svc.logprobs import sequence_logprobs

    worst, tokens = 0.0, 0
    for t, p, k in SAMPLERS:
        params = SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=MAX_TOKENS, seed=0)
        groups = engine.generate(prompts, [params] * len(prompts), [N_SAMPLES] * len(prompts))
        samples = [s for g in groups for s in g if s.completion_ids]
        with torch.no_grad():
            ours = sequence_logprobs(
                model,
                [s.prompt_ids for s in samples],
                [s.completion_ids for s in samples],
                temperature=t,
                pad_id=pad_id,
                top_k=k,
                top_p=p,
            )
        pi = torch.cat(ours)
        mu = torch.cat([torch.tensor(s.logprobs, dtype=torch.float32) for s in samples])
        kl = mismatch_k3(pi[None], mu[None], torch.ones(1, pi.numel())).sum().item() / max(pi.numel(), 1)
        worst, tokens = max(worst, kl), tokens + pi.numel()
    return worst, tokens


def _announce(version: int, model: Any, state: Any, server: Any, lora: Any = None) -> Any:
    """Serve `state` as `version` and the announcement a trainer would publish for it."""
    from shared.schema import PolicyAnnouncement, pack_f32, pack_i32
    from shared.transport import build_manifest
    from trainer_svc.weights import flatten_weights, probe

    entries, buf = flatten_weights(state)
    manifest = build_manifest(version, entries, buf)
    server.serve(manifest, buf)
    ids, lp = probe(model)
    return PolicyAnnouncement(
        job_id="arch",
        msg_id=f"arch/v{version}",
        policy_version=version,
        manifest=manifest,
        transport=server.name,
        address=server.address,
        probe_ids=pack_i32(ids),
        probe_logprobs=pack_f32(lp),
        lora=lora,
    )


def _tokenizer_kind(spec: Any) -> str:
    return "byte-level BPE" if spec.tokenizer.__name__ == "byte_level_bpe" else "SentencePiece-style BPE"


def check_arch(arch: str, work: Path, lora_slots: bool = True) -> dict[str, Any]:
    """Every check of the module docstring on architecture `arch`; in this process (vLLM's engine
    included), so call it in a process of its own (`--check`). `lora_slots` False: the engine
    without LoRA (for an architecture whose engine starts only so), the LoRA swap left out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.tiny_archs import arch_spec, build_tiny_arch
    from generator_svc.engine import Engine
    from generator_svc.service import probe_atol, probe_gap
    from shared.jobspec import LoraSpec
    from shared.transport import TcpWeightServer
    from trainer_svc import lora
    from trainer_svc.weights import checkpoint_state

    torch.set_num_threads(2)
    spec = arch_spec(arch)
    model_dir = build_tiny_arch(arch, work / arch, seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    out: dict[str, Any] = {
        "model_type": spec.model_type,
        "tokenizer": _tokenizer_kind(spec),
        "features": spec.notes,
    }
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out["parameters"] = sum(p.numel() for p in model.parameters())
    prompts = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        ).input_ids
        for p in PROMPTS
    ]
    atol = probe_atol(1e-3, "float32", None)
    t0 = time.perf_counter()
    try:
        engine = Engine(
            str(model_dir), seed=0, dtype="float32", max_model_len=256, lora_rank=LORA_RANK if lora_slots else None
        )
    except Exception as exc:  # noqa: BLE001 - the answer for this architecture: why it cannot run here
        out["reason"] = f"{type(exc).__name__}: {exc}".strip()[:600]
        out["reason_trace"] = traceback.format_exc()[-2000:]
        return out
    out["engine_start_s"] = round(time.perf_counter() - t0, 1)
    server = TcpWeightServer(keep=3)
    try:
        pad = tok.pad_token_id or 0
        try:
            out["mismatch_kl_initial"], out["tokens_scored"] = _mismatch_kl(engine, model, prompts, pad)
        except Exception as exc:  # noqa: BLE001 - the engine started but cannot generate: why it cannot run
            out["reason"] = f"{type(exc).__name__}: {exc}".strip()[:600]
            out["reason_trace"] = traceback.format_exc()[-2000:]
            return out

        # the full swap, twice (as a job swaps version after version): the worse probe gap counts
        fp0, gaps = engine.fingerprint(), []
        for version in SWAPS:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * NOISE)
            ann = _announce(version, model, checkpoint_state(model, model.state_dict()), server)
            if version == SWAPS[0]:
                out["probe_gap_before_swap"] = before = probe_gap(engine, ann)
            try:
                engine.load_version(ann.transport, ann.address, ann.manifest)
            except Exception as exc:  # noqa: BLE001 - recorded: the swap's answer for this architecture
                out["fingerprint_ok"], out["swap_reason"] = False, f"{type(exc).__name__}: {exc}"[:600]
                out["reason_trace"] = traceback.format_exc()[-2000:]
                return out
            gaps.append(probe_gap(engine, ann))
        out["probe_gap"] = max(gaps)
        out["fingerprint_changed"] = engine.fingerprint() != fp0
        out["fingerprint_ok"] = bool(out["probe_gap"] <= atol < before and out["fingerprint_changed"])
        if out["probe_gap"] > atol:
            out["swap_reason"] = (
                f"after a full swap the engine does not reproduce the trainer's probe "
                f"(max |logprob gap| {out['probe_gap']:.3g} > {atol:g})"
            )
        out["mismatch_kl_sync"], _ = _mismatch_kl(engine, model, prompts, pad)

        # LoRA with the default targets, over the swapped weights the engine now holds
        lspec = LoraSpec(rank=LORA_RANK)
        swapped = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            peft = lora.wrap(model, lspec)
            out["lora_ok"] = True
        except ValueError as exc:  # a default target the model lacks: named, then the ones it has
            out["lora_ok"], out["lora_reason"] = False, str(exc)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            model.load_state_dict(swapped)
            have = lora.linear_names(model)
            lspec = LoraSpec(rank=LORA_RANK, target_modules=[t for t in lspec.target_modules if t in have])
            peft = lora.wrap(model, lspec)
        out["lora_targets"] = lora.targets_found(peft, lspec.target_modules)
        if not lora_slots:
            return out
        with torch.no_grad():
            for _, p in lora.trainable(peft):
                p.add_(torch.randn_like(p) * 0.1)
        ann = _announce(SWAPS[-1] + 1, peft, lora.adapter_state(peft), server, lspec.adapter())
        try:
            engine.load_version(ann.transport, ann.address, ann.manifest, ann.lora)
        except Exception as exc:  # noqa: BLE001 - recorded: the adapter swap's answer here
            out["lora_swap_ok"], out["lora_swap_reason"] = False, f"{type(exc).__name__}: {exc}"[:600]
            return out
        out["lora_probe_gap"] = probe_gap(engine, ann)
        out["lora_swap_ok"] = out["lora_probe_gap"] <= atol
        out["mismatch_kl_lora"], _ = _mismatch_kl(engine, peft, prompts, pad)
    finally:
        server.close()
        engine.close()
    return out


def _ok(r: dict[str, Any]) -> bool:
    return (
        "reason" not in r
        and r.get("mismatch_kl_initial", 1.0) <= KL_GATE
        and r.get("mismatch_kl_sync", 1.0) <= KL_GATE
        and r.get("fingerprint_ok") is True
        and r.get("lora_ok") is True
        and r.get("lora_swap_ok") is True
    )


def _check_process(arch: str, work: Path, timeout_s: float, lora_slots: bool) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    res_path = work / f"{arch}.json"
    res_path.unlink(missing_ok=True)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": root}
    cmd = [sys.executable, "-m", "bench.ecosystem_arch", "--check", arch, "--work", str(work), "--out", str(res_path)]
    proc = subprocess.run(
        cmd + ([] if lora_slots else ["--no-lora"]),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        cwd=root,
    )
    if proc.returncode != 0 or not res_path.exists():
        raise RuntimeError(f"{arch}: check process exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return dict(json.loads(res_path.read_text()))


def run_check(arch: str, work: Path, timeout_s: float = 600) -> dict[str, Any]:
    """`check_arch` in a fresh process (this checkout's packages; vLLM's KV cache at 1 GiB); if
    the engine does not start with LoRA slots, again without them (`lora_swap_reason` says why)."""
    t0 = time.perf_counter()
    try:
        res = _check_process(arch, work, timeout_s, lora_slots=True)
    except RuntimeError as exc:  # the engine with LoRA slots took the process down: try without
        res = {"reason": str(exc).strip().splitlines()[-1]}
    if "reason" in res:
        plain = _check_process(arch, work, timeout_s, lora_slots=False)
        if "reason" not in plain:
            plain["lora_swap_ok"], plain["lora_swap_reason"] = False, f"engine with LoRA slots: {res['reason']}"
            res = plain
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["ok"] = _ok(res)
    return res


def bench_ecosystem_arch(
    out_dir: str = "results", workdir: str = "runs/bench-ecosystem-arch", archs: list[str] | None = None
) -> dict[str, Any]:
    """Check every architecture, merge `architectures` (+ `architectures_machine`) into
    `out_dir`/ecosystem.json and rewrite ecosystem.md."""
    from asyncrl.tiny_archs import ARCHITECTURES

    started = time.time()
    section = {}
    for a in archs or list(ARCHITECTURES):
        try:
            section[a] = run_check(a, Path(workdir))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the process died: its output is the answer
            spec = ARCHITECTURES[a]
            section[a] = {
                "model_type": spec.model_type,
                "features": spec.notes,
                "ok": False,
                "reason": str(exc)[-2000:],
            }
            section[a]["tokenizer"] = _tokenizer_kind(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "architectures": section,
        "architectures_machine": {**machine(), "wall_s": round(time.time() - started, 1), "loadavg": _loadavg()},
    }
    data = merge_results(out / "ecosystem.json", results)
    (out / "ecosystem.md").write_text(markdown(data))
    return results


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="one architecture's checks, in this process (bench/ecosystem_arch.py)")
    p.add_argument("--check", required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--no-lora", action="store_true", help="the engine without LoRA slots")
    a = p.parse_args(argv)
    a.out.write_text(json.dumps(check_arch(a.check, a.work, lora_slots=not a.no_lora), indent=2))


if __name__ == "__main__":
    main()
