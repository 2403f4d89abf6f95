"""Forged rollouts injected into a live job: samples that pass the wire schema but contradict their
job or group (issue 31). Before the trainer checked them (trainer_svc/validation.py) one such
sample failed every step that took it; under a restarting supervisor the trainer replayed the same
batch into the same error until its entries were dead-lettered, and the job ended failed blaming
Redis. Now each is dead-lettered with its reason and the job finishes.

Eleven kinds: the issue's three (a train sample at temperature 0.0, a member whose group_size
disagrees with its group's, a prompt of 200,000 tokens) and eight more (temperature 1e-30, a policy
version the job never published, another problem's prompt ids, a second sample under a used index,
a completion past max_tokens, no prompt token, another job's group, environment tokens in a
single-turn job). Each is injected two ways, while the job runs:

- **a copy**: a real scored sample, as the reward service published it, altered and put on the
  scored stream behind it (the same msg_id, or a fresh one where the kind needs it). The real
  sample comes first, so the copy holds no member's place: it is dead-lettered alone
  (`not_a_member`) and its group trains whole. Every good sample is trained exactly once.
- **ahead** (the issue's three kinds): a rollout for a group just fed, in its place 0, put on the
  rollouts stream before the generator publishes the real one. The reward service scores whichever
  comes first and dead-letters the other as a duplicate: if the forgery won, it is that group's
  member 0, the trainer dead-letters it (`invalid_sample`) and drops the group with the reason; if
  it lost, the group trains whole.

The default run injects each kind once as a copy and the ahead kinds twice into one job on the
session's fleet (~20 s). The bench version (`-m bench`) runs the launcher with a job spec (JOB_ID
mode, restarts on failure: where the crash loop was) on both ledgers, each kind three times as a
copy and twice ahead, and records `forged_rollout_jobs_failed` and `crash_loops` (services
restarted twice or more) in results/hostile.json.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hostile_results import record_hostile

from broker.ledger import Ledger
from broker.streams import PROMPTS, ROLLOUTS, SCORED, JobStreams, connect
from broker.verify import verify
from shared.ids import sample_id
from shared.schema import (
    DecodeError,
    EvalRound,
    PromptGroup,
    Rollout,
    Scored,
    decode,
    encode,
    pack_f32,
    pack_i32,
)
from trainer_svc.validation import INVALID_SAMPLE, NOT_A_MEMBER

pytestmark = [pytest.mark.hostile, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
FORGER = "forger"  # the generator id of every forgery: the forger skips its own entries


# --- the kinds: a real sample in, a forgery out (each must pass the wire schema) -----------------


def _temperature(t: float) -> Callable[[Rollout], dict[str, Any]]:
    return lambda r: {"temperature": t}


def _extra_member(r: Rollout) -> dict[str, Any]:
    # one more member than the group has, claiming a group of one more: its peers say otherwise
    return {"group_size": r.group_size + 1, "sample_index": r.group_size, "msg_id": sample_id(r.group_id, r.group_size)}


def _other_job(r: Rollout) -> dict[str, Any]:
    # this job's id (another job id is refused when the entry is decoded), another job's group
    group = "0000deadbeef" + r.group_id[len(r.job_id) :]
    return {"group_id": group, "msg_id": sample_id(group, r.sample_index)}


def _env_tokens(r: Rollout) -> dict[str, Any]:
    n = r.num_completion_tokens
    lp = r.logprob_array().copy()
    lp[-1] = 0.0
    return {"model_mask": bytes([1] * (n - 1) + [0]), "logprobs": pack_f32(lp)}


COPY_KINDS: dict[str, Callable[[Rollout], dict[str, Any]]] = {
    # rule each should meet in the trainer (trainer_svc/validation.py RULES) after the name
    "temperature_0": _temperature(0.0),
    "group_size_disagrees": _extra_member,
    "prompt_200k_tokens": lambda r: {"prompt_ids": pack_i32(np.full(200_000, 7))},
    "temperature_1e-30": _temperature(1e-30),
    "future_policy_version": lambda r: {"policy_version": 1_000_000, "policy_version_max": 1_000_000},
    "other_prompt_ids": lambda r: {"prompt_ids": pack_i32([*r.prompt_array()[:-1], 3, 3])},
    "second_sample_same_index": lambda r: {"msg_id": f"{r.msg_id}-again"},
    "completion_past_max_tokens": lambda r: {
        "completion_ids": pack_i32([7] * (MAX_TOKENS + 1)),
        "logprobs": pack_f32([-1.0] * (MAX_TOKENS + 1)),
    },
    "no_prompt_token": lambda r: {"prompt_ids": b""},
    "other_jobs_group": _other_job,
    "environment_tokens": _env_tokens,
}
RULE = {
    "temperature_0": "temperature",
    "group_size_disagrees": "group_size",
    "prompt_200k_tokens": "tokens",
    "temperature_1e-30": "temperature",
    "future_policy_version": "version",
    "other_prompt_ids": "prompt",
    "second_sample_same_index": "ids",
    "completion_past_max_tokens": "tokens",
    "no_prompt_token": "tokens",
    "other_jobs_group": "job",
    "environment_tokens": "episode",
}
# in a group's place 0, ahead of the generator: the three
AHEAD_KINDS: dict[str, Callable[[Rollout], dict[str, Any]]] = {
    "temperature_0": _temperature(0.0),
    "group_size_disagrees": lambda r: {"group_size": r.group_size + 1},
    "prompt_200k_tokens": lambda r: {"prompt_ids": pack_i32(np.full(200_000, 7))},
}


def forged_copy(s: Scored, kind: str) -> Scored:
    """Scored sample `s` altered as `kind` says, as its stream entry would carry it (checked
    through the wire's strict decode: the forgery passes the schema)."""
    r = s.rollout.model_copy(update={**COPY_KINDS[kind](s.rollout), "generator_id": FORGER})
    r = Rollout.model_validate(r.model_dump())
    out = Scored(job_id=r.job_id, msg_id=r.msg_id, group_id=r.group_id, policy_version=0, rollout=r, reward=s.reward)
    return decode(encode(out), Scored)


def forged_ahead(g: PromptGroup, kind: str) -> Rollout:
    """A rollout in place 0 of fed group `g`, before any generator made one, altered as `kind`."""
    r = Rollout(
        job_id=g.job_id,
        msg_id=sample_id(g.group_id, 0),
        group_id=g.group_id,
        policy_version=g.policy_version,
        policy_version_max=g.policy_version,
        prompt_index=g.prompt_index,
        sample_index=0,
        group_size=g.n,
        generator_id=FORGER,
        prompt_ids=g.prompt_ids,
        completion_ids=pack_i32([5, 6, 7]),
        logprobs=pack_f32([-1.0, -1.0, -1.0]),
        completion="x",
        answer=g.answer,
        prompt=g.prompt,
        temperature=g.sampling.temperature,
    )
    r = Rollout.model_validate({**r.model_dump(), **AHEAD_KINDS[kind](r)})
    return decode(encode(r), Rollout)


# --- the forger: a thread that follows a live job's streams --------------------------------------


@dataclass
class Forger:
    """Injects `copies` x every copy kind and `ahead` x every ahead kind into job `streams`' live
    streams, each into a group of its own (a copy follows the first scored sample of a new group;
    an ahead forgery goes into a group just fed, up to `last_version`)."""

    streams: JobStreams
    copies: int = 1
    ahead: int = 1
    last_version: int = 1_000_000
    copy_todo: list[str] = field(default_factory=list)
    ahead_todo: list[str] = field(default_factory=list)
    copied: dict[str, tuple[str, str]] = field(default_factory=dict)  # forged msg_id -> (kind, group)
    ahead_groups: dict[str, str] = field(default_factory=dict)  # group id -> kind
    copy_groups: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.copy_todo = [k for _ in range(self.copies) for k in COPY_KINDS]
        self.ahead_todo = [k for _ in range(self.ahead) for k in AHEAD_KINDS]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="forger", daemon=True)

    def start(self) -> Forger:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    @property
    def done(self) -> bool:
        return not self.copy_todo and not self.ahead_todo

    def _run(self) -> None:
        last = {PROMPTS: "-", SCORED: "-"}
        try:
            while not self._stop.is_set() and not self.done:
                for stream in (PROMPTS, SCORED):
                    key = self.streams.key(stream)
                    for eid, fields in self.streams.r.xrange(key, min=last[stream], count=200):
                        last[stream] = "(" + eid.decode()
                        self._see(stream, fields.get(b"d", b""))
                time.sleep(0.02)
        except Exception as exc:  # the test reports it
            self.errors.append(repr(exc))

    def _see(self, stream: str, raw: bytes) -> None:
        if stream == PROMPTS:
            try:
                g = decode(raw, (PromptGroup, EvalRound))
            except DecodeError:
                return
            if not isinstance(g, PromptGroup) or g.purpose != "train" or not self.ahead_todo:
                return
            if (g.train_version or 0) > self.last_version or g.group_id in self.ahead_groups:
                return
            kind = self.ahead_todo.pop(0)
            self.streams.publish_raw(ROLLOUTS, {b"d": encode(forged_ahead(g, kind))})
            self.ahead_groups[g.group_id] = kind
            return
        try:
            s = decode(raw, Scored)
        except DecodeError:
            return
        g = s.group_id
        if s.rollout.generator_id == FORGER or s.rollout.purpose != "train" or not self.copy_todo:
            return
        if g in self.copy_groups or g in self.ahead_groups:
            return
        kind = self.copy_todo.pop(0)
        forged = forged_copy(s, kind)
        self.streams.publish_raw(SCORED, {b"d": encode(forged)})
        self.copied[forged.msg_id] = (kind, g)
        self.copy_groups.add(g)


