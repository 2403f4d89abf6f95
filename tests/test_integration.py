"""The whole loop as separate OS processes: broker API, vLLM generator, reward, trainer.

Real Redis (REDIS_URL or the local server), real vLLM CPU engine on a tiny locally built model, the
ledger on SQLite (or DATABASE_URL). Malformed entries are injected on every stream while the job
runs; they must land in the dead-letter stream while the services keep going.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from shared_fleet import Fleet, free_port  # tests/ is on sys.path

from asyncrl.launch import Supervisor, wait_healthy
from broker.ledger import Ledger
from broker.redis_server import resolve_redis_url
from broker.streams import CONTROL, POLICY, PROMPTS, ROLLOUTS, SCORED, JobStreams, connect
from broker.verify import verify
from shared.schema import Control, encode
from shared.settings import AdminSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4
ASYNCRL = str(Path(sys.executable).with_name("asyncrl"))  # the console script installed beside python


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0
    )  # vLLM CPU attention needs head_dim >= 32


def _backend(name: str) -> str:
    """`name`, or DATABASE_URL when that is set: the run then uses that database only."""
    return "DATABASE_URL" if os.environ.get("DATABASE_URL") else name


@pytest.fixture(scope="module")
def db_url(request, tmp_path_factory, postgres_database):
    """One ledger per backend for every run in this module: jobs sharing a database must not
    collide on sample keys. The tests split the backends between them (the ledger's own tests run
    every query on both): the async loop and job control on PostgreSQL (production), the sync
    loop on SQLite (the default), as the tests that build their own ledger are."""
    if request.param == "DATABASE_URL":
        yield os.environ["DATABASE_URL"]
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.db'}"
    else:
        with postgres_database() as url:
            yield url


def _inject_malformed(streams: JobStreams, job_id: str) -> int:
    """One bad entry per stream; returns how many were injected."""
    wrong_kind = encode(Control(job_id=job_id, msg_id="x", policy_version=0, command="pause"))
    streams.publish_raw(PROMPTS, {b"d": b"\xc1 not msgpack"})
    streams.publish_raw(ROLLOUTS, {b"d": wrong_kind})  # a control message on the rollouts stream
    streams.publish_raw(SCORED, {b"x": b"no d field"})
    streams.publish_raw(POLICY, {b"d": b"\x93\x01\x02\x03"})  # a msgpack list, not a map
    streams.publish_raw(CONTROL, {b"d": b"\xff" * 10})
    return 5


@pytest.mark.parametrize(
    "mode, db_url", [("async", _backend("postgresql")), ("sync", _backend("sqlite"))], indirect=["db_url"]
)
def test_full_loop_as_processes(tmp_path, tiny_model, db_url, mode):
    sup, api, redis_url, prefix = _stack(tmp_path, db_url, "it")
    k = 1
    try:
        _start_broker(sup, api)
        spec = {
            "name": f"it-{mode}",
            "model_path": str(tiny_model),
            "mode": mode,
            "max_staleness": k,
            "steps": STEPS,
            "group_size": 4,
            "prompts_per_step": 4,
            "eval_every": 2,
            "task": {"n_train": 64, "n_test": 16},
            "sampling": {"max_tokens": 8},
        }
        if mode == "async":  # the adaptive bound runs inside the loop and is logged per step
            spec["adaptive_staleness"] = {"k_min": 0, "k_max": k, "metric": "ess", "threshold": 0.5}
        r = httpx.post(f"{api}/jobs", json=spec, timeout=30)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        streams = JobStreams(connect(redis_url), job_id, prefix=prefix)
        ledger = Ledger(db_url)
        for name, module in (("trainer", "trainer_svc"), ("generator", "generator_svc")):
            sup.start(name, module, {"JOB_ID": job_id})
        # Once the generator follows the policy stream, and before the reward service exists (so no
        # step can run yet), put a malformed entry on every stream: each reader meets one mid-run.
        deadline = time.monotonic() + 300
        while not ledger.generator_loads(job_id):
            assert not sup.failed(), "\n".join(f"{p.name}:\n{sup.tail(p.name)}" for p in sup.failed())
            assert time.monotonic() < deadline, sup.tail("generator")
            time.sleep(0.2)
        injected = _inject_malformed(streams, job_id)
        sup.start("reward", "reward_svc", {"JOB_ID": job_id})
        deadline = time.monotonic() + 400
        while True:
            job = httpx.get(f"{api}/jobs/{job_id}", timeout=30).json()
            if job["state"] in ("finished", "failed", "stopped"):
                break
            assert not sup.failed(), "\n".join(f"{p.name}:\n{sup.tail(p.name)}" for p in sup.failed())
            assert time.monotonic() < deadline, f"job stuck at {job}\n{sup.tail('trainer')}\n{sup.tail('generator')}"
            time.sleep(1)
        assert job["state"] == "finished", f"{job}\n{sup.tail('trainer')}"
        # the trainer's end-of-job stop makes the other services exit on their own, cleanly
        assert sup.wait_all(60, exclude=("broker",)), "services did not exit after the job finished"
        assert [p.popen.returncode for p in sup.procs if p.name != "broker"] == [0, 0, 0], sup.tail("generator")
    finally:
        sup.stop_all()

    steps = ledger.train_steps(job_id)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:  # per-step algorithm and staleness metrics
        m = s["metrics"]
        assert 0 < m["is/ess"] <= 1.0 + 1e-6 and m["entropy"] > 0 and "mismatch_kl" in m
        assert 0 <= m["staleness/bound"] <= (0 if mode == "sync" else k)
    trained = ledger.samples(job_id, status="trained")
    # every trained sample has its row, reward and the step's trainer version
    assert len(trained) == STEPS * 4 * 4 == sum(s["metrics"]["samples"] for s in steps)
    assert all(s["reward"] is not None and s["status"] == "trained" for s in trained)
    for s in trained:
        assert s["staleness"] == s["trainer_version"] - s["gen_version_min"]
        assert 0 <= s["staleness"] <= (0 if mode == "sync" else k)  # within the bound
    # generation versions increase with the trainer's version
    per_step: dict[int, list[int]] = {}
    for s in trained:
        per_step.setdefault(s["trainer_version"], []).append(s["gen_version_min"])
    lows = [min(per_step[v]) for v in sorted(per_step)]
    highs = [max(per_step[v]) for v in sorted(per_step)]
    k_eff = 0 if mode == "sync" else k
    assert lows == sorted(lows) and highs == sorted(highs)
    assert STEPS - 1 - k_eff <= highs[-1] <= STEPS - 1
    # the generator loaded every version it generated with, and the final one
    loads = {(row["generator_id"], row["version"]) for row in ledger.generator_loads(job_id)}
    loaded = {v for _, v in loads}
    used_versions = {s["gen_version_min"] for s in ledger.samples(job_id)}
    assert used_versions <= loaded and STEPS in loaded
    if mode == "sync":
        assert loaded == set(range(STEPS + 1))  # sync: every version is loaded before its batch
    assert {v["version"] for v in ledger.policy_versions(job_id)} == set(range(STEPS + 1))
    # held-out evaluation ran through the same pipeline (steps 0, 2 and the final 4)
    assert [e["step"] for e in ledger.evals(job_id)] == [0, 2, 4]
    assert all(e["n"] == 16 for e in ledger.evals(job_id))
    # no sample is left unscored except ones still in flight when the job ended
    counts = ledger.status_counts(job_id)
    assert counts.get("generated", 0) <= 4 * 4 * (k + 1)
    # every malformed entry was dead-lettered with a reason (broadcast entries once per reader)
    dead = streams.dead_letters()
    by_stream = {d.stream for d in dead}
    assert by_stream == {PROMPTS, ROLLOUTS, SCORED, POLICY, CONTROL}, [(d.stream, d.reason) for d in dead]
    assert len(dead) >= injected
    assert all(d.reason for d in dead)
    reasons = " | ".join(d.reason for d in dead)
    assert "not valid msgpack" in reasons and "on a stream that carries 'rollout'" in reasons
    if mode == "sync":  # the admin worker's offline evaluation measures what the pipeline measured
        from broker.admin import evaluate

        result, _ = evaluate(ledger, AdminSettings(database_url=db_url), job_id, STEPS)
        (pipeline,) = [e for e in ledger.evals(job_id, source="pipeline") if e["step"] == STEPS]
        assert result["n"] == pipeline["n"] == 16
        # Same weights, same greedy protocol; only vLLM's batching differs (at most one flip).
        assert abs(result["reward_mean"] - pipeline["reward_mean"]) <= 1 / 16 + 1e-9, (result, pipeline)
    streams.delete_all()


@pytest.mark.parametrize("db_url", [_backend("postgresql")], indirect=True)
def test_job_control_through_the_cli_and_admin_tasks(tmp_path, tiny_model, db_url):
    """The user's path, every step through the `asyncrl` CLI (a real process each time): submit,
    watch, pause (no step advances, nothing moves), change lr and max_staleness live (the next steps
    use them, the ledger records who changed what), resume, evaluate the newest checkpoint and
    export it through the Celery admin worker, stop (drains to a final checkpoint)."""
    sup, api, _, _ = _stack(tmp_path, db_url, "lc")
    ledger = Ledger(db_url)
    cli_env = {**os.environ, "ASYNCRL_API": api, "COLUMNS": "200"}

    def cli(*args: str, timeout: float = 60) -> str:
        proc = subprocess.run([ASYNCRL, *args], env=cli_env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"asyncrl {' '.join(args)}: {proc.stderr}\n{sup.tail('admin')}"
        return proc.stdout

    def job() -> dict:  # polled often: plain HTTP; every action below goes through the CLI
        return httpx.get(f"{api}/jobs/{job_id}", timeout=30).json()

    def wait(cond, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert not sup.failed(), "\n".join(f"{p.name}:\n{sup.tail(p.name)}" for p in sup.failed())
            assert time.monotonic() < deadline, f"timed out: {what}\n{sup.tail('trainer')}"
            time.sleep(0.2)

    watcher = None
    try:
        _start_broker(sup, api)
        # Tiny steps take ~20 ms here: the job must outlast the test, which stops it.
        spec = {
            "name": "live",
            "model_path": str(tiny_model),
            "steps": 1_000_000,
            "group_size": 4,
            "prompts_per_step": 4,
            "eval_every": 0,
            "checkpoint_every": 50,
            "max_staleness": 1,
            "task": {"n_train": 64, "n_test": 8},
            "sampling": {"max_tokens": 8},
            "algorithm": {"lr": 1e-4, "lr_schedule": "constant"},  # every step at lr until the live change
        }
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        job_id = json.loads(cli("submit", str(tmp_path / "spec.json"), "--json"))["id"]
        # The live progress view runs for the whole job and must end by itself when the job stops.
        watcher = subprocess.Popen(
            [ASYNCRL, "status", job_id, "--watch", "--interval", "0.5"],
            env=cli_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, module in (("generator", "generator_svc"), ("reward", "reward_svc"), ("trainer", "trainer_svc")):
            sup.start(name, module, {"JOB_ID": job_id})
        sup.start("admin", "broker.admin")
        wait(lambda: job()["step"] >= 2, "two steps")
        assert json.loads(cli("status", job_id))["state"] == "running"

        assert json.loads(cli("pause", job_id))["state"] == "paused"
        time.sleep(2)  # a step in progress may finish
        paused_at = job()["step"]
        counts = ledger.status_counts(job_id)
        time.sleep(4)
        assert job()["step"] == paused_at and job()["state"] == "paused"  # no step advances while paused
        assert ledger.status_counts(job_id) == counts  # and nothing moves (generation stopped too)

        changed = json.loads(cli("set", job_id, "--lr", "5e-5", "--max-staleness", "2", "--temperature", "0.8"))
        assert changed["changed"] == {"lr": 5e-5, "max_staleness": 2, "temperature": 0.8}
        assert cli("resume", job_id)
        wait(lambda: job()["step"] >= paused_at + 3, "steps after resume")
        steps = ledger.train_steps(job_id)
        # the live knobs reached the trainer at its next step, and not before the change
        assert steps[-1]["metrics"]["lr"] == pytest.approx(5e-5) and steps[-1]["metrics"]["staleness/bound"] == 2
        before = [s["metrics"] for s in steps if s["step"] <= paused_at]
        assert all(m["lr"] == pytest.approx(1e-4) and m["staleness/bound"] == 1 for m in before)
        (change,) = [c for c in ledger.job_changes(job_id) if c["changes"].get("command") == "set"]
        assert change["changes"]["settings"] == {"lr": 5e-5, "max_staleness": 2, "temperature": 0.8}
        assert change["actor"] == "anonymous" and change["created_at"] is not None

        # evaluate the newest checkpoint, then export it, through the admin worker (Celery)
        wait(lambda: len(ledger.checkpoints(job_id)) >= 2, "two checkpoints")
        newest = ledger.checkpoints(job_id)[-1]["step"]
        evaluated = json.loads(cli("eval", job_id, "--wait", "--interval", "0.5", timeout=300))
        assert evaluated["state"] == "succeeded" and evaluated["result"]["n"] == 8
        step_evaluated = evaluated["params"]["step"]
        assert step_evaluated >= newest and step_evaluated % 50 == 0
        (row,) = [e for e in job()["evals"] if e["source"] == "checkpoint"]
        assert row["step"] == step_evaluated and row["reward_mean"] == pytest.approx(evaluated["result"]["reward_mean"])
        exported = json.loads(cli("export", job_id, "--step", str(step_evaluated), "--wait", timeout=120))
        assert exported["state"] == "succeeded", exported
        from transformers import AutoModelForCausalLM

        path = exported["result"]["path"]
        assert AutoModelForCausalLM.from_pretrained(path).config.vocab_size > 0
        assert not os.path.exists(os.path.join(path, "trainer_state"))

        assert json.loads(cli("stop", job_id))["state"] == "stopping"
        wait(lambda: job()["state"] == "stopped", "drain to stopped", 120)
        assert sup.wait_all(60, exclude=("broker", "admin")), "services did not exit after stop"
        out, err = watcher.communicate(timeout=30)
        assert watcher.returncode == 0 and f"job {job_id} stopped at step" in out, err
        # nothing lost across the pause: every sample is accounted for, none dropped as stale
        final = ledger.status_counts(job_id)
        assert final.get("dropped", 0) == 0 and final["trained"] == job()["step"] * 4 * 4
        actions = [c["changes"].get("command") for c in ledger.job_changes(job_id)]
        assert actions == ["pause", "set", "resume", "stop"]
        # the stop left a committed, loadable HF checkpoint of the final step
        assert job()["step"] == ledger.checkpoints(job_id)[-1]["step"]
        assert os.path.exists(os.path.join(ledger.checkpoints(job_id)[-1]["path"], "COMMIT"))
        assert [t["state"] for t in ledger.admin_tasks(job_id)] == ["succeeded", "succeeded"]
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
        sup.stop_all()


def test_two_generators_share_one_jobs_prompts(tmp_path, tiny_model):
    """Horizontal generators: two processes in the `generators` consumer group of one job. Both
    produce samples (small generate calls so neither takes every group), both load every version,
    and no prompt group is generated twice."""
    db_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    sup, api, redis_url, prefix = _stack(tmp_path, db_url, "g2")
    ledger = Ledger(db_url)
    try:
        _start_broker(sup, api)
        spec = {
            "name": "two-gens",
            "model_path": str(tiny_model),
            "mode": "sync",
            "steps": STEPS,
            "group_size": 4,
            "prompts_per_step": 4,
            "eval_every": 0,
            "generation_batch": 1,
            "task": {"n_train": 64, "n_test": 8},
            "sampling": {"max_tokens": 8},
        }
        job_id = httpx.post(f"{api}/jobs", json=spec, timeout=30).json()["id"]
        for i in range(2):
            sup.start(f"generator-{i}", "generator_svc", {"JOB_ID": job_id, "GEN_GENERATOR_ID": f"gen-{i}"})
        sup.start("reward", "reward_svc", {"JOB_ID": job_id})
        # the trainer feeds once both engines are up (each beats once its loop runs): a generator
        # still building its engine when the work arrives may find none left (a loaded box)
        streams = JobStreams(connect(redis_url), job_id, prefix=prefix)
        deadline = time.monotonic() + 300
        while not {"gen-0", "gen-1"} <= set(streams.heartbeats()):
            assert not sup.failed() and time.monotonic() < deadline, sup.tail("generator-1")
            time.sleep(0.2)
        sup.start("trainer", "trainer_svc", {"JOB_ID": job_id})
        _wait_finished(sup, ledger, job_id)
        assert sup.wait_all(60, exclude=("broker",)), "services did not exit after the job finished"
    finally:
        sup.stop_all()
    samples = ledger.samples(job_id, limit=10_000)
    by_gen = {g: [s for s in samples if s["generator_id"] == g] for g in ("gen-0", "gen-1")}
    assert all(by_gen.values()), {g: len(v) for g, v in by_gen.items()}  # both produced samples
    keys = [(s["group_id"], s["sample_index"]) for s in samples]
    assert len(keys) == len(set(keys))  # no group generated by both
    for s in samples:  # a group is generated by one generator
        assert {x["generator_id"] for x in samples if x["group_id"] == s["group_id"]} == {s["generator_id"]}
    loaded: dict[str, set[int]] = {}
    for row in ledger.generator_loads(job_id):
        loaded.setdefault(row["generator_id"], set()).add(row["version"])
    # sync mode: every version is served before its batch (by whichever replica takes it; a replica
    # busy while a version is current goes straight to the next one), and no sample comes from a
    # version its generator did not load
    assert set().union(*loaded.values()) == set(range(STEPS + 1)), loaded
    assert set(loaded) == {"gen-0", "gen-1"} and all(0 in v for v in loaded.values()), loaded
    for s in samples:
        assert {s["gen_version_min"], s["gen_version_max"]} <= loaded[s["generator_id"]], s
    assert ledger.status_counts(job_id)["trained"] == STEPS * 4 * 4


def test_two_async_generators_drop_nothing_for_staleness(tmp_path, tiny_model):
    """Admission by version (ARCHITECTURE.md): two generators in async mode (k = 1), each taking
    a group or two per call so one step's groups are spread over both and finish out of order.
    The sink trains in feed order and each group was generated by its admission floor or newer,
    so no sample is dropped as staler than the bound, whatever the timing (taking groups as they
    completed, the code before dropped a group generated at v0 when the trainer was at v5 here)."""
    db_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    sup, api, _, _ = _stack(tmp_path, db_url, "adm")
    ledger = Ledger(db_url)
    steps = 8
    try:
        _start_broker(sup, api)
        spec = {
            "name": "admission",
            "model_path": str(tiny_model),
            "mode": "async",
            "max_staleness": 1,
            "steps": steps,
            "group_size": 4,
            "prompts_per_step": 4,
            "eval_every": 0,
            "generation_batch": 2,
            "task": {"n_train": 64, "n_test": 8},
            "sampling": {"max_tokens": 8},
        }
        job_id = httpx.post(f"{api}/jobs", json=spec, timeout=30).json()["id"]
        for i in range(2):
            sup.start(f"generator-{i}", "generator_svc", {"JOB_ID": job_id, "GEN_GENERATOR_ID": f"gen-{i}"})
        sup.start("reward", "reward_svc", {"JOB_ID": job_id})
        sup.start("trainer", "trainer_svc", {"JOB_ID": job_id})
        _wait_finished(sup, ledger, job_id)
    finally:
        sup.stop_all()
    samples = ledger.samples(job_id, kind="train", limit=10_000)
    assert {s["generator_id"] for s in samples} == {"gen-0", "gen-1"}
    stale = [s for s in samples if (s["drop_reason"] or "").startswith("staleness")]
    assert stale == [], [(s["group_id"], s["gen_version_min"], s["trainer_version"]) for s in stale]
    assert ledger.status_counts(job_id)["trained"] == steps * 4 * 4
    assert max(s["staleness"] for s in samples if s["status"] == "trained") <= 1


# A user's environment (loaded by file path, as a job spec names it): each model turn is answered
# with the output of a program run by the tools environment's sandboxed Python tool, for 3 turns.
SANDBOX_ENV = """
from shared.environments.base import StepResult
from shared.environments.tools import ToolEnv


