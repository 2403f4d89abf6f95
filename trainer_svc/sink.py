"""The train sink: scored deliveries in, a complete, fresh batch out (or nothing yet).

Everything between the scored stream and a step lives here: group assembly, dead letters (the
stream's and this trainer's own, for tokens the model cannot embed), evaluation groups handed to
their round, groups nobody in this trainer's lineage fed, and the batch filter (staleness bound,
dynamic sampling, versions a roll-back discarded), plus the replayed groups of a resume.
Parts.collect (trainer_svc/parts.py) `begin`s a step's batch, `add`s what it reads and `take`s
the batch once whole.

Batches are filled in feed order, not arrival order: a step takes the first `prompts_per_step`
training groups in flight that it does not drop, and waits for them. That is what makes the
feeder's version slots (trainer_svc/feeder.py) a promise: a group is never trained after the
version it was fed for, so one whose generator held at least that version minus k is never
dropped for staleness. Taking whatever completes first would let a later group overtake an
earlier one and push it one step later, past its bound: with several generators, groups finish
out of order, and such a group was generated for nothing. The staleness filter stays as the
safety net: after the bound is lowered, a group admitted under the old one can still be too stale.

The wait for a group's turn is bounded: a group whose generator died is generated again only once
another generator reclaims it, and no step should stall that long. Once a later group has been
ready for `order_wait_s()` (twice the recent step interval, at least ORDER_WAIT_MIN_S) while an
earlier one is still missing, the step trains around the missing one; it is trained in a later
step when it comes, or dropped there as too stale (the safety net again).
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from broker.ledger import TrainerLedger, write_isolating
from broker.ledger.rows import SampleIn, UsedItem
from broker.streams import GROUP_TRAINERS, PROMPTS, ROLLOUTS, SCORED, JobStreams
from shared.drop_skew import Sample
from shared.ids import group_seq, sample_ids
from shared.jobspec import JobSpec
from shared.rewards.base import FAILED
from shared.schema import Scored
from trainer_svc.algorithms import is_fresh, staleness
from trainer_svc.batch import TrainBatch
from trainer_svc.evaluation import Evaluator
from trainer_svc.feeder import DeadLetterWatch, DeadMember, Feeder, Group, GroupAssembler
from trainer_svc.guard import CollapseGuard
from trainer_svc.reward_errors import reward_out_of_range
from trainer_svc.shaping import no_signal
from trainer_svc.validation import INVALID_SAMPLE, NOT_A_MEMBER, STEP_ERROR, Fed, JobLimits, Rejection, check

log = logging.getLogger(__name__)

# A member's dead-letter code by the rule it broke, where it has its own (else INVALID_SAMPLE).
MEMBER_CODES = {"vocab": "token_out_of_vocab", "reward": "reward_out_of_range"}
# Dead-letter codes of a member whose reward failed (reward_svc, on_failure drop; this sink's range
# check): its group's drop counts as reward_failure in the drop skew (shared/drop_skew.py).
REWARD_FAILURE_CODES = ("reward_timeout", "reward_error", "reward_out_of_range")

# The least a step waits for a missing group's turn while later groups are ready (see the module
# docstring): above a healthy run's out-of-order lag (one generate call and its scoring).
ORDER_WAIT_MIN_S = 2.0
# Groups whose feed the sink remembers after they left the feeder (TrainSink.fed_seen): several
# steps' worth, a few KiB each.
FED_REMEMBER = 4096
# How often a step looks whether Redis lost the groups it waits for (TrainSink.settle_lost): once
# it has waited this long, or a later group overtook a missing one; then at most this often.
LOST_LOOK_S = 30.0


def record_used(ledger: TrainerLedger, items: Sequence[UsedItem]) -> int:
    """ledger.record_used; an item the database refuses (see broker.ledger.write_isolating) is
    logged and the rest recorded, so one bad row does not fail a step that trained. Returns how
    many rows changed."""
    done, refused = write_isolating(ledger.record_used, items)
    for i, why in refused.items():
        log.error("ledger refused the use of sample %s: %s", items[i]["msg_id"], why)
    return sum(done)


def out_of_vocab(s: Scored, vocab: int) -> str | None:
    """Why this model cannot embed a scored sample (a token id >= its vocabulary: the embedding
    lookup would fail the whole step), or None. The wire checks ids >= 0; only here is the
    vocabulary known."""
    for name, ids in (("prompt_ids", s.rollout.prompt_array()), ("completion_ids", s.rollout.completion_array())):
        if ids.size and int(ids.max()) >= vocab:
            i = int(np.argmax(ids >= vocab))
            return f"rollout.{name}[{i}] is {int(ids[i])}, outside the model's vocabulary of {vocab} tokens"
    return None


def overlong_reason(s: Scored, spec: JobSpec) -> str | None:
    """What the over-long treatment did to a trained sample, for its ledger row."""
    if s.rollout.finish_reason != "length" or spec.algorithm.overlong == "keep":
        return None
    what = "masked from the loss" if spec.algorithm.overlong == "mask" else "length penalty added to its reward"
    return f"over-long (cut at max_tokens {spec.sampling.max_tokens}): {what}"


def skew_sample(s: Scored) -> Sample:
    """A sample as the drop skew counts it: its completion length, and its reward unless that
    failed (a failed reward's 0.0 measures nothing)."""
    return s.rollout.num_completion_tokens, None if s.reward_status in FAILED else s.reward


def split_trained(samples: Sequence[Scored], spec: JobSpec) -> tuple[list[Sample], dict[str, list[Sample]]]:
    """A step's samples as the drop skew sees them: those trained on their reward, and those kept
    from it: over-long ones masked from the loss (`overlong`), and ones whose reward failed
    (`reward_failure`: under on_failure zero they train on a 0 that measures nothing)."""
    trained: list[Sample] = []
    kept: dict[str, list[Sample]] = {}
    for s in samples:
        if s.rollout.finish_reason == "length" and spec.algorithm.overlong == "mask":
            kept.setdefault("overlong", []).append(skew_sample(s))
        elif s.reward_status in FAILED:
            kept.setdefault("reward_failure", []).append(skew_sample(s))
        else:
            trained.append(skew_sample(s))
    return trained, kept


def flatten_batch(groups: list[Group]) -> tuple[list[Scored], torch.Tensor]:
    """Samples in group order and their rewards as (G, n)."""
    samples = [s for g in groups for s in sorted(g.samples.values(), key=lambda s: s.rollout.sample_index)]
    n = groups[0].size
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32).view(len(groups), n)
    return samples, rewards


