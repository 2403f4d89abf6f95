"""Remote rewards against a real HTTP server on localhost (FastAPI under uvicorn, in a thread): the
batch protocol, retries with back-off on 503 until the endpoint recovers, a dead endpoint and a
hung one (status error / timeout with the reason), malformed answers, and the judge's request and
reply rules on an OpenAI-shaped route, and the answer's byte cap on the wire and decoded (a gzip
bomb, with the scoring process's peak RSS recorded in results/hostile.json). The judge against a
real `vllm serve` is in tests/reward_svc/test_judge_vllm.py."""

from __future__ import annotations

import asyncio
import functools
import gzip
import json
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from hostile_results import record_hostile

from shared.rewards import RewardInput, RewardLoadError, RewardResult, build_scorer
from shared.rewards.base import RewardLimits
from shared.rewards.remote import parse_number, parse_yes_no

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


@functools.cache
def gzip_bomb(mib: int) -> bytes:
    """A gzip body that inflates to `mib` MiB of zeros (1024 MiB: about 1 MiB on the wire). Built
    from one compressed MiB: after a full flush deflate forgets its history, so every further MiB
    of zeros compresses to the same bytes (checked)."""
    block = bytes(MIB)
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    first, again, third = (c.compress(block) + c.flush(zlib.Z_FULL_FLUSH) for _ in range(3))
    assert again == third
    body = first + again * (mib - 1) + c.flush()
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(block, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    return header + body + crc.to_bytes(4, "little") + ((mib * MIB) % 2**32).to_bytes(4, "little")


def test_the_gzip_bomb_is_what_it_says() -> None:
    assert zlib.decompress(gzip_bomb(3), 31) == bytes(3 * MIB)
    assert len(gzip_bomb(1024)) < 1.1 * MIB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        app = FastAPI()

        @app.post("/score")
        async def score(request: Request):
            body = await request.json()
            self.calls["score"] += 1
            self.bodies.append(body)
            return {
                "rewards": [
                    {"len": len(it["completion"]), "bonus": it["metadata"].get("bonus", 0)}
                    if it["metadata"]
                    else len(it["completion"])
                    for it in body["items"]
                ]
            }

        @app.post("/flaky/{fails}")
        async def flaky(fails: int, request: Request):
            self.calls["flaky"] += 1
            if self.calls["flaky"] <= fails:
                return JSONResponse({"detail": "warming up"}, status_code=503)
            body = await request.json()
            return {"rewards": [0.5] * len(body["items"])}

        @app.post("/forbidden")
        async def forbidden():
            self.calls["forbidden"] += 1
            return JSONResponse({"detail": "no such scorer"}, status_code=404)

        @app.post("/hang")
        async def hang():
            await asyncio.sleep(3600)

        @app.post("/short")
        async def short():
            return {"rewards": [1.0]}

        @app.post("/text")
        async def text():
            return PlainTextResponse("not json")

        @app.post("/encoded/{how}")
        async def encoded(how: str, request: Request):
            self.headers.append(dict(request.headers))
            n = len((await request.json())["items"])
            payload = json.dumps({"rewards": [1.0] * n}).encode()
            bodies = {
                "gzip": (payload, "gzip", gzip.compress),
                "deflate": (payload, "deflate", zlib.compress),
                "raw-deflate": (
                    payload,
                    "deflate",
                    lambda b: (c := zlib.compressobj(wbits=-15)).compress(b) + c.flush(),
                ),
                "br": (payload, "br", lambda b: b"not brotli"),
                "big": (payload + b" " * 2 * MIB, "identity", lambda b: b),
                "bomb": (b"", "gzip", lambda b: gzip_bomb(64)),
                "bomb-1g": (b"", "gzip", lambda b: gzip_bomb(1024)),
            }
            content, encoding, encode = bodies[how]
            return Response(encode(content), headers={"content-encoding": encoding}, media_type="application/json")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.headers.append(dict(request.headers))
            self.bodies.append(body)
            # The reply is the user message's last line: the template puts the completion there.
            reply = body["messages"][-1]["content"].splitlines()[-1]
            return {
                "id": "x",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
            }

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=1)
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> Server:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)


@pytest.fixture
def server() -> Iterator[Server]:
    with Server() as s:
        yield s


