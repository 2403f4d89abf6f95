"""Exact resume of a killed trainer while the generator and reward service keep running.

Real Redis, the real vLLM CPU generator and the reward service as processes. The same job runs
once uninterrupted and once with the trainer SIGKILLed after a checkpoint and restarted; the
generator and reward processes stay up across the kill. In sync mode the two runs must train the
same samples at the same steps (by feed counter, prompt and sample index), and the ledger must
account for every sample exactly once.

Async mode is not compared run against run: which groups fill a step depends on arrival order
(generation and scoring speed), and so do staleness and drops. What holds there too: every step
once, no sample trained twice, every sample trained, dropped with a reason, evaluated, or still in
flight when the job ended (at most (k + 1) batches). Both kinds replay bit for bit from their
records, across the kill (`asyncrl replay`).
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid

import pytest

from asyncrl.launch import Supervisor
from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.streams import CONTROL, JobStreams, connect
from shared.ids import control_id, group_seq
from shared.jobspec import JobSpec
from shared.schema import Control
from trainer_svc.replay import replay, report

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS, P, N, N_TEST, EVAL_EVERY, CKPT_EVERY, KILL_AFTER = 6, 4, 4, 8, 3, 2, 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0
    )  # vLLM CPU attention needs head_dim >= 32


@pytest.fixture(scope="module")
def db_url(tmp_path_factory):
    return os.environ.get("DATABASE_URL") or f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.db'}"


def _run(
    tmp_path, db_url: str, model, mode: str, kill: bool, algorithm: dict | None = None, lr_knob: float | None = None
) -> dict:
    """One job with its own generator, reward and trainer processes; with `kill`, the trainer is
    SIGKILLed once step KILL_AFTER is in the ledger and started again. `lr_knob`: a live lr set
    (a PATCH's control message) before the trainer starts, so it applies from step 1, before any
    checkpoint. Returns what the test compares."""
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    tag = f"rs-{mode}-{'kill' if kill else 'ref'}"
    env = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": db_url,
        "STREAM_PREFIX": f"{tag}-{uuid.uuid4().hex[:8]}:",
        "GEN_GENERATOR_ID": "gen-0",
        "TRAINER_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TRAINER_CHECKPOINT_DIR": str(tmp_path / tag / "checkpoints"),
    }
    sup = Supervisor(tmp_path / tag / "logs", env)
    ledger = Ledger(db_url)
    spec = JobSpec.model_validate(
        {
            "name": tag,
            "model_path": str(model),
            "mode": mode,
            "max_staleness": 1,
            "steps": STEPS,
            "group_size": N,
            "prompts_per_step": P,
            "eval_every": EVAL_EVERY,
            "checkpoint_every": CKPT_EVERY,
            "task": {"n_train": 64, "n_test": N_TEST},
            "sampling": {"max_tokens": 8},
            "algorithm": algorithm or {},
        }
    )
    job_id = f"{tag}-{uuid.uuid4().hex[:8]}"
    ledger.create_job(job_id, tag, spec.model_dump(mode="json"))
    if lr_knob is not None:
        JobStreams(connect(redis_url), job_id, prefix=env["STREAM_PREFIX"]).publish(
            CONTROL,
            Control(
                job_id=job_id, msg_id=control_id("set", "lr"), policy_version=0, command="set", settings={"lr": lr_knob}
            ),
        )
    out: dict = {"job_id": job_id}
    killed = None

    def check_alive() -> None:
        bad = [p for p in sup.failed() if p is not killed]
        assert not bad, "\n".join(f"{p.name}:\n{sup.tail(p.name, 60)}" for p in bad)

    try:
        gen = sup.start("generator", "generator_svc", {"JOB_ID": job_id})
        rew = sup.start("reward", "reward_svc", {"JOB_ID": job_id})
        trainer = sup.start("trainer", "trainer_svc", {"JOB_ID": job_id})
        if kill:
            deadline = time.monotonic() + 300
            while (ledger.last_train_step(job_id) or {"step": 0})["step"] < KILL_AFTER:
                check_alive()
                assert time.monotonic() < deadline, sup.tail("trainer")
                time.sleep(0.05)
            trainer.popen.send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            trainer.popen.wait()
            killed = trainer
            out["killed_after"] = ledger.last_train_step(job_id)["step"]
            out["checkpoint_at_kill"] = max(c["step"] for c in ledger.checkpoints(job_id))
            time.sleep(1.0)  # the generator and reward keep working on what the dead trainer fed
            assert gen.popen.poll() is None and rew.popen.poll() is None
            sup.start("trainer2", "trainer_svc", {"JOB_ID": job_id})
            while (ledger.last_train_step(job_id) or {"step": 0})["step"] <= out["killed_after"]:
                check_alive()
                assert time.monotonic() < deadline, sup.tail("trainer2")
                time.sleep(0.05)
            out["kill_to_next_step_s"] = time.monotonic() - t_kill
        deadline = time.monotonic() + 400
        while ledger.get_job(job_id)["state"] not in ("finished", "failed", "stopped"):
            check_alive()
            assert time.monotonic() < deadline, sup.tail("trainer2" if kill else "trainer")
            time.sleep(0.3)
        assert ledger.get_job(job_id)["state"] == "finished", sup.tail("trainer2" if kill else "trainer", 60)
        assert sup.wait_all(60), "services did not exit after the job finished"
        codes = {p.name: p.popen.returncode for p in sup.procs}
        assert codes == {"generator": 0, "reward": 0, "trainer": -9 if kill else 0, **({"trainer2": 0} if kill else {})}
    finally:
        sup.stop_all()
    if kill:
        log = (tmp_path / tag / "logs" / "trainer2.log").read_text()
        m = re.search(r"resumed from .* at step (\d+) .* in ([\d.]+)s: re-doing steps \[([\d, ]*)\]", log)
        assert m, log[-3000:]
        out["resumed_at"], out["boot_s"] = int(m.group(1)), float(m.group(2))
        out["redone"] = [int(s) for s in m.group(3).split(",") if s.strip()]
        out["reproduced"] = [int(s) for s in re.findall(r"re-done step (\d+) reproduces", log)]
        out["ckpt"] = [(float(a), float(b)) for a, b in re.findall(r"checkpoint .*: ([\d.]+) MB in ([\d.]+)s", log)]
    out["trained"] = {
        (s["trainer_version"] + 1, group_seq(s["group_id"]), s["prompt_index"], s["sample_index"])
        for s in ledger.samples(job_id, status="trained")
    }
    out["counts"] = ledger.status_counts(job_id)
    out["steps"] = ledger.train_steps(job_id)
    out["samples"] = ledger.samples(job_id)
    out["step"] = ledger.get_job(job_id)["step"]
    out["version"] = max(v["version"] for v in ledger.policy_versions(job_id))
    out["checkpoints"] = [c["step"] for c in ledger.checkpoints(job_id)]
    out["evals"] = [e["step"] for e in ledger.evals(job_id)]
    # the job replays bit for bit from its records (trainer_svc/replay.py): the re-done steps'
    # records replaced the killed trainer's, and the weights they led to are what followed
    out["replay"] = report(job_id, list(replay(ledger, job_id)))
    return out


def _accounting(run: dict, k: int) -> None:
    """Every step once, no sample trained twice, every sample accounted for."""
    assert [s["step"] for s in run["steps"]] == list(range(1, STEPS + 1))
    assert all(s["metrics"]["ledger/trained_twice"] == 0 for s in run["steps"])
    assert run["replay"]["bitwise"] and len(run["replay"]["steps"]) == STEPS, run["replay"]
    assert run["step"] == STEPS and run["version"] == STEPS
    assert run["checkpoints"] == list(range(CKPT_EVERY, STEPS + 1, CKPT_EVERY))
    assert run["evals"] == list(range(0, STEPS + 1, EVAL_EVERY))
    per_step: dict[int, int] = {}
    for s in run["samples"]:
        if s["status"] == "trained":
            per_step[s["trainer_version"] + 1] = per_step.get(s["trainer_version"] + 1, 0) + 1
            assert 0 <= s["staleness"] == s["trainer_version"] - s["gen_version_min"] <= k
        elif s["status"] == "dropped":
            assert s["drop_reason"], s
    assert per_step == dict.fromkeys(range(1, STEPS + 1), P * N)
    c = run["counts"]
    assert c["trained"] == STEPS * P * N and c["evaluated"] == (STEPS // EVAL_EVERY + 1) * N_TEST
    assert c.get("generated", 0) + c.get("scored", 0) <= k * P * N  # in flight when the job ended


# A warm-up and a cosine decay, scaled by a live lr of half the spec's (1e-4 * 0.5): with W = 2 and
# S = 6, steps 1, 2 ramp to 1; then p = (t - 2) / 4 and the factor is 1 - 0.9 (1 - cos(pi p)) / 2.
SCHEDULE = {"lr": 1e-4, "lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}
LIVE_LR = 5e-5
EXPECTED_LR = [LIVE_LR * f for f in (0.5, 1.0, 0.868198, 0.55, 0.231802, 0.1)]


def test_sync_resume_trains_exactly_what_an_uninterrupted_run_trains(tmp_path, tiny_model, db_url):
    ref = _run(tmp_path, db_url, tiny_model, "sync", kill=False, algorithm=SCHEDULE, lr_knob=LIVE_LR)
    got = _run(tmp_path, db_url, tiny_model, "sync", kill=True, algorithm=SCHEDULE, lr_knob=LIVE_LR)
    for run in (ref, got):
        _accounting(run, k=0)
        assert set(run["counts"]) == {"trained", "evaluated"}  # sync: nothing dropped, nothing left over
    assert got["killed_after"] >= KILL_AFTER and got["resumed_at"] == got["checkpoint_at_kill"]
    assert got["redone"] == list(range(got["resumed_at"] + 1, got["killed_after"] + 1))
    assert got["reproduced"] == got["redone"]  # re-done versions carry the predecessor's checksums
    assert got["trained"] == ref["trained"]  # same (step, group, prompt, sample) set
    # the schedule resumes at its step, re-done steps and later ones alike, with the live lr kept
    lrs = [s["metrics"]["lr"] for s in got["steps"]]
    assert lrs == [s["metrics"]["lr"] for s in ref["steps"]]
    assert lrs == pytest.approx(EXPECTED_LR, rel=1e-5)
    print(
        f"\nsync resume: killed after step {got['killed_after']} (checkpoint {got['checkpoint_at_kill']}), "
        f"re-done {got['redone']}, trainer boot to resumed {got['boot_s']:.1f}s, kill to next new step "
        f"{got['kill_to_next_step_s']:.1f}s, checkpoints (MB, s) {got['ckpt']}; trained sets equal: "
        f"{len(got['trained'])} samples"
    )


def test_async_resume_accounts_for_every_sample(tmp_path, tiny_model, db_url):
    got = _run(tmp_path, db_url, tiny_model, "async", kill=True)
    _accounting(got, k=1)
    assert got["reproduced"] == got["redone"]
    print(
        f"\nasync resume: killed after step {got['killed_after']}, re-done {got['redone']}, "
        f"kill to next new step {got['kill_to_next_step_s']:.1f}s, counts {got['counts']}"
    )