@dataclass
class Batch:
    """One step's batch, and what filling it dropped."""

    step: int  # the step it trains
    version: int  # the policy it trains: its samples' trainer version (and `staleness` from it)
    bound: int  # the staleness bound it was filtered under
    redo: list[str] | None  # a resume's re-done step: exactly these groups
    groups: list[Group] = field(default_factory=list)
    dropped: list[UsedItem] = field(default_factory=list)  # ledger rows of dropped samples
    drop_entries: list[str] = field(default_factory=list)  # their stream entries
    filtered: int = 0  # groups dropped by dynamic sampling
    samples: list[Scored] = field(default_factory=list)  # in group order, once whole
    data: TrainBatch | None = None  # `samples` as tensors, once whole

    @property
    def staleness(self) -> list[int]:
        """Each sample's age when trained: `version` minus the policy version that generated it
        (the ledger's `staleness`, the off-policy metrics and the staleness-aware lr all read it)."""
        return [staleness(self.version, s.rollout.policy_version) for s in self.samples]


DEAD_STREAK_MIN = 32


def dead_streak_limit(spec: JobSpec) -> int:
    """Training groups in a row that may dead-letter before the job fails: four steps' worth, at
    least DEAD_STREAK_MIN (a healthy run loses a group now and then, never four steps in a row)."""
    return max(DEAD_STREAK_MIN, 4 * spec.prompts_per_step)


