"""An agent program of the user's own, written with the `openai` client, trains a job through the
job's OpenAI-compatible endpoint (generator_svc/agents.py, broker/api/routes/agents.py): on the
shared standing fleet, real Redis, the real vLLM CPU engine, the real API.

The agents run multi-turn episodes with one tool, post each episode's reward, and what the ledger
recorded (token counts, turns, rewards) must be exactly what the endpoint answered them."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import httpx
from openai import OpenAI

from broker.verify import verify

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
TURNS = 2


def play(api: str, job_id: str, done: threading.Event, played: list, errors: list) -> None:
    """One agent: take an episode, run TURNS model turns (a tool result or a nudge after each), end it."""
    try:
        while not done.is_set():
            r = httpx.post(f"{api}/jobs/{job_id}/episodes", params={"wait_s": 1}, timeout=30)
            r.raise_for_status()
            task = r.json()
            if task["episode_id"] is None:
                continue
            client = OpenAI(base_url=task["base_url"], api_key="unused", max_retries=0)
            messages: list[dict] = [
                {"role": "system", "content": "You may call add."},
                {"role": "user", "content": task["prompt"]},
            ]
            calls = []
            for _ in range(TURNS):
                resp = client.chat.completions.create(model=task["model"], messages=messages, tools=[ADD], max_tokens=8)
                extra = resp.model_extra or {}
                choice = resp.choices[0]
                calls.append((extra["prompt_token_ids"], choice.model_extra["token_ids"], extra["policy_version"]))
                messages.append(choice.message.model_dump(exclude_none=True))
                if choice.message.tool_calls:
                    for c in choice.message.tool_calls:
                        messages.append({"role": "tool", "tool_call_id": c.id, "content": "0"})
                else:
                    messages.append({"role": "user", "content": "Check it with add."})
            content = choice.message.content or ""
            reward = float(sum(ch.isdigit() for ch in content) > 0)
            end = httpx.post(f"{task['base_url'][: -len('/v1')]}/end", json={"reward": reward}, timeout=60)
            assert end.status_code == 200, end.text
            first, last = calls[0], calls[-1]
            played.append(
                (len(first[0]), len(last[0]) + len(last[1]) - len(first[0]), reward, {v for _, _, v in calls})
            )
    except Exception as exc:  # the test fails on it below
        errors.append(exc)
        done.set()


def test_an_openai_client_agent_trains_a_job_through_the_endpoint(fleet) -> None:
    steps, groups, n = 2, 4, 4
    job_id = fleet.submit(
        "openai-agent",
        steps,
        mode="sync",
        prompts_per_step=groups,
        reward="environment",  # the agent's posted reward
        # a turn ends at a digit or lowercase letter (ids 4..39 of the tiny tokenizer)
        sampling={"max_tokens": 8, "stop_token_ids": list(range(4, 40))},
        environment={"name": "agent", "limits": {"max_turns": 4, "max_total_tokens": 400, "step_timeout_s": 60}},
    )
    done, played, errors = threading.Event(), [], []
    agents = [threading.Thread(target=play, args=(fleet.api, job_id, done, played, errors)) for _ in range(4)]
    for a in agents:
        a.start()
    try:
        job = fleet.wait(job_id)
    finally:
        done.set()
        for a in agents:
            a.join(timeout=60)
    assert not errors, errors
    assert job["state"] == "finished", job.get("error")
    trained = [s for s in fleet.ledger.samples(job_id, kind="train", limit=10_000) if s["status"] == "trained"]
    assert len(trained) == steps * groups * n
    assert all(s["turns"] == TURNS and s["num_env_tokens"] > 0 for s in trained)
    # every trained sample is an episode an agent played: its tokens as the endpoint answered them,
    # its reward the one the agent posted, sampled at one policy version (sync: the trainer's latest)
    recorded = Counter((s["num_prompt_tokens"], s["num_completion_tokens"], s["reward"]) for s in trained)
    answered = Counter((p, c, r) for p, c, r, _ in played)
    assert not recorded - answered, (recorded, answered)
    assert all(len(v) == 1 for *_, v in played)
    result = verify(fleet.ledger, job_id)
    assert result.ok, [v.message for v in result.violations]


def test_the_endpoint_refuses_what_it_cannot_serve(fleet) -> None:
    other = fleet.submit("not-an-agent-job", 1)
    r = httpx.post(f"{fleet.api}/jobs/{other}/episodes", params={"wait_s": 0}, timeout=30)
    assert r.status_code == 409 and "environment" in r.text
    fleet.wait(other)
    r = httpx.post(
        f"{fleet.api}/jobs/{other}/episodes/nope/v1/chat/completions",
        json={"model": other, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 404 and json.loads(r.text)["error"]["code"] == 404


def test_a_cancelled_agent_job_whose_episodes_no_agent_took_frees_the_fleet(fleet) -> None:
    job_id = fleet.submit(
        "agent-nobody-plays",
        3,
        reward="environment",
        environment={"name": "agent", "limits": {"max_turns": 2, "step_timeout_s": 5}},
    )
    # its first batch's episodes are offered (one taken, to see it; never played) and no agent plays them
    deadline = time.monotonic() + 120
    while (
        httpx.post(f"{fleet.api}/jobs/{job_id}/episodes", params={"wait_s": 2}, timeout=30).json()["episode_id"] is None
    ):
        assert time.monotonic() < deadline, fleet.job(job_id)
    assert httpx.post(f"{fleet.api}/jobs/{job_id}/cancel", timeout=30).status_code == 202
    assert fleet.wait(job_id)["state"] == "cancelled"
    # the generator left the batch it was holding for agents: the next job runs
    after = fleet.submit("after-the-agent-job", 1)
    assert fleet.wait(after, timeout=180)["state"] == "finished"