def item(completion: str, **kw) -> RewardInput:
    return RewardInput(prompt=kw.pop("prompt", "2+2="), completion=completion, answer=kw.pop("answer", "4"), **kw)


def score(spec, items, limits: RewardLimits | None = None) -> list[RewardResult]:
    with build_scorer(spec, limits=limits) as scorer:
        return scorer.score_sync(items)


def test_http_batches_items_and_reads_rewards_and_components(server):
    items = [item("a"), item("bbb"), item("cc", metadata={"bonus": 10})]
    results = score({"kind": "http", "url": f"{server.url}/score", "batch_size": 2}, items)
    assert results == [RewardResult(1.0), RewardResult(3.0), RewardResult(12.0, components={"len": 2.0, "bonus": 10.0})]
    assert server.calls["score"] == 2  # batches of 2 and 1
    # the batches go out concurrently: find the one that holds "a" rather than trust arrival order
    (first,) = [b for b in server.bodies if b["items"][0]["completion"] == "a"]
    assert first["items"][0] == {
        "prompt": "2+2=",
        "completion": "a",
        "answer": "4",
        "metadata": {},
        "finish_reason": None,
        "episode": {},
    }
    assert sorted(len(b["items"]) for b in server.bodies) == [1, 2]


def test_http_retries_with_back_off_until_the_endpoint_recovers(server):
    t0 = time.monotonic()
    results = score({"kind": "http", "url": f"{server.url}/flaky/2", "retries": 2}, [item("a"), item("b")])
    assert [r.reward for r in results] == [0.5, 0.5]
    assert server.calls["flaky"] == 3  # two 503s, then the answer
    assert time.monotonic() - t0 >= 0.2  # it backed off between attempts


def test_http_failures_are_recorded_with_the_reason(server):
    (r,) = score({"kind": "http", "url": f"{server.url}/flaky/5", "retries": 1}, [item("a")])
    assert r.status == "error" and r.reward is None
    assert "HTTP 503" in r.reason and "warming up" in r.reason and "after 2 attempt(s)" in r.reason

    (r,) = score({"kind": "http", "url": f"{server.url}/forbidden", "retries": 3}, [item("a")])
    assert "HTTP 404" in r.reason and "after 1 attempt(s)" in r.reason  # a 4xx is not retried
    assert server.calls["forbidden"] == 1

    dead = f"http://127.0.0.1:{_free_port()}/score"
    (r,) = score({"kind": "http", "url": dead, "retries": 2}, [item("a")])
    assert r.status == "error" and f"POST {dead}: ConnectError" in r.reason and "after 3 attempt(s)" in r.reason

    t0 = time.monotonic()
    results = score({"kind": "http", "url": f"{server.url}/hang", "timeout_s": 1.0}, [item("a"), item("b")])
    assert time.monotonic() - t0 < 5
    assert [r.status for r in results] == ["timeout", "timeout"]
    assert "no answer within the time budget of 1 s" in results[0].reason

    (r, _) = score({"kind": "http", "url": f"{server.url}/short"}, [item("a"), item("b")])
    assert r.status == "error" and "with 2 entries, got 1 rewards" in r.reason
    (r,) = score({"kind": "http", "url": f"{server.url}/text"}, [item("a")])
    assert r.status == "error" and "not JSON" in r.reason


def test_http_answers_are_decoded_within_the_byte_cap(server):
    limits = RewardLimits(max_response_bytes=MIB)

    def one(how: str) -> RewardResult:
        (r,) = score({"kind": "http", "url": f"{server.url}/encoded/{how}"}, [item("a")], limits)
        return r

    for how in ("gzip", "deflate", "raw-deflate"):
        assert one(how) == RewardResult(1.0), how
    assert all(h["accept-encoding"] == "gzip, deflate" for h in server.headers)  # only what it decodes
    big, bomb, br = one("big"), one("bomb"), one("br")
    assert big.status == "error" and f"over {MIB} bytes on the wire (REWARD_HTTP_MAX_BYTES" in big.reason
    assert bomb.status == "error" and f"over {MIB} bytes decoded" in bomb.reason  # 64 KiB in, 64 MiB out
    assert br.status == "error" and "Content-Encoding 'br' is not supported" in br.reason


