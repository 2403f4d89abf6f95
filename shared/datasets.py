"""Datasets: the job spec's task section and the loader that turns local files into problems.

Light at import (pydantic only); the `datasets` library is imported inside the loaders.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TASKS = ("arithmetic", "gsm8k")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskSpec(_Strict):
    name: Literal["arithmetic", "gsm8k"] = Field(
        "arithmetic", description="Prompt source: the built-in synthetic arithmetic task or a GSM8K-format JSONL file."
    )
    path: str | None = Field(None, description="Local JSONL file for `gsm8k` (question/answer with `#### <number>`).")
    test_path: str | None = Field(None, description="Optional held-out JSONL; else a seeded split of `path`.")
    n_train: int = Field(300, ge=1, le=10_000_000, description="Training problems to draw (arithmetic) or keep.")
    n_test: int = Field(100, ge=1, le=100_000, description="Held-out problems for evaluation.")

    @model_validator(mode="after")
    def _path_for_files(self) -> TaskSpec:
        if self.name == "gsm8k" and not self.path:
            raise ValueError("task.path is required for task.name='gsm8k': give a local JSONL file")
        return self
