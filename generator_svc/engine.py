"""The vLLM engine: the one module in the project that imports vllm (CPU build or CUDA build).

`Engine.generate` runs one batch of prompt groups to completion at a single policy version, so no
generate call ever mixes versions; `Engine.load_version` swaps weights in place between calls.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.schema import LoraAdapter, Manifest, SamplingParams

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

# The ranks vLLM's LoRA slots come in (its LoRAConfig.max_lora_rank accepts only these).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class TransferError(RuntimeError):
    """A weight version could not be fetched or verified; the engine still holds the old weights."""


@dataclass(frozen=True)
class Sample:
    """One completion of one prompt."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each sampled token, (T,)
    text: str
    finish_reason: str | None
    # a multi-turn episode (generator_svc/episodes.py): 1 per model token, 0 per environment
    # token (empty: all the model's); its model turns, why it ended and its metrics
    model_mask: bytes = b""
    turns: int = 1
    stop_reason: str | None = None
    env_metrics: dict[str, float] = field(default_factory=dict)


def prepare(*, kv_cache_gib: int = 1, in_process: bool = True) -> float:
    """Set vLLM's environment and import it: the slowest part of a generator's start, done before
    its job (and so the model) is known. Returns the seconds it took."""
    t0 = time.perf_counter()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    if in_process:
        # Engine core and its one worker in this process: no engine-core and worker processes
        # that each import torch and vLLM again (on 2 CPU cores the engine starts in ~5 s
        # instead of ~24 s). Tensor parallelism needs the multi-process engine.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm  # noqa: F401 - heavy; imported once, here
    from vllm import LLM  # noqa: F401 - as heavy again (the engine's modules): before a job, not after

    _eager_token_ranks()
    return time.perf_counter() - t0


