"""Rewards scored over HTTP: a remote scorer (kind `http`) and an LLM judge (kind `judge`).

Remote scorer protocol: POST `url` with {"items": [{"prompt", "completion", "answer", "metadata",
"finish_reason", "episode"}, ...]} (up to batch_size items; `episode`: a multi-turn episode's
metrics, {} for a single turn); the answer is {"rewards": [r, ...]}, one per item
in order, each a number or a dict of named numbers (components, summed). Judge: POST
`<base_url>/chat/completions` (OpenAI-compatible) with the template filled in as the user message;
the reply's text becomes a score by the spec's rule (JUDGE_RULES); a reply the rule cannot read is
status error with the reply quoted in the reason.

Both retry connection errors, 429 and 5xx answers with exponential back-off (tenacity), all
within the spec's time budget; over the budget the samples are status `timeout`, any other
failure status `error` with the reason (the URL, the HTTP status and the answer's start).

An answer is read as it streams in and decoded here (identity, gzip or deflate; no other
Content-Encoding is asked for or accepted), at most `RewardLimits.max_response_bytes` on the wire
and as many decoded: a larger answer (a gzip bomb: 1 MiB that inflates to 1 GiB) is the batch's
error, and the service holds at most the cap of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from shared.rewards.base import (
    BuildContext,
    RewardInput,
    RewardLoadError,
    RewardResult,
    coerce,
    failed,
)
from shared.rewards.spec import HttpReward, JudgeReward

QUOTE = 500  # characters of a reply or an error body quoted in a reason


ERROR_BODY_BYTES = 16 * 1024  # of an error answer (4xx, 5xx), read to quote its start


class _Status(Exception):
    """A non-2xx answer: its status code and the start of its body."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"HTTP {code}")
        self.code, self.text = code, text


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, _Status):
        return exc.code == 429 or exc.code >= 500
    return isinstance(exc, httpx.TransportError)


class _TooLarge(Exception):
    pass


