"""Kind `model`: a learned reward model, a local HF `AutoModelForSequenceClassification` with one
label, scored in batches inside the reward service. torch and transformers are imported when such
a scorer is built (shared imports without them).

The text scored is the spec's template over {prompt} {completion} {answer} (default: prompt then
completion); the reward is the model's single logit. Batches are right-padded; the model reads the
last non-padding token (transformers' sequence-classification heads find it from pad_token_id).
Forward passes run one at a time in a thread of their own, so the event loop keeps serving the
other rewards; a pass over the time budget is reported as `timeout` but cannot be interrupted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shared.rewards.base import (
    BuildContext,
    RewardInput,
    RewardLoadError,
    RewardResult,
    error_from,
    failed,
)
from shared.rewards.spec import ModelReward


class ModelScorer:
    def __init__(self, spec: ModelReward, ctx: BuildContext) -> None:
        if not (Path(spec.path) / "config.json").is_file():
            raise RewardLoadError(f"reward model {spec.path!r} is not an HF-format model directory (no config.json)")
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self._torch = torch
        self._spec = spec
        try:
            self._tok = AutoTokenizer.from_pretrained(spec.path)
            self._model: Any = AutoModelForSequenceClassification.from_pretrained(spec.path).to(spec.device).eval()
        except Exception as exc:
            raise RewardLoadError(f"reward model {spec.path!r} does not load: {type(exc).__name__}: {exc}") from exc
        if self._model.config.num_labels != 1:
            raise RewardLoadError(
                f"reward model {spec.path!r} has {self._model.config.num_labels} labels; a reward model has 1"
            )
        if self._tok.pad_token is None:
            self._tok.pad_token = self._tok.eos_token
        if self._model.config.pad_token_id is None:
            self._model.config.pad_token_id = self._tok.pad_token_id
        self._tok.padding_side = "right"
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model")

    def forward(self, texts: list[str]) -> list[float]:
        """The model's logit for each text. (B,) floats."""
        enc = self._tok(texts, padding=True, truncation=True, max_length=self._spec.max_length, return_tensors="pt").to(
            self._spec.device
        )
        with self._torch.inference_mode():
            logits = self._model(**enc).logits  # (B, 1)
        return [float(x) for x in logits[:, 0].float().cpu()]

    async def score(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        texts: list[str] = []
        out: list[RewardResult | None] = []
        for it in items:
            try:
                texts.append(self._spec.template.format(prompt=it.prompt, completion=it.completion, answer=it.answer))
                out.append(None)
            except (KeyError, IndexError, AttributeError) as exc:
                texts.append("")
                out.append(error_from(exc, "reward model template"))
        todo = [i for i, r in enumerate(out) if r is None]
        n = self._spec.batch_size
        loop = asyncio.get_running_loop()
        for start in range(0, len(todo), n):
            idx = todo[start : start + n]
            batch = [texts[i] for i in idx]
            try:
                scores = await asyncio.wait_for(
                    loop.run_in_executor(self._executor, self.forward, batch), self._spec.timeout_s
                )
                results = [RewardResult(reward=s) for s in scores]
            except asyncio.TimeoutError:
                results = [
                    failed(
                        "timeout",
                        f"reward model: a batch of {len(batch)} over the time budget of "
                        f"{self._spec.timeout_s:g} s (timeout_s)",
                    )
                ] * len(batch)
            except Exception as exc:
                results = [error_from(exc, "reward model")] * len(batch)
            for i, r in zip(idx, results, strict=True):
                out[i] = r
        return [r for r in out if r is not None]

    async def aclose(self) -> None:
        self._executor.shutdown(wait=False)
