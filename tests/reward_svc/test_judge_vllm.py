"""The LLM-judge reward against a real OpenAI-compatible server: vLLM's api_server (CPU build) on the
tiny character-level model built here, with a chat template of our own. The tiny model's replies
are garbage, so each sample's result must be exactly what the judge rule makes of the reply the
same server gives to the same request sent directly: a parsed score, or a parse error quoting it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from asyncrl.tiny_model import build_tiny_model
from shared.rewards import RewardInput, build_scorer
from shared.rewards.remote import JUDGE_RULES

pytestmark = [pytest.mark.integration, pytest.mark.slow]

START_S = 300  # engine start-up on 2 shared cores is ~40 s; bounded so a broken build fails, not hangs
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    model = build_tiny_model(root / "tiny")
    (root / "chat.jinja").write_text(TEMPLATE)
    port = _free_port()
    log_path = root / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny-judge",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--gpu-memory-utilization",
        "0.2",
        "--enforce-eager",
        "--seed",
        "0",
        "--chat-template",
        str(root / "chat.jinja"),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() - t0 > START_S:
                pytest.fail(f"vLLM server not healthy within {START_S} s:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        print(f"vllm api_server healthy after {time.monotonic() - t0:.1f} s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("rule", ["number", "yes_no"])
def test_judge_scores_are_the_rule_applied_to_the_real_servers_replies(judge_server, rule):
    spec = {
        "kind": "judge",
        "base_url": f"{judge_server}/v1",
        "model": "tiny-judge",
        "rule": rule,
        "template": "Q:{prompt} A:{completion} ok?",
        "max_tokens": 6,
        "temperature": 0.0,
        "concurrency": 1,
        "timeout_s": 120,
    }
    items = [
        RewardInput(prompt=f"{a}+{b}=", completion=str(a + b + d), answer=str(a + b))
        for a, b, d in [(1, 2, 0), (12, 7, 1), (40, 2, 0), (9, 9, 3)]
    ]
    replies = []
    for it in items:  # the same request, straight to the server: what the judge must have read
        body = {
            "model": "tiny-judge",
            "max_tokens": 6,
            "temperature": 0.0,
            "messages": [{"role": "user", "content": f"Q:{it.prompt} A:{it.completion} ok?"}],
        }
        resp = httpx.post(f"{judge_server}/v1/chat/completions", json=body, timeout=120)
        resp.raise_for_status()
        replies.append(resp.json()["choices"][0]["message"]["content"])
    t0 = time.monotonic()
    with build_scorer(spec) as scorer:
        results = scorer.score_sync(items)
    print(f"judge ({rule}) scored {len(items)} in {time.monotonic() - t0:.2f} s; replies {replies!r}")
    for reply, res in zip(replies, results, strict=True):
        try:
            want = JUDGE_RULES[rule](reply)
        except ValueError:
            assert res.status == "error" and repr(reply) in res.reason, (reply, res)
        else:
            assert res.ok and res.reward == want, (reply, res)