class SandboxedEcho(ToolEnv):
    def __init__(self):
        super().__init__(tools=("python",), system_prompt=False)
        self.turns = 0

    def start(self, row):
        return row["prompt"]

    def step(self, turn):
        self.turns += 1
        out = self.tools["python"].run({"code": f"print(sum(range({len(turn.ids)})))"})
        return StepResult(text=out, role="tool", done=self.turns >= 3, info={"ok": True})
"""


def test_a_multi_turn_job_with_a_sandboxed_tool(tmp_path, fleet: Fleet):
    """Issue 16's path through every service as processes (the session's standing fleet): episodes
    of 3 model turns, each answered by the sandboxed Python tool, published as ids with a model mask,
    scored, trained on the model's tokens only; the ledger records turns, token kinds and the stop
    reason; verify passes."""
    env_file = tmp_path / "sandbox_env.py"
    env_file.write_text(SANDBOX_ENV)
    ledger, steps = fleet.ledger, 3
    # a turn ends at a digit or lowercase letter (ids 4..39 of the tiny tokenizer): "stop", so
    # the episode goes on to the environment instead of ending cut at max_tokens
    job_id = fleet.submit(
        "multi-turn",
        steps,
        mode="async",
        prompts_per_step=2,
        task={"n_train": 32, "n_test": 4},
        reward="exact_match",
        sampling={"max_tokens": 24, "stop_token_ids": list(range(4, 40))},
        environment={
            "name": f"{env_file}:SandboxedEcho",
            "limits": {"max_turns": 3, "max_total_tokens": 200, "step_timeout_s": 20},
        },
    )
    job = fleet.wait(job_id)
    assert job["state"] == "finished", job.get("error")
    trained = [s for s in ledger.samples(job_id, kind="train", limit=10_000) if s["status"] == "trained"]
    assert len(trained) == steps * 2 * 4
    assert all(s["turns"] == 3 and s["stop_reason"] == "done" for s in trained), [
        (s["turns"], s["stop_reason"]) for s in trained
    ][:5]
    # two tool replies per episode, each several tokens; the model's tokens are the rest
    assert all(s["num_env_tokens"] >= 2 and s["num_completion_tokens"] - s["num_env_tokens"] >= 3 for s in trained)
    steps_rows = ledger.train_steps(job_id)
    assert [r["step"] for r in steps_rows] == list(range(1, steps + 1))
    # the loss's token count is the model's tokens only
    model_tokens = sum(s["num_completion_tokens"] - s["num_env_tokens"] for s in trained)
    assert sum(r["metrics"]["tokens"] for r in steps_rows) == model_tokens
    # the environment's per-turn info, averaged per episode, then per step (env/<key>)
    assert all(r["metrics"]["env/ok"] == 1.0 for r in steps_rows), [r["metrics"] for r in steps_rows][:1]
    result = verify(ledger, job_id)
    assert result.ok, [v.message for v in result.violations]


def test_a_job_is_tracked_in_tensorboard_mlflow_and_wandb(tmp_path, tiny_model, monkeypatch):
    """Issue 17's experiment tracking through a real job: the trainer feeds each sink the spec, every
    step, every held-out round and a live knob change, and what it wrote reads back as a user opens it."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    db_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    sup, api, _, _ = _stack(tmp_path, db_url, "tr")
    ledger, steps, track = Ledger(db_url), 4, tmp_path / "tracking"
    try:
        _start_broker(sup, api)
        spec = {
            "name": "tracked",
            "model_path": str(tiny_model),
            "steps": steps,
            "group_size": 4,
            "prompts_per_step": 2,
            "eval_every": 2,
            "task": {"n_train": 32, "n_test": 4},
            "sampling": {"max_tokens": 8},
            "tracking": {"sinks": ["tensorboard", "mlflow", "wandb"]},
        }
        resp = httpx.post(f"{api}/jobs", json=spec, timeout=30)
        assert resp.status_code == 201, resp.text
        job_id = resp.json()["id"]
        # a live knob, set before the trainer starts: it applies it (and tracks it) before step 1
        assert httpx.patch(f"{api}/jobs/{job_id}", json={"lr": 5e-6}, timeout=30).status_code == 200
        wandb_home = {v: str(tmp_path / v.lower()) for v in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
        for name, module, env in (
            ("generator", "generator_svc", {}),
            ("reward", "reward_svc", {}),
            ("trainer", "trainer_svc", {"TRAINER_TRACKING_DIR": str(track), **wandb_home}),
        ):
            sup.start(name, module, {"JOB_ID": job_id, **env})
        _wait_finished(sup, ledger, job_id)
        assert sup.wait_all(60, exclude=("broker",)), "services did not exit after the job finished"
    finally:
        sup.stop_all()
    trainer_log = sup.tail("trainer", 100_000)
    assert [f"tracking: {s} opened" in trainer_log for s in ("tensorboard", "mlflow", "wandb")] == [True] * 3
    assert " left out " not in trainer_log and " failed (" not in trainer_log, trainer_log  # no sink failed
    assert all("phase/tracking_s" in r["metrics"] for r in ledger.train_steps(job_id)[1:])

    ea = EventAccumulator(str(track / "tensorboard" / "asyncrl" / job_id), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("reward/mean")] == list(range(1, steps + 1))
    assert [e.step for e in ea.Scalars("eval/held_out/reward_mean")] == [0, 2, 4]
    assert [e.step for e in ea.Tensors("changes/knobs/text_summary")] == [1]

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store behind this opt-in
    client = MlflowClient(tracking_uri=(track / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("asyncrl").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["name"] == "tracked"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, steps + 1))
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/held_out/reward_mean")) == [0, 2, 4]
    assert json.loads(run.data.tags["change.000001.knobs"]) == {"lr": 5e-6}

    (run_file,) = (track / "wandb").glob(f"offline-run-*-{job_id}/run-{job_id}.wandb")
    assert run_file.stat().st_size > 1000


def _wait_finished(sup: Supervisor, ledger: Ledger, job_id: str, timeout: float = 400) -> None:
    """Until the job ends; it must end finished, with no service failed on the way."""
    deadline = time.monotonic() + timeout
    while ledger.get_job(job_id)["state"] not in ("finished", "failed"):
        assert not sup.failed(), "\n".join(f"{p.name}:\n{sup.tail(p.name)}" for p in sup.failed())
        assert time.monotonic() < deadline, sup.tail("trainer") + sup.tail("generator")
        time.sleep(0.5)
    assert ledger.get_job(job_id)["state"] == "finished", sup.tail("trainer") + sup.tail("generator")


def _stack(tmp_path, db_url: str, tag: str) -> tuple[Supervisor, str, str, str]:
    """A supervisor whose processes share the real Redis (a fresh key prefix), the ledger, and a
    broker port: (supervisor, API base URL, Redis URL, stream prefix)."""
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    prefix = f"{tag}-{uuid.uuid4().hex[:8]}:"
    port = free_port()
    env = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": db_url,
        "STREAM_PREFIX": prefix,
        "BROKER_PORT": str(port),
        "GEN_GENERATOR_ID": "gen-0",
        "TRAINER_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TRAINER_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        # the API enqueues and the admin worker consumes under the same prefix
        "ADMIN_KEY_PREFIX": f"{prefix}admin:",
        "ADMIN_EXPORT_DIR": str(tmp_path / "exports"),
    }
    return Supervisor(tmp_path / "logs", env), f"http://127.0.0.1:{port}", redis_url, prefix


def _start_broker(sup: Supervisor, api: str, timeout: float = 60) -> None:
    sup.start("broker", "broker")
    wait_healthy(f"{api}/health", sup, "broker", timeout)
