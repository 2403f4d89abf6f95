"""LoRA fine-tuning through PEFT: the adapters on the trainer's model, and the names they take on
their way out (to generators: only the adapter; to checkpoints and exports: the adapter plus the
merged HF model).

Names. Inside the trainer the model is a `PeftModel`, whose state dict names a target module's
frozen weight `base_model.model.<hf>.base_layer.weight` and its adapter
`base_model.model.<hf>.lora_A.default.weight` / `lora_B`; every other tensor is
`base_model.model.<hf>`. PEFT saves an adapter without the adapter name (`...lora_A.weight`),
which is what vLLM's LoRA loader and `PeftModel.from_pretrained` read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from shared.jobspec import LoraSpec

ADAPTER_DIR = "adapter"  # a checkpoint's adapter, beside its merged HF model
ADAPTER_NAME = "default"  # PEFT's name for the one adapter
_PREFIX = "base_model.model."


def wrap(model: torch.nn.Module, spec: LoraSpec, seed: int = 0) -> torch.nn.Module:
    """`model` with LoRA adapters on `spec.target_modules` (A random, B zero: the same function
    as `model`); only the adapters require grad. Raises ValueError naming a target the model lacks."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # A's initialisation: every rank and every restart builds the same one
    # peft types lora_alpha int; it takes a float (scaling = lora_alpha / r)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    linear = sorted(linear_names(model))  # before PEFT wraps them
    peft = get_peft_model(model, config)
    missing = [t for t, n in targets_found(peft, spec.target_modules).items() if n == 0]
    if missing:
        # PEFT itself fails only when no target matches: a model lacking some would train
        # without adapters there, silently
        raise ValueError(
            f"lora.target_modules {missing} match no linear layer of this model "
            f"(its linear layers: {linear}); set lora.target_modules to names it has"
        )
    return peft


def linear_names(model: torch.nn.Module) -> set[str]:
    """The last name component of every nn.Linear of `model` (`q_proj`, ..., `lm_head`)."""
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def targets_found(model: torch.nn.Module, targets: list[str]) -> dict[str, int]:
    """Per LoRA target name, how many of `model`'s (a PeftModel's) modules of that name carry an adapter."""
    wrapped = [n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A") and n]
    return {t: wrapped.count(t) for t in targets}


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the optimizer updates (all of them in a full fine-tune), in model order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def adapter_name(param_name: str) -> str:
    """A PeftModel parameter's name as PEFT saves it: `...lora_A.default.weight` -> `...lora_A.weight`."""
    return param_name.replace(f".{ADAPTER_NAME}.", ".")


def adapter_state(model: torch.nn.Module, is_main: bool = True) -> dict[str, torch.Tensor]:
    """The adapter's full tensors under their saved names, on the CPU; on rank 0 only ({} on
    the others). With FSDP2 each parameter is a DTensor shard: gathering it is a collective,
    so every rank calls this, in the same parameter order."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in trainable(model):
        t = p.detach()
        t = t.full_tensor() if isinstance(t, DTensor) else t
        if is_main:
            out[adapter_name(name)] = t.to("cpu", copy=True).contiguous()
    return out


def load_adapter_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], is_main: bool = True) -> None:
    """Saved-name adapter tensors (rank 0's; the others pass {}) into the live adapters, in place.
    Sharded parameters take their slice of rank 0's tensor (a broadcast from rank 0)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = trainable(model)
    if is_main:
        want = {adapter_name(n) for n, _ in params}
        if set(state) != want:
            raise ValueError(
                f"adapter tensors {sorted(set(state) ^ want)[:4]}... do not match the model's adapters "
                f"(rank, targets or base model differ)"
            )
    with torch.no_grad():
        for name, p in params:
            if isinstance(d := p.data, DTensor):
                full = state[adapter_name(name)] if is_main else torch.empty(p.shape, dtype=p.dtype)
                src = distribute_tensor(full.to(p.device), d.device_mesh, d.placements, src_data_rank=0)
                d.to_local().copy_(src.to_local())
            else:
                p.copy_(state[adapter_name(name)])


def merged_state(peft_state: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The HF-named weights of the model the adapter stands for: for each target module,
    W + (alpha / rank) * B @ A (Hu et al. 2021, eq. 3: h = W0 x + B A x, scaled by alpha / r);
    every other tensor as it is. `peft_state`: a PeftModel's full state dict."""
    scale = spec.alpha / spec.rank
    out: dict[str, torch.Tensor] = {}
    for name, t in peft_state.items():
        if ".lora_" in name:
            continue
        hf = name.removeprefix(_PREFIX)
        if ".base_layer." in hf:
            module = hf.rsplit(".base_layer.", 1)[0]
            hf = hf.replace(".base_layer.", ".")
            if hf.endswith(".weight"):
                a = peft_state[f"{_PREFIX}{module}.lora_A.{ADAPTER_NAME}.weight"]  # (r, in)
                b = peft_state[f"{_PREFIX}{module}.lora_B.{ADAPTER_NAME}.weight"]  # (out, r)
                t = t + scale * (b.to(torch.float32) @ a.to(torch.float32)).to(t.dtype)
        out[hf] = t
    return out


def adapter_config(spec: LoraSpec, base_model: str) -> dict:
    """adapter_config.json as PEFT writes it: what vLLM and `PeftModel.from_pretrained` read."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": list(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_adapter(path: Path, state: Mapping[str, torch.Tensor], spec: LoraSpec, base_model: str) -> None:
    """A PEFT-format adapter folder: adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(adapter_config(spec, base_model), indent=2))


def read_adapter(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT-format adapter folder (saved names)."""
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))
