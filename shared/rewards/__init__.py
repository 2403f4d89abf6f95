"""Rewards: the built-ins by name, user plug-ins by import path, weighted sums, remote scorers, LLM
judges and learned reward models, all behind one scorer.

    scorer = build_scorer(job.reward, workers=settings.workers)   # imports plug-ins: fails fast
    results = scorer.score_sync([RewardInput(prompt, completion, answer, metadata, finish_reason)])
    reward = scorer.reward_for(results[0])   # None: the policy (on_failure "drop") drops it

The spec's shapes are in shared.rewards.spec, the user-function convention in shared.rewards.python,
the worker processes and time budgets in shared.rewards.pool. In `shared` (no torch, vLLM or Redis:
the model kind imports torch when built) because the reward service scores with it and so does the
offline checkpoint evaluation.
"""

from shared.rewards.base import RewardInput, RewardLoadError, RewardResult, Status
from shared.rewards.builtin import (
    REWARD_FUNCTIONS,
    RewardFn,
    exact_match,
    extract_program,
    get_reward_fn,
    math_verify,
    python_exec,
)
from shared.rewards.registry import KINDS, RewardScorer, build_scorer
from shared.rewards.remote import JUDGE_RULES
from shared.rewards.spec import REWARDS, RewardSpec

__all__ = [
    "JUDGE_RULES",
    "KINDS",
    "REWARDS",
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardInput",
    "RewardLoadError",
    "RewardResult",
    "RewardScorer",
    "RewardSpec",
    "Status",
    "build_scorer",
    "exact_match",
    "extract_program",
    "get_reward_fn",
    "math_verify",
    "python_exec",
]