def _eager_token_ranks() -> None:
    """On the CPU, vLLM's rank of each sampled or prompt token (`batched_count_greater_than`, part
    of every request with logprobs, which every request of ours is) is a torch.compile'd function:
    its first call compiles with inductor, 2-3.5 s measured on this project's 2-core box, paid by
    a generator's first verified swap, inside every cold start. Eager, it is the same expression at
    the cost of one boolean copy of the logits. CUDA builds keep vLLM's compiled kernel."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.v1.sample.sampler as sampler

    def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:  # (N, V), (N, 1) -> (N,)
        return (x >= values).sum(-1)

    if hasattr(sampler, "batched_count_greater_than"):
        sampler.batched_count_greater_than = count_at_least


def check_quantization(quantization: str | None, *, cpu: bool) -> None:
    """Refuse an online quantization the device cannot run: fp8 needs a CUDA GPU."""
    if quantization is not None and cpu:
        raise ValueError(
            f"quantization {quantization!r} needs a CUDA GPU; this vLLM runs on the CPU: "
            "unset generator.quantization (generator.dtype bfloat16 is the CPU's lower precision)"
        )


class Engine:
    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        dtype: str = "float32",
        max_model_len: int = 256,
        gpu_memory_utilization: float = 0.2,
        kv_cache_gib: int = 1,
        enforce_eager: bool = True,
        in_process: bool = True,
        enable_sleep_mode: bool = False,
        lora_rank: int | None = None,
        max_loras: int = 1,
        quantization: str | None = None,
    ):
        """`lora_rank`: jobs train LoRA adapters of this rank over this engine's base; versions
        arrive as adapters (`load_version` with an `adapter`). Each job is a `tenant` with its
        own adapter (vLLM's multi-LoRA: `max_loras` of them loaded at once), and every generate,
        score and fingerprint call of a tenant applies that tenant's newest adapter."""
        prepare(kv_cache_gib=kv_cache_gib, in_process=in_process)
        from vllm import LLM
        from vllm.platforms import current_platform

        # checked here, where the device is known (a job spec is validated before any engine exists)
        check_quantization(quantization, cpu=current_platform.is_cpu())

        # vLLM's CPU runner cannot rewind a seeded request's random generator (torch's CPU
        # generators have no offset): a seeded request whose prefill is split across engine steps
        # crashed the engine with "CPU Generator does not use offset" once a call's prompts passed
        # the step's token budget (4096). Unchunked prefill never splits one, and a step's budget
        # of at least the context fits any prompt whole.
        cpu = (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, max_model_len)}
            if current_platform.is_cpu()
            else {}
        )
        # The options that depend on the set-up. With dtype and quantization, which vLLM types as
        # Literals: our settings carry them as str (quantization checked above, dtype by vLLM).
        options: dict[str, Any] = {"dtype": dtype, "quantization": quantization, **cpu}
        if in_process:
            options["distributed_executor_backend"] = "uni"
        if lora_rank:
            options.update(
                enable_lora=True,
                max_loras=max(1, max_loras),
                max_cpu_loras=max(1, max_loras) + 1,  # a tenant's next adapter is added before its old one goes
                max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lora_rank),
            )

        self._llm = LLM(
            model=model_path,
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            # Logprobs after temperature, top-k and top-p: the distribution we actually sampled from
            # is the behaviour policy the importance weights divide by; the trainer applies the same
            # cut to its logits (trainer_svc/logprobs.py `truncate`, ARCHITECTURE.md).
            logprobs_mode="processed_logprobs",
            worker_extension_cls="generator_svc.worker_ext.WeightSyncExtension",
            # co-located on a GPU: sleep (weights to host, KV cache freed) while the trainer steps
            enable_sleep_mode=enable_sleep_mode,
            **options,
        )
        # each tenant's (job's) adapter loaded now; a tenant without one generates with the base weights
        self._loras: dict[str, LoRARequest] = {}
        self._lora_ids = 0  # vLLM caches adapters by int id: every load takes a new one
        self._lora_root = Path(tempfile.mkdtemp(prefix="asyncrl-lora-")) if lora_rank else None

    def generate(
        self,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        n: list[int],
        tenant: str | list[str] = "",
    ) -> list[list[Sample]]:
        """One blocking generate call with `tenant`'s adapter (if it has one; a list: each
        prompt's tenant, several jobs' prompts in one call, each with its own adapter). A prompt is
        token ids (generated from exactly as given) or text (tokenized by vLLM). Returns, per
        prompt, its n samples."""
        from vllm import SamplingParams as VSamplingParams

        vparams = [
            VSamplingParams(
                n=k,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                max_tokens=p.max_tokens,
                seed=p.seed,
                logprobs=0,
                stop=list(p.stop) or None,
                stop_token_ids=list(p.stop_token_ids) or None,
                min_tokens=p.min_tokens,
                include_stop_str_in_output=p.include_stop_str_in_output,
            )
            for p, k in zip(params, n, strict=True)
        ]
        from vllm.inputs import TokensPrompt

        inputs: list[str | TokensPrompt] = [
            TokensPrompt(prompt_token_ids=list(x)) if isinstance(x, list) else x for x in prompts
        ]
        lora: LoRARequest | None | list[LoRARequest | None] = (
            [self._loras.get(t) for t in tenant] if isinstance(tenant, list) else self._loras.get(tenant)
        )
        outs = self._llm.generate(inputs, vparams, use_tqdm=False, lora_request=lora)  # type: ignore[arg-type]
        result = []
        for out in outs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                # (a step without its logprobs leaves the count short: refused below)
                lps = [
                    float(step[tok].logprob)
                    for step, tok in zip(c.logprobs or [], ids, strict=False)
                    if step is not None
                ]
                if len(lps) != len(ids):
                    raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
                if out.prompt_token_ids is None:
                    raise RuntimeError("vLLM returned no prompt token ids")
                group.append(Sample(list(out.prompt_token_ids), ids, lps, c.text, c.finish_reason))
            result.append(group)
        return result

    def load_version(
        self,
        transport: str,
        address: str,
        manifest: Manifest,
        adapter: LoraAdapter | None = None,
        tenant: str = "",
    ) -> dict:
        """Pull, verify and swap in one version; then drop KV computed with the old weights.

        `adapter`: the version is a LoRA adapter of `tenant`: the worker writes it as a PEFT
        folder, vLLM loads it under a new adapter id, and the tenant's previous adapter is
        removed (the other tenants' stay)."""
        t0 = time.perf_counter()
        if adapter is not None:
            return self._load_adapter(transport, address, manifest, adapter, t0, tenant)
        res = self._llm.collective_rpc(
            "asyncrl_load_version", args=(transport, address, manifest.model_dump(mode="json"))
        )[0]
        if not res["ok"]:
            raise TransferError(f"policy v{manifest.version} from {transport}://{address}: {res['error']}")
        self._llm.reset_prefix_cache()
        res["total_s"] = time.perf_counter() - t0
        return res

    def _load_adapter(
        self, transport: str, address: str, manifest: Manifest, adapter: LoraAdapter, t0: float, tenant: str
    ) -> dict:
        from vllm.lora.request import LoRARequest

        if self._lora_root is None:
            raise TransferError(
                f"policy v{manifest.version} is a LoRA adapter, but this engine was built "
                "without lora_rank (the job's spec has no lora)"
            )
        self._lora_ids += 1
        path = self._lora_root / f"{tenant or 'job'}-v{manifest.version}-{self._lora_ids}"
        res = self._llm.collective_rpc(
            "asyncrl_fetch_adapter",
            args=(transport, address, manifest.model_dump(mode="json"), adapter.model_dump(mode="json"), str(path)),
        )[0]
        if not res["ok"]:
            raise TransferError(f"policy v{manifest.version} from {transport}://{address}: {res['error']}")
        t1 = time.perf_counter()
        request = LoRARequest(f"{tenant or 'job'}/v{manifest.version}#{self._lora_ids}", self._lora_ids, str(path))
        try:
            self._llm.llm_engine.add_lora(request)  # loads it now: a bad adapter fails here, not mid-generate
        except Exception as exc:  # noqa: BLE001 - vLLM refused the adapter: keep the old one
            shutil.rmtree(path, ignore_errors=True)
            raise TransferError(f"policy v{manifest.version}: vLLM did not load the adapter: {exc}") from exc
        self._drop_adapter(tenant)
        self._loras[tenant] = request
        self._llm.reset_prefix_cache()
        res["load_s"] += time.perf_counter() - t1
        res["total_s"] = time.perf_counter() - t0
        return res

    def score(self, token_ids: list[int], tenant: str = "") -> list[float]:
        """log p(token[t+1] | token[:t+1]) for t = 0..P-2 under the engine's current weights
        (with `tenant`'s adapter, if it has one)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        out = self._llm.generate(
            [TokensPrompt(prompt_token_ids=list(token_ids))],
            VSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0),
            use_tqdm=False,
            lora_request=self._loras.get(tenant),
        )[0]
        # position 0 has no logprob (nothing conditions it); each later dict holds the actual token.
        steps = out.prompt_logprobs
        if steps is None:
            raise RuntimeError("vLLM returned no prompt logprobs")
        lps = []
        for d, tok in zip(steps[1:], token_ids[1:], strict=True):
            if d is None:
                raise RuntimeError("vLLM returned no logprobs for a prompt token")
            lps.append(float(d[tok].logprob))
        return lps

    @staticmethod
    def device_type() -> str:
        """The device vLLM runs on here: "cpu" with the CPU build, "cuda" on an NVIDIA GPU."""
        from vllm.platforms import current_platform

        return str(current_platform.device_type)

    def sleep(self) -> None:
        """Level 1: the weights go to host memory and the KV cache is freed (GPU only; the engine
        must be built with `enable_sleep_mode`). Nothing may be generating."""
        self._llm.sleep(level=1)

    def wake_up(self) -> None:
        """Weights back on the device and a fresh KV cache: ready to swap and generate."""
        self._llm.wake_up()

    def close(self) -> None:
        """Shut the engine core (its process, when it has one) down now rather than at interpreter exit."""
        self._llm.llm_engine.engine_core.shutdown(timeout=10)
        if self._lora_root is not None:
            shutil.rmtree(self._lora_root, ignore_errors=True)

    def fingerprint(self, tenant: str = "") -> str:
        """xxh3 of the engine's own parameters; with `tenant`'s adapter loaded, also of its tensors."""
        base = self._llm.collective_rpc("asyncrl_fingerprint")[0]
        lora = self._loras.get(tenant)
        if lora is None:
            return base
        return f"{base}+{self._llm.collective_rpc('asyncrl_adapter_fingerprint', args=(lora.lora_path,))[0]}"

    def adapter_name(self, tenant: str = "") -> str:
        """The name of `tenant`'s adapter loaded now ("" without one): `<tenant>/v<version>#<id>`."""
        lora = self._loras.get(tenant)
        return "" if lora is None else lora.lora_name

    def release(self, tenant: str) -> None:
        """`tenant` (a job) is over here: its adapter leaves the engine; the others stay."""
        self._drop_adapter(tenant)

    def _drop_adapter(self, tenant: str) -> None:
        old = self._loras.pop(tenant, None)
        if old is not None:
            self._llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
