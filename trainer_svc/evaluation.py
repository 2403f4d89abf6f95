"""In-pipeline evaluation: the job's named evaluation sets, their rounds, and their results.

An evaluation round is one entry on the prompts stream (shared.schema.EvalRound): one generator
generates all of it in one call, so every round measures exactly one policy version. The
`Evaluator` starts the rounds that are due, collects their scored samples as the trainer's
assembler completes each problem's group, and when a round is whole writes its figures (mean@n,
pass@k, maj@n; shared.evalmetrics) to the ledger with the wall-clock seconds since the job started.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.ledger import TrainerLedger
from broker.ledger.rows import UsedItem
from broker.streams import GROUP_TRAINERS, SCORED, JobStreams
from shared.evalmetrics import episode_means, round_metrics
from shared.ids import eval_group_id, eval_round
from shared.jobspec import EvalSetSpec, JobSpec
from shared.prompts import Rendered, usable
from shared.schema import EvalItem, SamplingParams, pack_i32, unpack_i32
from shared.tasks import Problem
from trainer_svc.algorithms import staleness
from trainer_svc.feeder import Feeder, Group
from trainer_svc.tracking import Tracking
from trainer_svc.validation import Fed

log = logging.getLogger(__name__)


@dataclass
class EvalSet:
    spec: EvalSetSpec
    items: list[EvalItem]  # its problems, rendered once
    sampling: SamplingParams

    @functools.cached_property
    def indices(self) -> frozenset[int]:
        return frozenset(it.prompt_index for it in self.items)


@dataclass
class Round:
    name: str  # the evaluation set
    step: int  # the policy after this step is evaluated
    expected: int  # problems still to complete (dead-lettered or lost ones are taken off)
    groups: list[Group] = field(default_factory=list)
    settled: set[str] = field(default_factory=set)  # problem group ids dead-lettered or lost


def build_sets(
    spec: JobSpec, problems: Mapping[str, Sequence[Problem]], render: Callable[[Problem], Rendered]
) -> dict[str, EvalSet]:
    """Each evaluation set of the job with its problems (`problems[name]`) rendered as round
    items and its sampling (the job's stop rules, the set's temperature, n and length). A problem
    that cannot be rendered fails the build or is left out (task.bad_rows; shared.prompts.usable)."""
    out = {}
    for es in spec.evaluation_sets():
        items = []
        for p in usable(problems[es.name], render, spec.task.bad_rows, f"evaluation set {es.name}"):
            r = render(p)
            items.append(
                EvalItem(
                    prompt_index=p.index,
                    prompt=r.text,
                    prompt_ids=pack_i32(r.ids),
                    answer=p.answer,
                    metadata=dict(p.metadata),
                )
            )
        sampling = spec.sampling.params(
            temperature=es.sampling.temperature,
            top_p=es.sampling.top_p,
            top_k=es.sampling.top_k,
            max_tokens=es.sampling.max_tokens or spec.sampling.max_tokens,
        )
        out[es.name] = EvalSet(es, items, sampling)
    return out


class Evaluator:
    """The rounds of a job's evaluation sets: start what is due, collect, record.

    `started` holds (set, step) pairs whose round was fed, by this trainer run or a predecessor
    (a resumed trainer must not feed a round twice, nor wait for one that was recorded)."""

    def __init__(
        self,
        spec: JobSpec,
        sets: dict[str, EvalSet],
        feeder: Feeder,
        streams: JobStreams,
        ledger: TrainerLedger,
        job_id: str,
        tracking: Tracking | None = None,
    ):
        self.spec, self.sets, self.feeder, self.streams, self.ledger = spec, sets, feeder, streams, ledger
        self.job_id, self.tracking = job_id, tracking or Tracking()
        self.rounds: dict[str, Round] = {}
        self.started: set[tuple[str, int]] = set()

    def restore(self, open_evals: dict[str, list[Any]], started: set[tuple[str, int]]) -> None:
        """Rounds a predecessor fed and did not record (the feeder's `open_evals`), and every
        (set, step) it fed."""
        self.started = set(started)
        for rnd, (step, name) in open_evals.items():
            if name in self.sets:
                self.rounds[rnd] = Round(name, int(step), len(self.sets[name].items))

    @property
    def pending(self) -> bool:
        return bool(self.rounds)

    def start_due(self, step: int, version: int, final: bool = False) -> None:
        """Feed a round of every set due after `step` (`final`: every set, the job has ended)."""
        for name, es in self.sets.items():
            if (final or self.spec.eval_due(es.spec, step)) and (name, step) not in self.started:
                self.started.add((name, step))
                rnd = self.feeder.feed_eval(version, step, name, es.items, es.spec.sampling.n, es.sampling)
                self.rounds[rnd] = Round(name, step, len(es.items))

    def add(self, g: Group) -> bool:
        """A complete evaluation group: kept for its round; False when no round of this trainer
        run (or of one it resumed) expects it."""
        rnd = self.rounds.get(eval_round(g.group_id))
        if rnd is None:
            return False
        rnd.groups.append(g)
        return True

    def fed_as(self, group_id: str) -> Fed | None:
        """What evaluation group `group_id` was fed as (its set's n and max_tokens, its problem),
        or None when no open round of this run has it."""
        rnd = self.rounds.get(eval_round(group_id))
        if rnd is None:
            return None
        es = self.sets[rnd.name]
        index = group_id.rsplit("/", 1)[1]
        if not index.isdigit() or int(index) not in es.indices:
            return None
        return Fed(es.spec.sampling.n, prompt_index=int(index), max_tokens=es.sampling.max_tokens)

    def dead(self, g: Group) -> None:
        """A problem that can never complete (dead-lettered): its round expects one fewer."""
        rnd = self.rounds.get(eval_round(g.group_id))
        if rnd is not None and g.group_id not in rnd.settled:
            rnd.settled.add(g.group_id)
            rnd.expected -= 1

    def lost(self, rid: str, alive: set[str]) -> list[tuple[str, str, int, int, int]]:
        """The problems of round `rid` (its entry gone from the prompts stream) of which no stream
        holds anything and nothing arrived (TrainSink.settle_lost; `alive`: the group ids that
        left a trace): Redis lost them. The round expects them no more (`record_complete` records
        it with what arrived; a round of which nothing arrived is dropped here); they are returned
        for the ledger as (group id, eval set, prompt index, prompt tokens, n)."""
        rnd = self.rounds[rid]
        es = self.sets[rnd.name]
        arrived = {g.group_id for g in rnd.groups}
        out = [
            (gid, rnd.name, it.prompt_index, len(unpack_i32(it.prompt_ids)), es.spec.sampling.n)
            for it in es.items
            if (gid := eval_group_id(rid, it.prompt_index)) not in alive | arrived | rnd.settled
        ]
        rnd.settled.update(o[0] for o in out)
        rnd.expected -= len(out)
        if out and not rnd.groups and rnd.expected <= 0:
            del self.rounds[rid]
            self.feeder.eval_done(rid)
            log.warning(
                "eval %s (%s) after step %d: lost by Redis before it was generated; not measured",
                rid,
                rnd.name,
                rnd.step,
            )
        return out

    def record_complete(self, version: int) -> None:
        """Record every round whose problems have all arrived: its samples `evaluated` in the
        ledger, its figures, then ack its entries."""
        for rid, rnd in list(self.rounds.items()):
            if len(rnd.groups) < rnd.expected:
                continue
            del self.rounds[rid]
            self.feeder.eval_done(rid)
            if not rnd.groups:  # every problem dead-lettered: nothing measured
                log.warning("eval %s (%s) after step %d: every problem was dead-lettered", rid, rnd.name, rnd.step)
                continue
            es = self.sets[rnd.name].spec
            per_problem, versions, entries = [], set(), []
            used: list[UsedItem] = []
            for g in rnd.groups:
                samples = sorted(g.samples.values(), key=lambda s: s.rollout.sample_index)
                per_problem.append(([s.rollout.completion for s in samples], [s.reward for s in samples]))
                for s in samples:
                    versions.add(s.rollout.policy_version)
                    used.append(
                        {
                            "msg_id": s.msg_id,
                            "status": "evaluated",
                            "trainer_version": version,
                            "staleness": staleness(version, s.rollout.policy_version),
                        }
                    )
                entries += g.entries
            n = len(per_problem[0][1])
            metrics = round_metrics(per_problem, es.ks, es.pass_threshold)
            episodes = episode_means([s.rollout.env_metrics for g in rnd.groups for s in g.samples.values()])
            figures = {**metrics, **episodes} if n > 1 or episodes else None
            self.ledger.record_used(used)
            self.ledger.record_eval(
                self.job_id,
                rnd.step,
                min(versions),
                max(versions),
                metrics[f"mean@{n}"],
                len(used),
                name=rnd.name,
                metrics=figures,
            )
            self.tracking.eval(rnd.step, rnd.name, metrics[f"mean@{n}"], figures)
            self.streams.ack(SCORED, GROUP_TRAINERS, entries)
            log.info(
                "eval %s (%s) after step %d: reward %.3f %s (policy version %s)",
                rid,
                rnd.name,
                rnd.step,
                metrics[f"mean@{n}"],
                {k: round(v, 3) for k, v in metrics.items() if not k.startswith("mean@")},
                "..".join(map(str, sorted({min(versions), max(versions)}))),
            )