# --- what must hold of the job afterwards ---------------------------------------------------------


def check_job(ledger: Ledger, streams: JobStreams, job: dict[str, Any], forger: Forger, steps: int) -> dict[str, Any]:
    """Assert the job finished with every good sample trained once and every forgery dead-lettered
    with its reason; returns the figures."""
    job_id = job["id"]
    assert job["state"] == "finished", job.get("error")
    assert not forger.errors, forger.errors
    assert forger.done, (forger.copy_todo, forger.ahead_todo)
    result = verify(ledger, job_id)
    assert result.ok, result.violations
    samples = ledger.samples(job_id)
    by_group: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        by_group.setdefault(s["group_id"], []).append(s)
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(trained) == steps * 16, Counter(s["status"] for s in samples)
    assert not [s for s in samples if s["status"] == "lost"]
    # good samples: none dropped, none trained twice (verify: trained_once); a copy's group trains whole
    dropped = {s["group_id"] for s in samples if s["status"] == "dropped"}
    assert dropped <= set(forger.ahead_groups), [
        (s["msg_id"], s["drop_reason"]) for s in samples if s["status"] == "dropped"
    ][:5]
    for g in forger.copy_groups:
        assert {s["status"] for s in by_group.get(g, [])} <= {"trained", "generated", "scored"}, g
    # every copy dead-lettered alone by the trainer, the reason its kind's rule
    dead = streams.dead_letters(count=100_000)
    mine = {}
    for d in dead:
        if d.stream == SCORED and d.code in (NOT_A_MEMBER, INVALID_SAMPLE) and d.raw:
            mine[decode(d.raw, Scored).msg_id, d.reason.split(":")[0]] = d.code
    for msg_id, (kind, _) in forger.copied.items():
        assert mine.get((msg_id, RULE[kind])) == NOT_A_MEMBER, (kind, msg_id, [k for k in mine if k[0] == msg_id])
    # an ahead forgery: its group dropped with its rule, or (it lost the race) the forgery refused
    # by the reward service as a duplicate and the group trained whole
    won = 0
    for g, kind in forger.ahead_groups.items():
        rows = by_group.get(g, [])
        statuses = {s["status"] for s in rows}
        if "dropped" in statuses:
            won += 1
            assert statuses == {"dropped"}, (g, statuses)
            rule = RULE[kind]
            assert all(f"{INVALID_SAMPLE}: {rule}" in (s["drop_reason"] or "") for s in rows), rows[0]["drop_reason"]
        else:
            assert statuses <= {"trained", "generated", "scored"}, (g, statuses)
    rejected = sum(int(s["metrics"].get("rejected/samples", 0)) for s in ledger.train_steps(job_id))
    return {
        "copies": len(forger.copied),
        "ahead": len(forger.ahead_groups),
        "ahead_won": won,
        "rejected_counted": rejected,
        "trained": len(trained),
    }