@pytest.mark.hostile
def test_a_gzip_bomb_costs_the_scoring_process_at_most_the_cap(server):
    """The issue's probe: 1 MiB of gzip that inflates to 1 GiB, four at once, scored in a fresh
    process (the reward service's scorer, default limits) whose peak RSS is read from the kernel."""
    probe = """
import json, sys
from shared.rewards import RewardInput, build_scorer
def rss(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) / 1024
with build_scorer({"kind": "http", "url": sys.argv[1], "batch_size": 1, "retries": 0}) as scorer:
    before = rss("VmRSS")
    results = scorer.score_sync([RewardInput("p", str(i), "a") for i in range(4)])
print(json.dumps({"statuses": [r.status for r in results], "reason": results[0].reason,
                  "before_mib": before, "peak_mib": rss("VmHWM")}))
"""
    gzip_bomb(1024)  # built before the clock starts
    out = subprocess.run(
        [sys.executable, "-c", probe, f"{server.url}/encoded/bomb-1g"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(out.stdout)
    assert got["statuses"] == ["error"] * 4 and "bytes decoded (REWARD_HTTP_MAX_BYTES" in got["reason"], got
    peak = round(got["peak_mib"], 1)
    record_hostile(
        http_gzip_bomb_peak_rss_mib=peak,
        peak_rss_mib=peak,
        http_gzip_bomb={
            "body_mib": round(len(gzip_bomb(1024)) / MIB, 2),
            "inflates_to_mib": 1024,
            "requests": 4,
            "rss_before_mib": round(got["before_mib"], 1),
            "cap_mib": 4,
        },
    )
    assert peak < 128, got  # the documented bound: 4 answers of at most 4 MiB over the interpreter's ~45 MiB


def test_judge_sends_the_template_and_reads_the_reply_by_rule(server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sekrit")
    spec = {
        "kind": "judge",
        "base_url": f"{server.url}/v1",
        "model": "tiny-judge",
        "system": "be strict",
        "template": "Q: {prompt} A: {answer} id={metadata[id]}\n{completion}",
        "max_tokens": 5,
        "api_key_env": "JUDGE_KEY",
    }
    replies = ["0.75", "1", "well 0", "nothing here", "7 out of 10"]
    results = score(spec, [item(c, metadata={"id": 7}) for c in replies] + [item("x", metadata={})])
    assert [r.reward for r in results[:3]] == [0.75, 1.0, 0.0]
    assert results[3].status == "error" and results[3].reason == (
        "judge reply 'nothing here' cannot be read by rule 'number': no number in it"
    )
    assert "its number 7 is outside [0, 1]" in results[4].reason
    assert results[5].status == "error" and "judge template: KeyError: 'id'" in results[5].reason
    # The judge's requests run concurrently: find the first item's by its content, not its arrival order.
    assert len(server.bodies) == 5 and all(b["model"] == "tiny-judge" for b in server.bodies)
    (body,) = [b for b in server.bodies if b["messages"][-1]["content"].endswith("\n0.75")]
    assert body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert body["messages"] == [
        {"role": "system", "content": "be strict"},
        {"role": "user", "content": "Q: 2+2= A: 4 id=7\n0.75"},
    ]
    assert all(h["authorization"] == "Bearer sekrit" for h in server.headers)

    yes_no = {**spec, "rule": "yes_no", "template": "{completion}", "api_key_env": None, "system": None}
    results = score(yes_no, [item("Yes, it is"), item("no."), item("maybe")])
    assert [r.reward for r in results[:2]] == [1.0, 0.0] and results[2].status == "error"


def test_judge_without_its_key_fails_at_start_up(monkeypatch):
    monkeypatch.delenv("NO_SUCH_JUDGE_KEY", raising=False)
    with pytest.raises(RewardLoadError, match="NO_SUCH_JUDGE_KEY"):
        build_scorer(
            {"kind": "judge", "base_url": "http://127.0.0.1:1/v1", "model": "m", "api_key_env": "NO_SUCH_JUDGE_KEY"}
        )


@pytest.mark.parametrize(("reply", "want"), [("0.5", 0.5), (" 1.0 because", 1.0), ("score: .25", 0.25), ("0", 0.0)])
def test_parse_number(reply, want):
    assert parse_number(reply) == want


@pytest.mark.parametrize(("reply", "want"), [("yes", 1.0), ("YES!", 1.0), ("  No, wrong", 0.0)])
def test_parse_yes_no(reply, want):
    assert parse_yes_no(reply) == want