def _decoder(encoding: str) -> Any:
    """A zlib decompressor for the Content-Encoding (None: identity). Raises ValueError for others."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if encoding == "deflate":  # RFC 9110: the zlib format (some servers send raw deflate: retried below)
        return zlib.decompressobj(zlib.MAX_WBITS)
    raise ValueError(f"Content-Encoding {encoding!r} is not supported (identity, gzip or deflate)")


async def read_capped(resp: httpx.Response, cap: int) -> bytes:
    """The streamed response's body, decoded, reading at most `cap` bytes from the wire and
    decoding at most `cap` (+ 1) bytes of it.

    Raises:
        _TooLarge: the body is over `cap` on the wire or decoded.
        ValueError: an unsupported Content-Encoding, or a body that does not decode.
    """
    decoder = _decoder(resp.headers.get("content-encoding", ""))
    raw_deflate = False
    out = bytearray()
    async for chunk in resp.aiter_raw():
        if resp.num_bytes_downloaded > cap:
            raise _TooLarge(f"over {cap} bytes on the wire")
        if decoder is None:
            out += chunk
        else:
            data = chunk
            while data:
                try:
                    out += decoder.decompress(data, cap + 1 - len(out))
                except zlib.error as exc:
                    if raw_deflate or out or resp.headers.get("content-encoding", "").strip().lower() != "deflate":
                        raise ValueError(f"the body does not decode: {exc}") from None
                    decoder, raw_deflate = zlib.decompressobj(-zlib.MAX_WBITS), True
                    continue
                if len(out) > cap:
                    raise _TooLarge(f"over {cap} bytes decoded")
                data = decoder.unconsumed_tail
        if len(out) > cap:
            raise _TooLarge(f"over {cap} bytes")
    if decoder is not None:  # what the decoder still holds, still within the cap
        while more := decoder.decompress(b"", cap + 1 - len(out)):
            out += more
            if len(out) > cap:
                raise _TooLarge(f"over {cap} bytes decoded")
    return bytes(out)


class _Poster:
    """POST JSON with retries; one httpx client per event loop that uses it. Answers are read
    within `max_bytes` (`read_capped`)."""

    def __init__(self, headers: dict[str, str], retries: int, timeout_s: float, max_bytes: int) -> None:
        # Only the encodings read_capped decodes (httpx would offer br and zstd when installed).
        self._headers = {"Accept-Encoding": "gzip, deflate", **headers}
        self._retries = retries
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:  # a client's connections belong to one loop
            self._client = httpx.AsyncClient(headers=self._headers, timeout=httpx.Timeout(self._timeout_s))
            self._loop = loop
        return self._client

    async def _once(self, url: str, body: dict[str, Any]) -> Any:
        """One POST: the answer's JSON. Raises _Status for a non-2xx answer, RemoteError for one
        over the cap or not JSON, httpx errors for the transport."""
        async with self._http().stream("POST", url, json=body) as resp:
            if resp.status_code >= 400:
                try:
                    text = (await read_capped(resp, ERROR_BODY_BYTES)).decode("utf-8", "replace")
                except (_TooLarge, ValueError) as exc:
                    text = f"(body not read: {exc})"
                raise _Status(resp.status_code, text[:QUOTE])
            try:
                data = await read_capped(resp, self._max_bytes)
            except _TooLarge as exc:
                raise RemoteError(
                    "error",
                    f"POST {url}: the answer is {exc} (REWARD_HTTP_MAX_BYTES = {self._max_bytes}); not read further",
                ) from None
            except ValueError as exc:
                raise RemoteError("error", f"POST {url}: {exc}") from None
        try:
            return json.loads(data)
        except ValueError as exc:  # not JSON, or not UTF-8
            raise RemoteError("error", f"POST {url}: the answer is not JSON ({exc})") from None

    async def post(self, url: str, body: dict[str, Any]) -> Any:
        """The answer's JSON. Raises a RemoteError (status, reason) on every failure."""
        attempts = 0

        async def go() -> Any:
            nonlocal attempts
            retrying = AsyncRetrying(
                stop=stop_after_attempt(self._retries + 1),
                wait=wait_exponential(multiplier=0.2, max=5.0),
                retry=retry_if_exception(_retryable),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    return await self._once(url, body)
            raise AssertionError("unreachable: tenacity reraises the last error")

        tries = f"{self._retries + 1} attempt(s) allowed"
        try:
            return await asyncio.wait_for(go(), self._timeout_s)
        except RemoteError:
            raise
        except asyncio.TimeoutError:
            raise RemoteError(
                "timeout",
                f"POST {url}: no answer within the time budget of "
                f"{self._timeout_s:g} s (timeout_s; {attempts} attempt(s))",
            ) from None
        except _Status as exc:
            raise RemoteError(
                "error", f"POST {url}: HTTP {exc.code} {exc.text!r} after {attempts} attempt(s) ({tries})"
            ) from None
        except httpx.HTTPError as exc:
            raise RemoteError(
                "error", f"POST {url}: {type(exc).__name__}: {exc} after {attempts} attempt(s) ({tries})"
            ) from None

    async def aclose(self) -> None:
        if self._client is not None:
            with contextlib.suppress(RuntimeError):  # its loop is gone
                await self._client.aclose()
            self._client = None


class RemoteError(Exception):
    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason

    def result(self) -> RewardResult:
        return failed("timeout" if self.status == "timeout" else "error", self.reason)


class HttpScorer:
    """Kind `http`: batches of batch_size items, one POST each, concurrently."""

    def __init__(self, spec: HttpReward, ctx: BuildContext) -> None:
        self._spec = spec
        self._poster = _Poster(dict(spec.headers), spec.retries, spec.timeout_s, ctx.limits.max_response_bytes)

    async def score(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        n = self._spec.batch_size
        chunks = [list(items[i : i + n]) for i in range(0, len(items), n)]
        done = await asyncio.gather(*(self._chunk(c) for c in chunks))
        return [r for chunk in done for r in chunk]

    async def _chunk(self, chunk: list[RewardInput]) -> list[RewardResult]:
        url = self._spec.url
        body = {"items": [it.as_json() for it in chunk]}
        try:
            data = await self._poster.post(url, body)
        except RemoteError as exc:
            return [exc.result()] * len(chunk)
        rewards = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(chunk):
            got = f"{len(rewards)} rewards" if isinstance(rewards, list) else repr(data)[:QUOTE]
            return [
                failed("error", f'POST {url}: expected {{"rewards": [...]}} with {len(chunk)} entries, got {got}')
            ] * len(chunk)
        out = [coerce(r) for r in rewards]
        return [r if r.ok else failed("error", f"POST {url}: {r.reason}") for r in out]

    async def aclose(self) -> None:
        await self._poster.aclose()


# --- judge -------------------------------------------------------------------------------------

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_number(reply: str) -> float:
    """The first number in the reply, which must lie in [0, 1]."""
    m = _NUMBER.search(reply)
    if m is None:
        raise ValueError("no number in it")
    value = float(m.group())
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"its number {m.group()} is outside [0, 1]")
    return value


def parse_yes_no(reply: str) -> float:
    """1.0 if the reply's first word is yes, 0.0 if it is no (any case)."""
    m = re.match(r"\W*([A-Za-z]+)", reply)
    word = m.group(1).lower() if m else ""
    if word in ("yes", "no"):
        return 1.0 if word == "yes" else 0.0
    raise ValueError("its first word is neither yes nor no")


JUDGE_RULES: dict[str, Callable[[str], float]] = {"number": parse_number, "yes_no": parse_yes_no}


class JudgeScorer:
    """Kind `judge`: one chat completion per sample, `concurrency` in flight."""

    def __init__(self, spec: JudgeReward, ctx: BuildContext) -> None:
        self._spec = spec
        try:
            self._parse = JUDGE_RULES[spec.rule]
        except KeyError:
            raise RewardLoadError(f"unknown judge rule {spec.rule!r}; valid: {sorted(JUDGE_RULES)}") from None
        headers = {}
        if spec.api_key_env:
            key = os.environ.get(spec.api_key_env)
            if not key:
                raise RewardLoadError(f"judge: the environment variable {spec.api_key_env} (api_key_env) is not set")
            headers["Authorization"] = f"Bearer {key}"
        self._url = spec.base_url.rstrip("/") + "/chat/completions"
        self._poster = _Poster(headers, spec.retries, spec.timeout_s, ctx.limits.max_response_bytes)
        self._slots = asyncio.Semaphore(spec.concurrency)

    def messages(self, it: RewardInput) -> list[dict[str, str]]:
        """The chat messages for one sample. Raises KeyError/IndexError for a missing metadata key."""
        user = self._spec.template.format(
            prompt=it.prompt, completion=it.completion, answer=it.answer, metadata=dict(it.metadata)
        )
        sys = [{"role": "system", "content": self._spec.system}] if self._spec.system else []
        return [*sys, {"role": "user", "content": user}]

    async def score(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        return list(await asyncio.gather(*(self._one(it) for it in items)))

    async def _one(self, it: RewardInput) -> RewardResult:
        try:
            messages = self.messages(it)
        except (KeyError, IndexError, AttributeError) as exc:
            return failed("error", f"judge template: {type(exc).__name__}: {exc}")
        body = {
            "model": self._spec.model,
            "messages": messages,
            "max_tokens": self._spec.max_tokens,
            "temperature": self._spec.temperature,
        }
        async with self._slots:
            try:
                data = await self._poster.post(self._url, body)
            except RemoteError as exc:
                return exc.result()
        try:
            reply = data["choices"][0]["message"]["content"]
            if not isinstance(reply, str):
                raise TypeError(f"content is {type(reply).__name__}")
        except (KeyError, IndexError, TypeError) as exc:
            return failed("error", f"judge {self._url}: no reply text in the answer ({exc}): {str(data)[:QUOTE]!r}")
        try:
            return RewardResult(reward=self._parse(reply))
        except ValueError as exc:
            return failed("error", f"judge reply {reply[:QUOTE]!r} cannot be read by rule {self._spec.rule!r}: {exc}")

    async def aclose(self) -> None:
        await self._poster.aclose()