def test_every_forgery_passes_the_wire_and_breaks_the_rule_it_is_meant_to() -> None:
    from trainer_svc.validation import Fed, JobLimits, check

    job = JobLimits(job_id="3f2a9c1d0b7e", group_size=4, max_tokens=MAX_TOKENS, max_total_tokens=None, context=256)
    group = "3f2a9c1d0b7e/r1/g5"
    r = Rollout(
        job_id=job.job_id,
        msg_id=sample_id(group, 1),
        group_id=group,
        policy_version=1,
        policy_version_max=1,
        prompt_index=9,
        sample_index=1,
        group_size=4,
        generator_id="gen-0",
        prompt_ids=pack_i32([1, 20, 21, 22]),
        completion_ids=pack_i32([30, 31, 2]),
        logprobs=pack_f32([-0.5, -0.25, -1.0]),
        completion="12",
        answer="12",
    )
    real = Scored(job_id=r.job_id, msg_id=r.msg_id, group_id=group, policy_version=1, rollout=r, reward=1.0)
    fed = Fed(4, prompt_index=9, prompt_ids=r.prompt_array(), temperature=1.0)
    assert check(real, job, fed, 3) is None
    for kind, rule in RULE.items():
        why = check(forged_copy(real, kind), job, fed, 3)
        assert why is not None and why.rule == rule, (kind, why)
    g = PromptGroup(
        job_id=job.job_id,
        msg_id=group,
        group_id=group,
        policy_version=1,
        prompt_index=9,
        prompt="9+3=",
        prompt_ids=r.prompt_ids,
        answer="12",
        n=4,
        sampling={"temperature": 1.0, "max_tokens": MAX_TOKENS},
    )
    for kind in AHEAD_KINDS:
        f = forged_ahead(g, kind)
        why = check(
            Scored(job_id=f.job_id, msg_id=f.msg_id, group_id=group, policy_version=1, rollout=f, reward=0.0),
            job,
            fed,
            3,
        )
        assert why is not None and why.rule == RULE[kind], (kind, why)


