"""Kind `sum`: reward = sum_i weight_i * reward_i over named terms, each any reward kind.

Every term scores the whole batch, the terms concurrently. Scored.details holds each term's own
(unweighted) reward under its name, and a term's components as "<term>/<component>", so
reward = sum_i weight_i * details[name_i]. A sample any term failed on fails as a whole (status
timeout if a term timed out, else error; the reasons joined): a partial sum would be a different
reward, not a degraded one. The sum's on_failure then decides, as for any reward.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from shared.rewards.base import BuildContext, KindScorer, RewardInput, RewardResult, Status, failed
from shared.rewards.spec import SumReward


class SumScorer:
    def __init__(self, spec: SumReward, ctx: BuildContext) -> None:
        self._terms: list[tuple[str, float, KindScorer]] = [(t.name, t.weight, ctx.build(t.reward)) for t in spec.terms]

    async def score(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        per_term = await asyncio.gather(*(scorer.score(items) for _, _, scorer in self._terms))
        out = []
        for i in range(len(items)):
            parts: dict[str, float] = {}
            weighted: list[float] = []
            failures: list[RewardResult] = []
            for (name, weight, _), results in zip(self._terms, per_term, strict=True):
                r = results[i]
                if not r.ok or r.reward is None:
                    failures.append(failed(r.status, f"term {name!r}: {r.reason}"))
                    continue
                parts[name] = r.reward
                parts.update({f"{name}/{k}": v for k, v in r.components.items()})
                weighted.append(weight * r.reward)
            if failures:
                status: Status = "timeout" if any(f.status == "timeout" for f in failures) else "error"
                out.append(failed(status, "; ".join(f.reason for f in failures)))
            else:
                out.append(RewardResult(reward=math.fsum(weighted), components=parts))
        return out

    async def aclose(self) -> None:
        await asyncio.gather(*(scorer.aclose() for _, _, scorer in self._terms))
