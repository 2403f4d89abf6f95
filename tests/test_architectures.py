"""The architectures users train, on this system's vLLM CPU build (issue 36 item 5): per architecture
of asyncrl.tiny_archs (a tiny random model with its family's tokenizer type and chat template), one
engine in its own process (bench/ecosystem_arch.py `check_arch`) and the trainer's model beside it:

- vLLM's samples, scored by the trainer (its sampler cut included): mean k3 mismatch KL per token
  <= 1e-6, from the checkpoint and after the weight swaps (what a sync-mode step sees);
- two swaps in a row each pass the generator's post-swap probe check, which failed before the
  first, and change the engine's fingerprint (an MoE's too: generator_svc/worker_ext.py repacks
  vLLM's CPU experts after each reload);
- the default LoRA target modules are all found on the model, and an adapter swap passes the same
  probe check (with the adapter applied, the mismatch KL holds too); an MoE's are not (MOE below),
  and the test holds it to the stated reasons.

Every architecture must start on vLLM's CPU build; the MoEs' known limit (no LoRA) is asserted as
it stands, so a change in either direction fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.tiny_archs import ARCHITECTURES
from bench.ecosystem_arch import KL_GATE, run_check

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ATOL = 1e-3  # generator_svc.service.probe_atol at float32
# An MoE in transformers 5 keeps its experts as fused 3-D parameters, not linear layers: the default
# MLP targets are on no linear layer, and lora.wrap names them (the check then trains attention only).
MOE = ("qwen3_moe", "mixtral")
MOE_LORA_MISSING = "['gate_proj', 'up_proj', 'down_proj'] match no linear layer"
# vLLM's CPU build: with LoRA slots an MoE's experts go to vLLM's Triton MoE kernel, which the CPU
# build has no Triton for (the base model runs; bench/ecosystem_arch.py starts it without slots)
MOE_LORA_ENGINE = "module 'triton.language' has no attribute 'float32'"


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_architecture_trains_against_vllm(arch: str, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    r = run_check(arch, tmp_path)
    # every architecture starts on vLLM's CPU build
    assert "reason" not in r, f"{arch} did not start on vLLM: {r['reason']}\n{r.get('reason_trace', '')}"
    assert r["tokens_scored"] > 0
    assert r["mismatch_kl_initial"] <= KL_GATE, r
    assert r["mismatch_kl_sync"] <= KL_GATE, r
    assert r["probe_gap"] <= ATOL < r["probe_gap_before_swap"], r
    assert r["fingerprint_changed"] and r["fingerprint_ok"], r
    if arch in MOE:
        # what cannot run here (docs/running.md): neither MoE LoRA path works; a change here means
        # the limitation moved: update results/ecosystem.md and the docs
        assert not r["lora_ok"] and MOE_LORA_MISSING in r["lora_reason"], r
        assert not r["lora_swap_ok"] and MOE_LORA_ENGINE in r["lora_swap_reason"], r
        return
    assert all(n > 0 for n in r["lora_targets"].values()), r["lora_targets"]
    assert r["lora_ok"], r.get("lora_reason")
    assert r["lora_swap_ok"], r.get("lora_swap_reason", r.get("lora_probe_gap"))
    assert r["mismatch_kl_lora"] <= KL_GATE, r