# --- the default run: one job on the session's fleet ----------------------------------------------


def test_forged_rollouts_in_a_live_job_are_dead_lettered_and_the_job_finishes(fleet) -> None:
    steps = 4
    job_id = fleet.submit("forged", steps=steps, max_staleness=1)
    streams = JobStreams(connect(fleet.redis_url), job_id, prefix=fleet.prefix)
    # twice each ahead: six of the eight groups first in flight dropped, the step lives on refills
    forger = Forger(streams, copies=1, ahead=2, last_version=steps - 2).start()
    try:
        job = fleet.wait(job_id, timeout=400)
    finally:
        forger.stop()
    figures = check_job(fleet.ledger, streams, job, forger, steps)
    assert figures["rejected_counted"] >= figures["copies"] + figures["ahead_won"]
    assert fleet.alive()  # no service exited: nothing to restart, let alone in a loop
    record_hostile(forged_rollout_jobs_failed=0, crash_loops=0, forged_rollouts=figures)


# --- the bench: the launcher (JOB_ID, restarts on), both ledgers, more of each -------------------


@pytest.mark.bench
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_forged_rollouts_through_the_launcher(tmp_path: Path, backend: str, postgres_database) -> None:
    from shared_fleet import free_port

    from asyncrl.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    port, prefix, steps = free_port(), f"forged-{uuid.uuid4().hex[:8]}:", 12
    spec = {
        "name": "forged",
        "model_path": str(model),
        "steps": steps,
        "group_size": 4,
        "prompts_per_step": 4,
        "max_staleness": 1,
        "checkpoint_every": 2,
        "eval_every": 0,
        "task": {"n_train": 64, "n_test": 8},
        "sampling": {"max_tokens": MAX_TOKENS},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with postgres_database() if backend == "postgresql" else _nothing(f"sqlite:///{tmp_path / 'ledger.db'}") as url:
        env = {
            "DATABASE_URL": url,
            "STREAM_PREFIX": prefix,
            "BROKER_PORT": str(port),
            "TRAINER_CHECKPOINT_DIR": str(tmp_path / "ck"),
            "TRAINER_THREADS": "1",
            "REWARD_WORKERS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        args = ["--spec", str(tmp_path / "spec.json"), "--logdir", str(tmp_path / "logs"), "--max-restarts", "5"]
        launcher = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.launch", *args],
            cwd=ROOT,
            env={**_environ(), **env},
            stdout=open(tmp_path / "launch.out", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        api = f"http://127.0.0.1:{port}"
        try:
            job_id = _launched_job(api, launcher, tmp_path)
            with Ledger(url) as ledger:
                streams = JobStreams(connect(_redis_url()), job_id, prefix=prefix)
                forger = Forger(streams, copies=3, ahead=2, last_version=steps - 2).start()
                try:
                    code = launcher.wait(1200)
                finally:
                    forger.stop()
                job = ledger.get_job(job_id)
                out = (tmp_path / "launch.out").read_text(errors="replace")
                restarts = Counter(re.findall(r"restarted (\S+) \(pid", out))
                crash_loops = sum(1 for n in restarts.values() if n >= 2)
                failed = int(job["state"] != "finished")
                record_hostile(
                    **{
                        "forged_rollout_jobs_failed": failed,
                        "crash_loops": crash_loops,
                        f"forged_rollouts_launcher_{backend}": {"launcher_exit": code, "restarts": dict(restarts)},
                    }
                )
                assert code == 0, out[-3000:]
                figures = check_job(ledger, streams, dict(job), forger, steps)
                record_hostile(**{f"forged_rollouts_launcher_{backend}": {**figures, "restarts": dict(restarts)}})
                assert crash_loops == 0 and not restarts, restarts
        finally:
            if launcher.poll() is None:
                launcher.terminate()
                launcher.wait(120)


class _nothing:
    def __init__(self, value: str) -> None:
        self.value = value

    def __enter__(self) -> str:
        return self.value

    def __exit__(self, *exc: object) -> None:
        return None


def _environ() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.pop("JOB_ID", None)
    return env


def _redis_url() -> str:
    import os

    from broker.redis_server import resolve_redis_url

    return resolve_redis_url(os.environ.get("REDIS_URL"))[0]


def _launched_job(api: str, launcher: subprocess.Popen, tmp_path: Path) -> str:
    """The id of the job the launcher submitted, once its API lists it."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert launcher.poll() is None, (tmp_path / "launch.out").read_text(errors="replace")[-3000:]
        try:
            jobs = httpx.get(f"{api}/jobs", timeout=5).json()
            rows = jobs["jobs"] if isinstance(jobs, dict) else jobs
            if rows:
                return str(rows[0]["id"])
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError("the launcher's job never appeared")
