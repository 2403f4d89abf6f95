"""The job spec's `reward` section (light: pydantic only)."""

from __future__ import annotations

from typing import Literal

REWARDS = ("exact_match", "math_verify", "python_exec")

RewardSpec = Literal["exact_match", "math_verify", "python_exec"]
