"""The prompt feeder and the group assembler: the trainer's two ends of the stream pipeline.

The feeder lives in the trainer because its pace must follow the optimizer step. It admits work by
version: the training groups in flight (fed, not yet consumed) fill the slots of the next k + 1
trainer versions, `prompts_per_step` per version, in feed order; a new group takes the next free
slot and carries its version (`PromptGroup.train_version`, shared/staleness_bound.py
`slot_versions`). The sink (trainer_svc/sink.py) trains in the same order, so no group is trained
after its slot's version, and a generator that holds at least that version minus k makes samples
that are never too stale to train. No slot past version + k exists, so a generator can never run
further ahead than the staleness budget allows (backpressure; at most (k + 1) * prompts_per_step
groups in flight).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from broker.streams import DEAD, PROMPTS, ROLLOUTS, SCORED, JobStreams
from shared.ids import eval_round_id, group_seq, id_prefix, sample_ids, train_group_id
from shared.jobspec import JobSpec
from shared.prompts import Rendered, usable
from shared.schema import (
    DeadLetter,
    DecodeError,
    EvalItem,
    EvalRound,
    Message,
    PromptGroup,
    Rollout,
    SamplingParams,
    Scored,
    decode,
    pack_i32,
)
from shared.staleness_bound import slot_versions
from shared.tasks import Problem
from trainer_svc.validation import NOT_A_MEMBER, Fed

# A problem as the model sees it (shared.prompts.render with the job's tokenizer and template).
Render = Callable[[Problem], Rendered]


def group_seed(seed: int, seq: int) -> int:
    """The sampling seed of the job's `seq`-th training group (`sampling.seeded`): a function of the
    job's seed and the feed order only (not of the group id, which holds the job id and the
    trainer's run id), so a job samples alike however the generator batches its groups and whatever
    jobs its engine served before (an unseeded request draws from the engine's one generator, which
    both move). vLLM gives the group's i-th sample seed + i; below 2**31 that stays in every
    engine's range."""
    h = hashlib.blake2b(f"{seed}/train/{seq}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % 2**31


class Feeder:
    """Group ids (and so every msg_id derived from them) start with the job id: they are the
    ledger's idempotency keys and must be unique across all jobs sharing one database.

    Raises (at construction): DatasetError, TemplateLimitError: a training problem cannot be
    rendered (shared.prompts.usable).

    `journal`, when given, is called with `state()` after every publish, so a restarted trainer
    knows exactly what its predecessor fed (trainer_svc.checkpoint.FeedJournal)."""

    def __init__(
        self,
        streams: JobStreams,
        spec: JobSpec,
        train: Sequence[Problem],
        render: Render,
        run_id: str = "",
        journal: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.streams = streams
        self.render = render
        self._rendered: dict[int, Rendered] = {}  # training prompts by index: rendered once
        # A restarted trainer (new run id) must not reuse the ids of the samples its predecessor fed.
        self.prefix = id_prefix(streams.job_id, run_id)
        self.spec = spec
        # every training prompt rendered once now, so a row the tokenizer or the chat template
        # refuses fails the job before step 0 (or is dropped: task.bad_rows); fed ones are cached
        self.train = usable(train, render, spec.task.bad_rows, "training")
        self.journal = journal
        self.rng = random.Random(spec.seed)
        self.order: list[int] = []
        self.epochs = 0  # shuffles so far: with the seed, they rebuild `rng` and `order` (restore)
        self.cursor = 0  # position in `order`; a new shuffled epoch starts when it runs out
        self.seq = 0  # groups fed so far: the group id's counter
        self.in_flight: set[str] = set()
        # training groups in flight -> [prompt index, version fed at, prompt tokens, temperature]:
        # what the ledger records of a group Redis lost before anyone generated it
        # (sink.TrainSink.settle_lost), and what its samples must repeat (trainer_svc/validation.py)
        self.fed: dict[str, list[float]] = {}
        self._problems: dict[int, Problem] = {}  # training problems by index, once asked for
        self.eval_rounds = 0
        self.open_evals: dict[str, list[Any]] = {}  # eval round id -> [step it evaluates, eval set], until complete
        self.temperature = spec.sampling.temperature  # live knobs: apply to groups fed from now on
        self.top_p = spec.sampling.top_p
        self.top_k = spec.sampling.top_k

    def state(self) -> dict[str, Any]:
        """Everything needed to continue feeding where this feeder is (JSON-safe)."""
        return {
            "seq": self.seq,
            "epochs": self.epochs,
            "cursor": self.cursor,
            "eval_rounds": self.eval_rounds,
            "in_flight": sorted(self.in_flight, key=group_seq),
            "open_evals": dict(self.open_evals),
            "fed": {g: self.fed[g] for g in sorted(self.in_flight & self.fed.keys(), key=group_seq)},
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()` of a feeder of the same job (same seed and task)."""
        self.rng = random.Random(self.spec.seed)
        self.order = []
        for _ in range(int(state["epochs"])):  # replay the shuffles: same rng state, same order
            self.order = list(range(len(self.train)))
            self.rng.shuffle(self.order)
        self.epochs = int(state["epochs"])
        self.cursor = int(state["cursor"])
        self.seq = int(state["seq"])
        self.eval_rounds = int(state["eval_rounds"])
        self.in_flight = set(state["in_flight"])
        # journals before `fed`: none; before its temperature: three entries
        self.fed = {
            str(g): [int(x) for x in v[:3]] + [float(x) for x in v[3:4]] for g, v in state.get("fed", {}).items()
        }
        # [step, eval set]; a bare step is a round of the default set (journals before named sets)
        self.open_evals = {
            str(k): [int(v), "held_out"] if isinstance(v, int) else [int(v[0]), str(v[1])]
            for k, v in state["open_evals"].items()
        }
        self.temperature = float(state["temperature"])
        self.top_p = float(state["top_p"])
        self.top_k = int(state.get("top_k", self.spec.sampling.top_k))  # journals before top_k: the spec's

    def _next_problem(self) -> Problem:
        if self.cursor >= len(self.order):
            self.order = list(range(len(self.train)))
            self.rng.shuffle(self.order)
            self.epochs += 1
            self.cursor = 0
        p = self.train[self.order[self.cursor]]
        self.cursor += 1
        return p

    def top_up(self, version: int, bound: int) -> int:
        """Feed one training group per free slot of versions `version` .. `version + bound`
        (prompts_per_step per version, in feed order; shared/staleness_bound.py `slot_versions`),
        each stamped with its slot's version; returns how many were fed. `bound` is the current
        staleness bound (trainer_svc/staleness.py StalenessBound; it moves under adaptive
        staleness, live knobs and the collapse guard). After the bound was lowered the groups in
        flight may fill more than its slots: nothing is fed until they are trained (or dropped)."""
        slots = slot_versions(version, bound, self.spec.prompts_per_step, len(self.in_flight))
        sampling = self.spec.sampling.params(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        msgs = []
        for train_version in slots:
            p = self._next_problem()
            r = self._rendered.get(p.index)
            if r is None:
                r = self._rendered[p.index] = self.render(p)
            gid = train_group_id(self.prefix, self.seq)
            seed = group_seed(self.spec.seed, self.seq) if self.spec.sampling.seeded else None
            self.seq += 1
            msgs.append(
                PromptGroup(
                    job_id=self.streams.job_id,
                    msg_id=gid,
                    group_id=gid,
                    policy_version=version,
                    purpose="train",
                    prompt_index=p.index,
                    # an environment renders its own opening from the problem (generator_svc/episodes.py)
                    prompt=p.prompt if self.spec.environment is not None else r.text,
                    prompt_ids=pack_i32(r.ids),
                    answer=p.answer,
                    metadata=dict(p.metadata),
                    n=self.spec.group_size,
                    sampling=sampling.model_copy(update={"seed": seed}),
                    train_version=train_version,
                )
            )
        self.streams.publish_many(PROMPTS, msgs)
        self.in_flight.update(m.group_id for m in msgs)
        self.fed.update(
            (m.group_id, [m.prompt_index, version, len(m.prompt_array()), m.sampling.temperature]) for m in msgs
        )
        if msgs and self.journal is not None:  # after the XADD: a journaled group was really fed
            self.journal(self.state())
        return len(msgs)

    def fed_as(self, group_id: str) -> Fed | None:
        """What training group `group_id`, in flight, was fed as (validation.Fed: its prompt, its
        temperature where the journal knew it); None for a group not in flight."""
        if group_id not in self.in_flight:
            return None
        f = self.fed.get(group_id)
        if f is None:  # a step a predecessor trained, re-done on resume: only its size is known
            return Fed(self.spec.group_size)
        index = int(f[0])
        return Fed(
            self.spec.group_size,
            prompt_index=index,
            prompt_ids=self.prompt_ids(index),
            temperature=float(f[3]) if len(f) > 3 else None,
        )

    def prompt_ids(self, index: int) -> np.ndarray | None:
        """The token ids training problem `index` is fed as (rendered once, as `top_up` does);
        None for an index the task does not have."""
        r = self._rendered.get(index)
        if r is None:
            if not self._problems:
                self._problems = {p.index: p for p in self.train}
            p = self._problems.get(index)
            if p is None:
                return None
            r = self._rendered[index] = self.render(p)
        return np.asarray(r.ids, dtype=np.int32)

    def done(self, group_id: str) -> None:
        self.in_flight.discard(group_id)
        self.fed.pop(group_id, None)

    def feed_order(self) -> list[str]:
        """The training groups in flight in the order they were fed: the order the sink trains
        them in (the group id's counter; a resumed trainer's counter continues its predecessor's)."""
        return sorted(self.in_flight, key=group_seq)

    def eval_done(self, rnd: str) -> None:
        self.open_evals.pop(rnd, None)

    def feed_eval(
        self, version: int, step: int, eval_set: str, items: Sequence[EvalItem], n: int, sampling: SamplingParams
    ) -> str:
        """Feed one evaluation round of `eval_set` (its problems as rendered `items`, `n` samples
        each) for the policy after `step`, as one entry (shared.schema.EvalRound); returns the
        round's id (see `eval_round`)."""
        rnd = eval_round_id(self.prefix, self.eval_rounds)
        self.eval_rounds += 1
        self.open_evals[rnd] = [step, eval_set]
        self.streams.publish(
            PROMPTS,
            EvalRound(
                job_id=self.streams.job_id,
                msg_id=rnd,
                group_id=rnd,
                policy_version=version,
                eval_set=eval_set,
                n=n,
                sampling=sampling,
                items=list(items),
            ),
        )
        if self.journal is not None:
            self.journal(self.state())
        return rnd


@dataclass
class Group:
    group_id: str
    size: int
    entries: list[str] = field(default_factory=list)  # stream entry ids to ack
    samples: dict[str, Scored] = field(default_factory=dict)  # by msg_id: duplicates collapse
    # sample index -> why it was dead-lettered (all of them for a dead prompt group): a group with
    # dead members completes when every index has arrived or died, and is dropped with the reason
    dead: dict[int, str] = field(default_factory=dict)
    dead_purpose: str = "train"

    @property
    def complete(self) -> bool:
        """Every index 0 .. size - 1 has arrived or died (a count would let a member outside the
        group stand in for a missing one)."""
        have = {s.rollout.sample_index for s in self.samples.values()} | self.dead.keys()
        return all(i in have for i in range(self.size))

    @property
    def purpose(self) -> str:
        return next(iter(self.samples.values())).rollout.purpose if self.samples else self.dead_purpose

    @property
    def msg_ids(self) -> list[str]:
        """Every sample's msg_id, arrived or not (a rollout's msg_id is `{group msg_id}/{index}`,
        and a group's msg_id is its group id)."""
        return sample_ids(self.group_id, self.size)

    @property
    def gen_version_min(self) -> int:
        return min(s.rollout.policy_version for s in self.samples.values())

    @property
    def gen_version_max(self) -> int:
        return max(s.rollout.policy_version_max for s in self.samples.values())


class GroupAssembler:
    """Collects scored samples by group until each group has all of its samples."""

    def __init__(self, remember: int = 100_000) -> None:
        self.open: dict[str, Group] = {}
        self.closed: dict[str, None] = {}  # recently completed group ids (insertion-ordered)
        self.remember = remember
        self.strays: list[str] = []  # entry ids of duplicates of completed groups: ack and forget

    def add(self, entry_id: str, msg: Scored) -> Group | None:
        """Returns the group when this sample completes it. A redelivered duplicate (same msg_id)
        only adds its entry id so it is acked with the group; it never counts twice. A duplicate
        of a group that already completed goes to `strays`."""
        if msg.group_id in self.closed:
            self.strays.append(entry_id)
            return None
        r = msg.rollout
        g = self.open.get(msg.group_id)
        if g is None:
            g = self.open[msg.group_id] = Group(msg.group_id, r.group_size)
        g.entries.append(entry_id)
        g.samples.setdefault(msg.msg_id, msg)
        return self._close_if_complete(g)

    def mark_dead(self, dead: DeadMember) -> Group | None:
        """A dead letter names a member of a group (or the whole prompt group): returns the group
        when that completes it. A group that already completed is left alone: the dead copy was a
        duplicate of a sample it has."""
        if dead.group_id in self.closed:
            return None
        g = self.open.get(dead.group_id)
        if g is None:
            g = self.open[dead.group_id] = Group(dead.group_id, dead.size, dead_purpose=dead.purpose)
        for i in range(dead.size) if dead.sample_index is None else (dead.sample_index,):
            g.dead.setdefault(i, dead.reason)
        return self._close_if_complete(g)

    def _close_if_complete(self, g: Group) -> Group | None:
        if not g.complete:
            return None
        self.closed[g.group_id] = None
        if len(self.closed) > self.remember:
            del self.closed[next(iter(self.closed))]
        return self.open.pop(g.group_id)


@dataclass(frozen=True)
class DeadMember:
    """What a dead letter means for the trainer: a group that can no longer complete as fed."""

    group_id: str
    size: int  # samples the group was fed with
    sample_index: int | None  # None: the whole prompt group died before generation
    purpose: str
    reason: str  # "<code>: <reason>" from the dead letter


# The payload each stream's dead letters carry (the entry's raw bytes), and how to read a group
# member out of it.
_DEAD_KINDS: dict[str, tuple[type[Message], ...]] = {
    PROMPTS: (PromptGroup, EvalRound),
    ROLLOUTS: (Rollout,),
    SCORED: (Scored,),
}


# Dead-letter codes that lose no group member: the reward service's second entry of a msg_id it
# already scored (reward_svc.service.DUPLICATE) is a copy; the first one is alive. The trainer's
# NOT_A_MEMBER held no member's place (trainer_svc/validation.py).
NOT_A_LOSS = frozenset({"duplicate_msg_id", NOT_A_MEMBER})


def dead_members(dl: DeadLetter) -> list[DeadMember]:
    """The group members a dead letter names (every problem of a dead evaluation round), or none
    (garbage, a broadcast stream, a duplicate, or a payload cut at the dead letter's size limit)."""
    kind = _DEAD_KINDS.get(dl.stream)
    if kind is None or not dl.raw or dl.code in NOT_A_LOSS:
        return []
    try:
        msg = decode(dl.raw, kind)
    except DecodeError:
        return []
    reason = f"{dl.code}: {dl.reason}" if dl.code else dl.reason
    if isinstance(msg, EvalRound):
        return [DeadMember(g.group_id, g.n, None, "eval", reason) for g in msg.groups()]
    if isinstance(msg, PromptGroup):
        return [DeadMember(msg.group_id, msg.n, None, msg.purpose, reason)]
    r = msg.rollout if isinstance(msg, Scored) else msg
    assert isinstance(r, Rollout)
    return [DeadMember(r.group_id, r.group_size, r.sample_index, r.purpose, reason)]


class DeadLetterWatch:
    """Follows `{job}:dead` from its start (a restarted trainer re-reads it; settling a group is
    idempotent) and yields the group members it names.

    Without it, a prompt group dead-lettered by a generator (prompt too long, too many deliveries)
    or a sample dead-lettered by the reward service (empty completion, non-finite reward) never
    completes its group, its feeder slot never frees, and after (k + 1) * prompts_per_step of them
    the trainer waits forever."""

    def __init__(self, streams: JobStreams, job_id: str):
        self.streams = streams
        self.job_id = job_id
        self.last_id = "0"

    def poll(self) -> list[DeadMember]:
        self.last_id, letters = self.streams.read_broadcast(DEAD, self.last_id, DeadLetter, count=1000)
        return [m for dl in letters for m in dead_members(dl) if m.group_id.startswith(self.job_id)]