class TrainSink:
    def __init__(
        self,
        spec: JobSpec,
        streams: JobStreams,
        ledger: TrainerLedger,
        feeder: Feeder,
        evaluator: Evaluator,
        guard: CollapseGuard,
        vocab_size: int,
        context: int | None = None,
    ):
        self.spec, self.streams, self.ledger, self.feeder, self.evaluator = spec, streams, ledger, feeder, evaluator
        self.guard, self.vocab_size = guard, vocab_size
        self.limits = JobLimits.of(spec, streams.job_id, context)  # what every sample must keep to
        # the newest policy version the job has published (Parts sets it before anything is read);
        # None: not known, and no sample is held to it
        self.newest_version: int | None = None
        self.rejected: collections.Counter[str] = collections.Counter()  # samples dead-lettered, by rule
        self.rejected_reported = 0  # of which the step metrics already counted this many
        # training samples dropped since the last step's record, by drop reason (shared/drop_skew.py)
        self.drops: dict[str, list[Sample]] = {}
        self.replay_dead: dict[str, str] = {}  # replayed groups that were dead-lettered: why
        # what the recent groups were fed as, kept after they left the feeder (a late copy of a
        # used group is held to it too); the newest FED_REMEMBER
        self.fed_seen: dict[str, Fed] = {}
        self.assembler = GroupAssembler()
        self.dead_letters = DeadLetterWatch(streams, streams.job_id)  # groups that can no longer complete
        self.ready: dict[str, Group] = {}  # complete training groups by id, until their turn
        self.replay: dict[int, list[str]] = {}  # steps a predecessor trained after the checkpoint: their groups
        self.pending: Batch | None = None
        # group id -> when a later group was first seen ready while it was still missing
        self.overtaken_since: dict[str, float] = {}
        self.trained_around: set[str] = set()  # groups a step went past (logged once each)
        self.taken_at: deque[float] = deque(maxlen=9)  # when the recent batches were complete
        self.clock = time.monotonic
        self.dead_streak: list[str] = []  # why each training group dead-lettered since one last completed
        self.lost_checked_at = -math.inf  # when settle_lost last read the streams
        self.begun_at = 0.0  # when the batch pending was begun

    # --- in ------------------------------------------------------------------------------------

    def add(self, deliveries: list, version: int) -> int:
        """Scored samples -> complete groups -> ready, their eval round, or settled as unknown;
        then every eval round they completed is recorded. A sample that breaks a rule of the job
        or its group (trainer_svc/validation.py) or that the model cannot embed is dead-lettered
        instead (`_reject`). Returns how many were delivered."""
        for d in deliveries:
            why, fed = self._vet(d.message)
            if why is not None:
                self._reject(d, why, fed, version)
                continue
            g = self.assembler.add(d.entry_id, d.message)
            if g is not None:
                self._route(g, version)
        self.evaluator.record_complete(version)
        return len(deliveries)

    def _vet(self, s: Scored) -> tuple[Rejection | None, Fed | None]:
        """Why sample `s` may not be used (the job's rules, the model's vocabulary, then the job's
        reward range: trainer_svc/reward_errors.py), or None;
        and what its group was fed as (None: a group this run did not feed)."""
        r = s.rollout
        fed = self.feeder.fed_as(s.group_id) if r.purpose == "train" else self.evaluator.fed_as(s.group_id)
        if fed is None:
            fed = self.fed_seen.get(s.group_id)
        elif s.group_id not in self.fed_seen:
            self.fed_seen[s.group_id] = fed
            if len(self.fed_seen) > FED_REMEMBER:
                del self.fed_seen[next(iter(self.fed_seen))]
        held = self.assembler.open.get(s.group_id)
        peer = next(iter(held.samples.values())).rollout if held is not None and held.samples else None
        try:
            why = check(s, self.limits, fed, self.newest_version, peer)
            if why is None and (oov := out_of_vocab(s, self.vocab_size)) is not None:
                why = Rejection("vocab", oov)
            if why is None and (oor := reward_out_of_range(s, self.spec)) is not None:
                why = Rejection("reward", oor)
        except Exception as exc:  # a rule that cannot even be evaluated on it: no use either
            why = Rejection("error", f"{type(exc).__name__}: {exc}")
        return why, fed

    def _reject(self, d, why: Rejection, fed: Fed | None, version: int) -> None:
        """Dead-letter sample `d` with `why`. If it holds its group's place (a group this run fed,
        its msg_id the place's, no copy of it arrived first), the group can no longer complete as
        fed: the member is dead, and the group is dropped with the reason once the others are in
        (as for a member any service dead-letters). Otherwise (a sample of no group fed, an extra
        member, a second copy) it is dead-lettered alone (NOT_A_MEMBER) and its group is untouched."""
        s, r = d.message, d.message.rollout
        held = self.assembler.open.get(s.group_id)
        member = (
            fed is not None
            and why.rule not in ("job", "ids")
            and r.sample_index < fed.size
            and s.group_id not in self.assembler.closed
            and not (held is not None and s.msg_id in held.samples)
        )
        code = NOT_A_MEMBER if not member else MEMBER_CODES.get(why.rule, INVALID_SAMPLE)
        self.rejected[why.rule] += 1
        self.streams.dead_letter(SCORED, GROUP_TRAINERS, d.entry_id, why.reason, code=code, message=s)
        if member:
            assert fed is not None
            g = self.assembler.mark_dead(
                DeadMember(r.group_id, fed.size, r.sample_index, r.purpose, f"{code}: {why.reason}")
            )
            if g is not None:
                self._settle_dead(g, version)

    def note_drops(self, reason: str, samples: Iterable[Scored]) -> None:
        """Training samples dropped for `reason` (shared/drop_skew.py DROP_REASONS), for the next
        step's drop skew."""
        if noted := [skew_sample(s) for s in samples]:
            self.drops.setdefault(reason, []).extend(noted)

    def take_drops(self) -> dict[str, list[Sample]]:
        """The samples dropped since the last call, by reason (a step's drop skew)."""
        drops, self.drops = self.drops, {}
        return drops

    def take_rejected(self) -> int:
        """Samples dead-lettered by `add` since the last call (a step's `rejected/samples`)."""
        total = sum(self.rejected.values())
        new, self.rejected_reported = total - self.rejected_reported, total
        return new

    def poll_dead(self, version: int) -> int:
        """Settle the groups the dead-letter stream says can no longer complete; returns how many
        (their feeder slots are free again)."""
        freed = [g for g in map(self.assembler.mark_dead, self._as_fed(self.dead_letters.poll())) if g is not None]
        for g in freed:
            self._settle_dead(g, version)
        if freed:
            self.evaluator.record_complete(version)  # eval rounds the dead groups completed
        return len(freed)

    def _as_fed(self, dead: list[DeadMember]) -> list[DeadMember]:
        """Dead members as the job fed their groups: a training group has the job's group_size
        whatever the dead letter's payload claims (anyone may write one), and a member outside it
        is none."""
        n = self.spec.group_size
        return [
            m if m.purpose != "train" else DeadMember(m.group_id, n, m.sample_index, m.purpose, m.reason)
            for m in dead
            if m.purpose != "train" or m.sample_index is None or m.sample_index < n
        ]

    def _route(self, g: Group, version: int) -> None:
        if g.dead:
            self._settle_dead(g, version)
        elif g.purpose == "eval":
            if not self.evaluator.add(g):
                self._settle_unknown(g, version, "eval round not started by a trainer run this one resumed from")
        elif g.group_id not in self.feeder.in_flight:
            self._settle_unknown(
                g, version, "not in flight for this trainer run (fed by a predecessor after its last journal write)"
            )
        else:
            self.ready[g.group_id] = g
            self.dead_streak.clear()

    def _settle_unknown(self, g: Group, version: int, why: str) -> None:
        """A complete group this run did not feed (or a round it did not start): dropped with the
        reason, or, when it is a late copy of a sample already used, only acked."""
        record_used(
            self.ledger,
            [{"msg_id": m, "status": "dropped", "trainer_version": version, "drop_reason": why} for m in g.samples],
        )  # record_used leaves used samples as they are
        self.streams.ack(SCORED, GROUP_TRAINERS, g.entries)
        log.warning("group %s: %s", g.group_id, why)

    def _settle_dead(self, g: Group, version: int) -> None:
        """A group with a dead-lettered member (or a dead prompt group) can never be used whole:
        its samples are dropped with the reason, and its feeder or eval slot is freed."""
        why = ("dead-lettered: " + "; ".join(sorted(set(g.dead.values()))))[:1000]
        record_used(
            self.ledger,
            [{"msg_id": m, "status": "dropped", "trainer_version": version, "drop_reason": why} for m in g.msg_ids],
        )  # rows not written (nothing generated) change nothing
        self.streams.ack(SCORED, GROUP_TRAINERS, g.entries)
        if g.purpose == "eval":
            self.evaluator.dead(g)
        self.feeder.done(g.group_id)
        log.warning("group %s: %s", g.group_id, why)
        if any(g.group_id in ids for ids in self.replay.values()):
            self.replay_dead[g.group_id] = why
        if g.purpose == "train":
            failed = any(d.startswith(REWARD_FAILURE_CODES) for d in g.dead.values())
            self.note_drops("reward_failure" if failed else "other", g.samples.values())
            self.dead_streak.append(why.replace(g.group_id, "<group>"))  # alike reasons count together
            self._check_progress()

    def _check_progress(self) -> None:
        """A job whose every training group dead-letters (an environment that cannot start, an
        opening longer than the engine's context, a reward that always fails) would otherwise feed
        and wait until someone stops it: after `dead_streak_limit()` in a row with none complete
        between, it fails, saying why.

        Raises:
            RuntimeError: the streak's reasons, the most frequent first.
        """
        if len(self.dead_streak) < dead_streak_limit(self.spec):
            return
        counts = collections.Counter(self.dead_streak)
        reasons = "; ".join(f"{n} x {why}" for why, n in counts.most_common(3))
        raise RuntimeError(
            f"the last {len(self.dead_streak)} training groups were all dead-lettered and none "
            f"completed, so the job cannot make progress: {reasons}"[:2000]
        )

    # --- what Redis lost -----------------------------------------------------------------------

    def settle_lost(
        self, version: int, *, every: bool = False, min_interval_s: float | None = None, after_flush: bool = False
    ) -> int:
        """Settle the training groups and evaluation rounds this run fed of which no stream holds
        anything any more: Redis lost them (a failover to a replica that had not yet received
        the prompt, or the outputs made from it; ARCHITECTURE.md, "Redis Cluster"). Nobody will
        generate them again, so waiting would be forever: their samples are recorded `lost` in
        the ledger (rows written for those never generated) and their slots freed. Returns how
        many training groups and evaluation problems were settled.

        Looked for once a step went past a missing group (`trained_around`) or has waited
        LOST_LOOK_S for its groups, among those in flight and not ready and the open rounds; with
        `every`, always (the job's end). The streams are read at most once per `min_interval_s`
        (default LOST_LOOK_S).

        Exact, not a timeout: the streams are read in pipeline order (prompts, rollouts, scored),
        every hand-off is one atomic XADD of the output with the XACK of its input
        (publish_if_owned), and an entry is trimmed only once acked; so a group on its way is seen
        at the stage it has reached when that stage is read. Dead letters are polled after the
        reads (a dead-lettered prompt is acked out of the prompts stream): those groups settle as
        dead, not lost. A sample redone after its scored entry was lost is refused by the reward
        as a duplicate (the ledger has it scored; reward_svc/service.py): no trace is left of it
        either, so its group is lost too.

        `after_flush`: Redis came back empty (trainer_svc/redis_state.py), so a group this trainer
        holds only part of is lost as well: its other members went with everything else."""
        now = self.clock()
        interval = LOST_LOOK_S if min_interval_s is None else min_interval_s
        stuck = bool(self.trained_around) or (self.pending is not None and now - self.begun_at >= LOST_LOOK_S)
        if not (every or stuck) or now - self.lost_checked_at < interval:
            return 0
        wanted = self.feeder.in_flight - self.ready.keys() - {g for ids in self.replay.values() for g in ids}
        rounds = set(self.evaluator.rounds)
        if not (wanted or rounds):
            return 0
        self.lost_checked_at = now
        # scored entries already delivered to this trainer are here (assembler, the batch; ready
        # groups are not looked for): of that stream only the rest is read (it also holds trained
        # entries until a checkpoint)
        prompts = self.streams.group_ids(PROMPTS)  # a round's entry there: none of its problems is lost
        traces = (
            prompts | self.streams.group_ids(ROLLOUTS) | self.streams.group_ids(SCORED, undelivered_to=GROUP_TRAINERS)
        )
        if not after_flush:
            traces |= self.assembler.open.keys()
        if self.pending is not None:
            traces |= {g.group_id for g in self.pending.groups}
        self.poll_dead(version)
        groups = sorted((g for g in wanted if g not in traces and g in self.feeder.in_flight), key=group_seq)
        lost: list[
            tuple[str, str | None, int, int, int, int]
        ] = []  # (group id, eval set, prompt index, prompt tokens, n, fed at)
        for g in groups:
            # unknown: fed by a journal before `fed`
            index, fed_at, tokens = (int(x) for x in self.feeder.fed.get(g, [-1, version, 0])[:3])
            lost.append((g, None, index, tokens, self.spec.group_size, fed_at))
            self.feeder.done(g)
            self.trained_around.discard(g)
            self.overtaken_since.pop(g, None)
            if self.assembler.open.pop(g, None) is not None:  # after_flush: its members here go with it
                self.assembler.closed[g] = None
        problems = 0
        for r in sorted(rounds - prompts):
            if r in self.evaluator.rounds:
                gone = self.evaluator.lost(r, traces)
                problems += len(gone)
                lost += [(*problem, version) for problem in gone]
        self.evaluator.record_complete(version)  # rounds whose missing problems were all lost
        if lost:
            self._record_lost(lost, version)
            log.warning(
                "Redis lost %d training groups %s and %d evaluation problems before they were used: recorded "
                "lost in the ledger, their slots freed",
                len(groups),
                groups[:5],
                problems,
            )
        return len(groups) + problems

    def _record_lost(self, lost: list[tuple], version: int) -> None:
        """Ledger rows of lost samples: written for those never generated, moved to `lost` from
        generated or scored for the rest (used ones stay as they are)."""
        why = (
            "lost by Redis: no stream held its prompt, rollouts or scored samples any more (a failover to a "
            "replica that had not received them); never used"
        )
        rows: list[SampleIn] = [
            {
                "msg_id": m,
                "job_id": self.streams.job_id,
                "group_id": g,
                "sample_index": i,
                "kind": "train" if eval_set is None else "eval",
                "eval_set": eval_set,
                "prompt_index": index,
                "generator_id": "",
                "gen_version_min": fed_at,
                "num_prompt_tokens": tokens,
                "num_completion_tokens": 0,
                "completion": "",
                "status": "lost",
                "drop_reason": why,
                "trainer_version": version,
                "staleness": staleness(version, fed_at),
            }
            for g, eval_set, index, tokens, n, fed_at in lost
            for i, m in enumerate(sample_ids(g, n))
        ]
        self.ledger.record_generated(rows)
        record_used(
            self.ledger,
            [{"msg_id": r["msg_id"], "status": "lost", "trainer_version": version, "drop_reason": why} for r in rows],
        )

    # --- a resume's replayed steps -------------------------------------------------------------

    def expect_replay(self, replay: dict[int, list[str]]) -> None:
        """The steps a predecessor trained after the checkpoint, by their groups (in flight again)."""
        self.replay = dict(replay)
        self.feeder.in_flight |= {g for ids in replay.values() for g in ids}

    def check_replay(self, version: int) -> None:
        """After the take-over: every replayed group must be here, or the resume cannot be exact.

        Raises:
            RuntimeError: naming the first missing group and why it is missing: the dead letter
                that names it (a trainer restarted max_deliveries times while it was pending, a
                member another service dead-letters), else Redis lost it.
        """
        self.poll_dead(version)
        have = set(self.ready)
        missing = sorted({g for ids in self.replay.values() for g in ids} - have, key=group_seq)
        if missing:
            first = missing[0]
            cause = (
                f"it was {self.replay_dead[first]}"
                if first in self.replay_dead
                else "no stream holds it and no dead letter names it: Redis lost it"
            )
            raise RuntimeError(
                f"cannot resume exactly: steps {sorted(self.replay)} trained {len(missing)} groups after the last "
                f"checkpoint whose samples are no longer pending in Redis (first: {first}); {cause}"[:2000]
            )

    # --- out -----------------------------------------------------------------------------------

    def begin(self, step: int, version: int, bound: int) -> None:
        """Start filling the batch of step `step` (1-based) for policy `version` under `bound`.
        A step a predecessor trained after the checkpoint takes exactly its groups again."""
        redo = self.replay.pop(step, None)
        b = self.pending = Batch(step, version, bound, redo)
        self.begun_at = self.clock()
        if redo is not None:
            b.groups = [self.ready.pop(g) for g in redo if g in self.ready]

    def take(self) -> Batch | None:
        """The batch begun, once it holds the first prompts_per_step groups in feed order that
        pass the filter (staleness bound, roll-back, dynamic sampling); None while one of them
        is still being generated or scored. Groups that fail the filter are dropped (ledger rows
        and entries kept on the batch) and the next in feed order moves up."""
        b, spec = self.pending, self.spec
        assert b is not None
        want = spec.prompts_per_step
        order = self._turn_order(b)
        for i, gid in enumerate(order):
            if len(b.groups) >= want:
                break
            g = self.ready.pop(gid, None)
            if g is None:  # its turn, still being generated or scored: wait for it, up to a point
                if self._overdue(gid, order[i + 1 :]):
                    continue
                break
            self.overtaken_since.pop(gid, None)
            self.trained_around.discard(gid)
            unfit = self._unfit(b, g)
            if unfit is None:
                b.groups.append(g)
                continue
            reason, why = unfit
            self.note_drops(reason, g.samples.values())
            for s in g.samples.values():
                b.dropped.append(
                    {
                        "msg_id": s.msg_id,
                        "status": "dropped",
                        "trainer_version": b.version,
                        "staleness": staleness(b.version, g.gen_version_min),
                        "drop_reason": why,
                    }
                )
            b.drop_entries += g.entries
            self.feeder.done(g.group_id)
        if len(b.groups) < want:
            return None
        b.groups.sort(key=lambda g: group_seq(g.group_id))
        b.samples, rewards = flatten_batch(b.groups)
        b.data = TrainBatch.of(b.samples, rewards)
        self.pending = None
        self.taken_at.append(self.clock())
        gone = self.overtaken_since.keys() - self.feeder.in_flight  # dropped or dead-lettered meanwhile
        for gid in gone:
            del self.overtaken_since[gid]
        self.trained_around &= self.feeder.in_flight
        return b

    def order_wait_s(self) -> float:
        """How long a missing group keeps its turn once a later one is ready: twice the median
        interval between the recent batches, at least ORDER_WAIT_MIN_S."""
        t = list(self.taken_at)
        gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
        return max(ORDER_WAIT_MIN_S, 2.0 * statistics.median(gaps)) if gaps else ORDER_WAIT_MIN_S

    def _overdue(self, gid: str, later: list[str]) -> bool:
        """Whether the step may train around missing group `gid`: a group after it in feed order
        has been ready for order_wait_s() while it has not arrived."""
        if not any(g in self.ready for g in later):
            return False
        now = self.clock()
        since = self.overtaken_since.setdefault(gid, now)
        if now - since < self.order_wait_s():
            return False
        if gid not in self.trained_around:
            self.trained_around.add(gid)
            log.warning(
                "group %s: still missing %.1fs after later groups were ready (its generator may have died); "
                "training around it",
                gid,
                now - since,
            )
        return True

    def _turn_order(self, b: Batch) -> list[str]:
        """The training groups in flight that may still join batch `b`, in feed order (not the
        ones it holds, nor those a resume's later re-done steps own)."""
        skip = {g.group_id for g in b.groups} | {g for ids in self.replay.values() for g in ids}
        return [gid for gid in self.feeder.feed_order() if gid not in skip]

    def _unfit(self, b: Batch, g: Group) -> tuple[str, str] | None:
        """Why group `g` may not join batch `b`, as (drop reason, the ledger's drop_reason)
        (counting a dynamic-sampling drop), or None."""
        a = self.spec.algorithm
        gone = self.guard.gone({s.rollout.policy_version for s in g.samples.values()})
        flat = (
            b.redo is None
            and a.dynamic_sampling
            and not gone
            and b.filtered < a.dynamic_sampling_max_drops * self.spec.prompts_per_step
            and bool(no_signal(torch.tensor([[s.reward for s in g.samples.values()]]))[0])
        )
        if is_fresh(b.version, g.gen_version_min, b.bound) and not gone and not flat:
            return None
        b.filtered += flat
        if gone:
            return "rolled_back", f"generated by policy version {min(gone)}, rolled back"
        if flat:
            return "dynamic_sampling", "dynamic sampling: every reward of the group is equal (no gradient)"
        return "stale", f"staleness > {b.bound}"

    def isolate(self, b: Batch, bad: dict[str, str]) -> None:
        """The step raised on `b` because of groups `bad` (group id -> the error each raises on its
        own: trainer_svc/isolation.py): their samples are dropped with it, their entries
        dead-lettered (STEP_ERROR) and their slots freed; the other groups wait for the step's
        next try, in feed order; what filling `b` dropped is recorded and acked now.

        Raises:
            RuntimeError: the job cannot make progress (`_check_progress`).
        """
        for g in b.groups:
            if g.group_id not in bad:
                self.ready[g.group_id] = g
                continue
            why = f"{STEP_ERROR}: the training step raises on this group alone: {bad[g.group_id]}"[:1000]
            record_used(
                self.ledger,
                [
                    {"msg_id": m, "status": "dropped", "trainer_version": b.version, "drop_reason": why}
                    for m in g.msg_ids
                ],
            )
            for entry in g.entries:
                self.streams.dead_letter(SCORED, GROUP_TRAINERS, entry, f"group {g.group_id}: {why}", code=STEP_ERROR)
            self.feeder.done(g.group_id)
            self.note_drops("other", g.samples.values())
            self.rejected["step"] += len(g.samples)
            log.error("group %s: %s", g.group_id, why)
            self.dead_streak.append(why.replace(g.group_id, "<group>"))
        record_used(self.ledger, b.dropped)
        self.streams.ack(SCORED, GROUP_TRAINERS, b.drop_entries)
        self._check_progress()

    def dropped_any(self) -> bool:
        """Whether filling the batch begun has dropped groups (their feeder slots are free)."""
        return self.pending is not None and bool(self.pending.dropped)

    def release(self, b: Batch) -> list[str]:
        """After step `b` is recorded: ack what it dropped and the strays (duplicates of completed
        groups), free its feeder slots; returns its trained entries, to hold until a checkpoint."""
        self.streams.ack(SCORED, GROUP_TRAINERS, b.drop_entries + self.assembler.strays)
        self.assembler.strays.clear()
        for g in b.groups:
            self.feeder.done(g.group_id)
        return [e for g in b.groups for e in g.entries]
