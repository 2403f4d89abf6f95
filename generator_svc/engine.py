"""The vLLM engine: the one module in the project that imports vllm (CPU build or CUDA build).

`Engine.generate` runs one batch of prompt groups to completion at a single policy version, so no
generate call ever mixes versions; `Engine.load_version` swaps weights in place between calls.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from shared.schema import Manifest, SamplingParams


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

    return time.perf_counter() - t0


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
        quantization: str | None = None,
    ):
        prepare(kv_cache_gib=kv_cache_gib, in_process=in_process)
        from vllm import LLM
        from vllm.platforms import current_platform

        if quantization is not None and current_platform.is_cpu():
            # checked here, where the device is known (a job spec is validated before any engine exists)
            raise ValueError(f"quantization {quantization!r} needs a CUDA GPU; this vLLM runs on the CPU: "
                             "unset generator.quantization (generator.dtype bfloat16 is the CPU's lower precision)")

        # vLLM's CPU runner cannot rewind a seeded request's random generator (torch's CPU
        # generators have no offset): a seeded request whose prefill is split across engine steps
        # crashed the engine with "CPU Generator does not use offset" once a call's prompts passed
        # the step's token budget (4096). Unchunked prefill never splits one, and a step's budget
        # of at least the context fits any prompt whole.
        cpu = ({"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, max_model_len)}
               if current_platform.is_cpu() else {})

        self._llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            # Logprobs after temperature/top-p: the distribution we actually sampled from is the
            # behaviour policy the importance weights divide by.
            logprobs_mode="processed_logprobs",
            worker_extension_cls="generator_svc.worker_ext.WeightSyncExtension",
            # co-located on a GPU: sleep (weights to host, KV cache freed) while the trainer steps
            enable_sleep_mode=enable_sleep_mode,
            quantization=quantization,
            **({"distributed_executor_backend": "uni"} if in_process else {}),
            **cpu,
        )

    def generate(self, prompts: list[str | list[int]], params: list[SamplingParams], n: list[int]) -> list[list[Sample]]:
        """One blocking generate call. A prompt is token ids (generated from exactly as given) or
        text (tokenized by vLLM). Returns, per prompt, its n samples."""
        from vllm import SamplingParams as VSamplingParams

        vparams = [
            VSamplingParams(
                n=k,
                temperature=p.temperature,
                top_p=p.top_p,
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
        inputs = [{"prompt_token_ids": list(x)} if isinstance(x, list) else x for x in prompts]
        outs = self._llm.generate(inputs, vparams, use_tqdm=False)
        result = []
        for out in outs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs or [], ids, strict=False)]
                if len(lps) != len(ids):
                    raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
                group.append(Sample(list(out.prompt_token_ids), ids, lps, c.text, c.finish_reason))
            result.append(group)
        return result

    def load_version(self, transport: str, address: str, manifest: Manifest) -> dict:
        """Pull, verify and swap in one version; then drop KV computed with the old weights."""
        t0 = time.perf_counter()
        res = self._llm.collective_rpc(
            "asyncrl_load_version", args=(transport, address, manifest.model_dump(mode="json"))
        )[0]
        if not res["ok"]:
            raise TransferError(f"policy v{manifest.version} from {transport}://{address}: {res['error']}")
        self._llm.reset_prefix_cache()
        res["total_s"] = time.perf_counter() - t0
        return res

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token[t+1] | token[:t+1]) for t = 0..P-2 under the engine's current weights."""
        from vllm import SamplingParams as VSamplingParams

        out = self._llm.generate(
            [{"prompt_token_ids": list(token_ids)}],
            VSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0),
            use_tqdm=False,
        )[0]
        # position 0 has no logprob (nothing conditions it); each later dict holds the actual token.
        return [float(d[tok].logprob) for d, tok in zip(out.prompt_logprobs[1:], token_ids[1:], strict=True)]

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

    def fingerprint(self) -> str:
        return self._llm.collective_rpc("asyncrl_fingerprint")[0]
