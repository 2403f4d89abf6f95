"""Chaos for multi-turn episodes (issue 16): the chaos suite's guarantees (0 lost, 0 trained twice,
`asyncrl verify` ok) hold with generators SIGKILLed mid-episode.

One async multi-turn job (k = 1, 2 prompts x 4 episodes per step, 10 steps) through the broker API,
two vLLM generators, the reward service and the trainer as processes, on the local Redis (a fresh
key prefix) and a SQLite ledger. The environment (tests/chaos/slow_env.py, named by file path in
the spec as a user's would be) plays 4 model turns per episode and its tool sleeps 0.3 s per call,
so a batch of episodes takes seconds, longer than GEN_CLAIM_IDLE_MS (3 s here). Two SIGKILLs, each
while the victim's tool is mid-call in an episode's second model turn or later (the environment's
marker file shows the call begun and never ended):

1. gen-1, while gen-0 serves too; not restarted: gen-0 reclaims the entries gen-1 left pending
   once they are idle GEN_CLAIM_IDLE_MS;
2. gen-0, alone by then; restarted under its own name: it re-reads the entries it left pending.

An episode lives only in its generator's memory until its whole batch is published: the killed
generator published nothing of the interrupted batch, its prompt entries stayed pending, and the
successor played those groups again from the start. Then the suite's accounting (tests/chaos/
harness.py `account`, against a witness of every group fed) must find nothing lost and nothing
trained twice; `broker.verify` and the `asyncrl verify` CLI must pass; the interrupted groups must
have been played again in full by the successor and used; nothing may be dead-lettered (there is
no bad input); no live generator's batch may have been taken over by the other (a live generator
keeps the entries of episodes that outlast the claim idle time claimed, generator_svc/episodes.py);
and the trained rows must be multi-turn episodes (turns > 1, environment tokens).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from asyncrl.launch import Supervisor
from broker.ledger import USED_STATUSES, Ledger
from broker.redis_server import resolve_redis_url
from broker.streams import JobStreams, connect
from broker.verify import verify
from chaos.harness import Fault, Stack, Witness, account, free_port, new_prefix, ts

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.slow]

K, P, N, STEPS = 1, 2, 4, 10  # max staleness, prompts per step, group size (episodes), trainer steps
TURNS, SLEEP_S = 4, 0.3  # model turns per episode, seconds per tool call
ENV_FILE = Path(__file__).with_name("slow_env.py")
ASYNCRL = str(Path(sys.executable).with_name("asyncrl"))  # the console script installed beside python


def _markers(path: Path) -> tuple[dict[tuple[int, str, int], tuple[int, float]], set[tuple[int, str, int]]]:
    """The environment's marker lines: tool calls begun, (pid, episode, turn) -> (prompt index,
    time), and those ended."""
    begun: dict[tuple[int, str, int], tuple[int, float]] = {}
    ended: set[tuple[int, str, int]] = set()
    if not path.exists():
        return begun, ended
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 6:
            continue  # a line being written
        what, pid, episode, prompt_index, turn, at = parts
        key = (int(pid), episode, int(turn))
        if what == "begin":
            begun[key] = (int(prompt_index), float(at))
        else:
            ended.add(key)
    return begun, ended


def test_generator_sigkilled_mid_episode(tmp_path, tiny_model, capsys):
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    db_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(db_url)
    prefix = new_prefix("chaos-ep")
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    ckpt_dir = tmp_path / "checkpoints"
    marker = tmp_path / "tool-calls.log"
    env = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": db_url,
        "STREAM_PREFIX": prefix,
        "BROKER_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
        "TRAINER_THREADS": "1",
        "TRAINER_CHECKPOINT_DIR": str(ckpt_dir),
        "ADMIN_KEY_PREFIX": f"{prefix}admin:",
        "ADMIN_EXPORT_DIR": str(tmp_path / "exports"),
        # another generator reclaims a dead one's entries within seconds (default: a minute)
        "GEN_CLAIM_IDLE_MS": "3000",
    }
    sup = Supervisor(tmp_path / "logs", env)
    t_start = time.time()
    witness: Witness | None = None
    kills: list[dict] = []
    try:
        sup.start("broker", "broker")
        deadline = time.monotonic() + 60
        while not _healthy(api):
            assert not sup.failed() and time.monotonic() < deadline, f"broker did not come up:\n{sup.tail('broker')}"
            time.sleep(0.2)
        # a model turn ends at a digit or lowercase letter (ids 4..39 of the tiny tokenizer): "stop",
        # so every turn goes on to the environment
        spec = {
            "name": "chaos-episodes",
            "model_path": str(tiny_model),
            "mode": "async",
            "max_staleness": K,
            "steps": STEPS,
            "group_size": N,
            "prompts_per_step": P,
            "eval_every": 0,
            "generation_batch": 2,
            "task": {"n_train": 64, "n_test": 4},
            "reward": "exact_match",
            "sampling": {"max_tokens": 24, "stop_token_ids": list(range(4, 40))},
            "environment": {
                "name": f"{ENV_FILE}:SlowTool",
                "kwargs": {"sleep_s": SLEEP_S, "turns": TURNS, "marker": str(marker)},
                "limits": {"max_turns": TURNS, "max_total_tokens": 240, "step_timeout_s": 30},
            },
        }
        r = httpx.post(f"{api}/jobs", json=spec, timeout=30)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        streams = JobStreams(connect(redis_url), job_id, prefix=prefix)
        witness = Witness(redis_url, job_id, prefix)
        witness.start()
        stack = Stack(
            sup,
            job_id,
            ledger,
            {
                "gen-0": ("generator", "generator_svc", {"GEN_GENERATOR_ID": "gen-0"}),
                "gen-1": ("generator", "generator_svc", {"GEN_GENERATOR_ID": "gen-1"}),
                "reward-0": ("reward", "reward_svc", {"REWARD_CONSUMER_ID": "reward-0"}),
                "trainer-0": ("trainer", "trainer_svc", {"TRAINER_CONSUMER_ID": "trainer-0"}),
            },
        )
        for name in ("trainer-0", "reward-0", "gen-0", "gen-1"):
            stack.start(name)

        def wait_until(cond, timeout_s: float, what: str, poll_s: float = 0.3) -> None:
            deadline = time.monotonic() + timeout_s
            while not cond():
                bad = stack.unexpected_exits()
                assert not bad, "\n".join(bad)
                assert ledger.get_job(job_id)["state"] in ("queued", "running"), f"{what}: {ledger.get_job(job_id)}"
                assert time.monotonic() < deadline, (
                    f"timed out: {what}\n{sup.tail(stack.procs['trainer-0'].name, 30)}"
                    f"\n{sup.tail(stack.procs['gen-0'].name, 30)}"
                )
                time.sleep(poll_s)

        def mid_episode(pid: int) -> list[tuple[str, int, int]]:
            """Tool calls of process `pid` begun in an episode's second model turn or later and not
            ended: (episode, prompt index, turn index)."""
            begun, ended = _markers(marker)
            return [
                (e, pi, t) for (p, e, t), (pi, _at) in begun.items() if p == pid and t >= 1 and (p, e, t) not in ended
            ]

        def replayed(k: dict) -> bool:
            """Every group the kill interrupted has its rows again, from the successor."""
            rows = [
                x
                for x in ledger.samples(job_id)
                if x["prompt_index"] in k["prompt_indices"]
                and x["generator_id"] == k["successor"]
                and ts(x["created_at"]) > k["fault"].at
            ]
            return len(rows) >= N * len(k["prompt_indices"])

        # kill 1: gen-1 mid-episode while gen-0 serves too, not restarted: gen-0 reclaims what it left
        # pending once idle GEN_CLAIM_IDLE_MS. kill 2: gen-0, alone now, mid-episode, restarted under
        # its own name: it re-reads the entries it left pending first.
        wait_until(
            lambda: {x["generator_id"] for x in ledger.samples(job_id)} >= {"gen-0", "gen-1"},
            240,
            "both generators serving",
        )
        for victim, successor, restart in (("gen-1", "gen-0", False), ("gen-0", "gen-0", True)):
            if not kills:  # both generators serve a few steps first
                wait_until(lambda: stack.step() >= 2, 240, "step 2 before the first kill")
            pid = stack.procs[victim].popen.pid
            wait_until(lambda pid=pid: mid_episode(pid), 120, f"{victim} mid-episode", poll_s=0.05)
            f: Fault = stack.kill(victim, "episodes")
            # proof: tool calls the kill interrupted (begun, never ended: the process is gone)
            interrupted = mid_episode(pid)
            assert interrupted, "the kill did not land mid-episode"
            if restart:
                stack.restart(f, 0.5)
            k = {
                "fault": f,
                "pid": pid,
                "successor": successor,
                "interrupted": interrupted,
                "prompt_indices": sorted({pi for _e, pi, _t in interrupted}),
            }
            kills.append(k)
            wait_until(lambda k=k: replayed(k), 240, f"{successor} playing again what the kill of {victim} interrupted")
            f.recovered_at = time.time()

        deadline = time.monotonic() + 300
        while ledger.get_job(job_id)["state"] not in ("finished", "failed", "stopped", "cancelled"):
            bad = stack.unexpected_exits()
            assert not bad, "\n".join(bad)
            assert time.monotonic() < deadline, sup.tail(stack.procs["trainer-0"].name, 40)
            time.sleep(0.5)
        assert ledger.get_job(job_id)["state"] == "finished", ledger.get_job(job_id)
        # the trainer's end-of-job stop makes every service exit on its own, cleanly
        live = [p for p in stack.procs.values() if p.popen.pid not in stack.killed]
        for p in live:
            p.popen.wait(90)
        assert [p.popen.returncode for p in live] == [0] * len(live), stack.unexpected_exits()
        t_end = time.time()
        # the user's check, through the API: exits 1 on a violation
        cli = subprocess.run(
            [ASYNCRL, "verify", job_id],
            env={**os.environ, "ASYNCRL_API": api, "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        if witness is not None:
            witness.stop()
        sup.stop_all()

    res = verify(ledger, job_id)
    acc = account(witness, ledger, streams, job_id, ckpt_dir, (K + 1) * P + spec["task"]["n_test"], N)
    missed_groups = witness.missed_groups()
    samples = ledger.samples(job_id)
    trained = [s for s in samples if s["status"] == "trained"]
    dead = streams.dead_letters(count=100_000)
    streams.delete_all()

    # -- the figures ---------------------------------------------------------------------------
    gen_logs = [p.read_text(errors="replace") for p in (tmp_path / "logs").glob("gen-*.log")]
    taken_over = sum(t.count("were taken over by another generator") for t in gen_logs)
    reclaims = sum(t.count("reclaimed ") for t in gen_logs)
    dead_codes: dict[str, int] = {}
    for d in dead:
        dead_codes[d.code] = dead_codes.get(d.code, 0) + 1
    lines = [
        f"multi-turn chaos: {STEPS} steps, wall {t_end - t_start:.0f} s; {acc.fed} groups fed "
        f"({len(samples)} samples generated), {acc.terminal} terminal, {acc.in_flight_end} in flight at the end, "
        f"{len(acc.lost)} lost, {acc.redis_lost} settled lost (Redis lost them); "
        f"samples by status {acc.statuses}; trained twice: ledger "
        f"{acc.trained_twice_ledger}, metric {acc.trained_twice_metric}; dead letters {dead_codes}; "
        f"reclaims {reclaims}, batches taken over from a live generator {taken_over}; "
        f"verify {'ok' if res.ok else [v.message for v in res.violations]}; asyncrl verify exit {cli.returncode}"
    ]
    replays = []
    for k in kills:
        f = k["fault"]
        rows = [s for s in samples if s["kind"] == "train" and s["prompt_index"] in k["prompt_indices"]]
        replays.append(rows)
        first = min(
            (
                ts(s["created_at"])
                for s in samples
                if s["generator_id"] == k["successor"] and ts(s["created_at"]) > f.at
            ),
            default=float("nan"),
        )
        redone = max((ts(s["created_at"]) for s in rows), default=float("nan"))
        restarted = "not restarted" if f.restarted_at is None else f"restarted after {f.restarted_at - f.at:.1f} s"
        lines.append(
            f"SIGKILL {f.name} (pid {k['pid']}) at step {f.step_at}, {restarted}: {len(k['interrupted'])} "
            f"tool calls interrupted (turn indices {sorted({t for _e, _p, t in k['interrupted']})}) in "
            f"prompts {k['prompt_indices']}; {k['successor']}'s next sample {first - f.at:.1f} s after the "
            f"kill, the interrupted groups played again in full {redone - f.at:.1f} s after it; their "
            f"rows (generator, status) per group: {sorted((s['generator_id'], s['status']) for s in rows)[::N]}"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))

    # -- the guarantees ------------------------------------------------------------------------
    assert len(kills) == 2 and all(k["interrupted"] for k in kills)
    assert res.ok, [v.message for v in res.violations]
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert missed_groups == 0, "the witness missed fed prompt groups: the loss count would be incomplete"
    assert acc.lost == [], acc.lost[:10]
    assert acc.trained_twice_ledger == 0 and acc.trained_twice_metric == 0
    assert acc.in_flight_end <= acc.in_flight_bound
    assert len(trained) == STEPS * P * N
    # nothing here deserves a dead letter (no bad input, no prompt too long, an environment that
    # never fails): a healthy group dead-lettered (e.g. "delivered too often" after generators took
    # a batch from each other) is a group thrown away
    assert dead == [], [(d.code, d.reason) for d in dead]
    # a live generator's batch outlasting GEN_CLAIM_IDLE_MS (3 s here; batches take 3-6 s) is not
    # taken over by the other one: it keeps its entries claimed while its episodes play
    assert taken_over == 0, "a live generator's batch was taken over by the other generator"
    # each interrupted group was played again, whole, by the successor after the kill (the killed
    # generator published nothing of its batch), and used: trained or dropped with a reason
    for k, rows in zip(kills, replays, strict=True):
        f = k["fault"]
        assert all(ts(s["created_at"]) > f.at and s["generator_id"] == k["successor"] for s in rows), [
            (s["generator_id"], s["created_at"]) for s in rows
        ]
        assert len(rows) == N * len(k["prompt_indices"]), len(rows)
        assert all(
            s["status"] in USED_STATUSES or s["group_id"] in _journal_in_flight(ckpt_dir, job_id) for s in rows
        ), [(s["group_id"], s["status"]) for s in rows]
    # multi-turn episodes all the way through: several model turns, tool tokens in the context
    assert all((s["turns"] or 0) > 1 and (s["num_env_tokens"] or 0) > 0 for s in trained), [
        (s["turns"], s["num_env_tokens"], s["stop_reason"]) for s in trained
    ][:5]
    assert sum(s["stop_reason"] == "done" and s["turns"] == TURNS for s in trained) >= len(trained) // 2


def _journal_in_flight(ckpt_dir: Path, job_id: str) -> set[str]:
    """Groups the final feed journal still names as in flight."""
    import json

    return set(json.loads((ckpt_dir / job_id / "feed-journal.json").read_text())["in_flight"])


def _healthy(api: str) -> bool:
    try:
        return httpx.get(f"{api}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
