"""Agent episodes: an agent program's own loop, generating through the job's OpenAI-compatible endpoint.

A job with `environment: {"name": "agent"}` has no environment object: the other side of each
episode is an external program (the `openai` client, an agent framework) that takes a task from
the job API (`POST /jobs/{id}/episodes`), calls `/v1/chat/completions` or `/v1/completions` at
the episode's base URL as often as it likes, and ends the episode (`.../end`, with or without a
reward). The API is the HTTP front (broker/api/routes/agents.py); the calls reach this module,
inside the generator that offered the episode, over Redis lists:

    {job}:agent:tasks            episodes offered (AgentTask), popped by the API for an agent
    {job}:agent:route:<episode>  which generator plays it (expires 60 s after its last refresh)
    {job}:agent:calls:<gen>      the agents' calls to that generator (AgentCall)
    {job}:agent:reply:<call>     each call's answer (AgentReply)

Everything else is the multi-turn episode machinery (generator_svc/episodes.py), unchanged: each
prompt group of a batch becomes n episodes, offered here instead of played by an environment; the
turns of every episode waiting at once go into one engine call (TurnBatcher); the episode's
tokens are recorded as they are sampled and as the agent's new messages are rendered once, when
they are appended (the chat template's continuation, shared.environments.episode), so the trainer
trains on exactly the ids the engine conditioned on and sampled; the batch runs at one policy
version and is published as rollouts like any other, under the same staleness bound and ledger
accounting. An agent's posted reward is the last model turn's reward (the episode's metric
`reward`, which the built-in reward `environment` returns); without one, the job's reward scores
the final answer.

An episode's history is append-only: each call must repeat the conversation so far (as the
`openai` client does) and add to it; a call that edits what was recorded is refused (409), since
the tokens already sampled would no longer be what the model saw. Sampling is the job's
(temperature, top_p, top_k, seed): the behaviour policy the trainer corrects for must be the one
that sampled; an agent's `max_tokens` caps a turn below the job's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from broker.streams import JobStreams
from shared.entry import JobEnded
from shared.environments.episode import Codec, Episode, Generate, TemplateDeltaError, codec_for
from shared.environments.spec import EpisodeLimits
from shared.environments.tools import CLOSE, OPEN, ToolCallError, parse_tool_call
from shared.prompts import ChatMode
from shared.schema import AgentCall, AgentReply, AgentTask, DecodeError, PromptGroup, clean_text, decode, encode

log = logging.getLogger(__name__)

ROUTE_TTL_S = 60  # an episode's route outlives its generator by at most this
REPLY_TTL_S = 600  # an answer no one fetched is dropped after this
TASKS_TTL_S = 24 * 3600
MAX_CALLS_PER_READ = 64


# --- the Redis side ---------------------------------------------------------------------------------


def agent_key(streams: JobStreams, name: str) -> str:
    """`{prefix}{{job}}:agent:<name>`: in the job's hash slot, like its streams."""
    return streams.key(f"agent:{name}")


@dataclass
class AgentDesk:
    """The generator's end of the Redis lists (module docstring), with the sync client of the job's streams."""

    streams: JobStreams
    generator_id: str

    def _key(self, name: str) -> str:
        return agent_key(self.streams, name)

    def offer(self, task: AgentTask) -> None:
        self.streams.r.set(self._key(f"route:{task.msg_id}"), self.generator_id, ex=ROUTE_TTL_S)
        self.streams.r.rpush(self._key("tasks"), encode(task))
        self.streams.r.expire(self._key("tasks"), TASKS_TTL_S)

    def refresh(self, episode_ids: Sequence[str]) -> None:
        for e in episode_ids:
            self.streams.r.expire(self._key(f"route:{e}"), ROUTE_TTL_S)

    def retire(self, episode_id: str) -> None:
        self.streams.r.delete(self._key(f"route:{episode_id}"))

    def calls(self, timeout_s: float) -> list[AgentCall]:
        """The calls waiting for this generator (up to MAX_CALLS_PER_READ), waiting up to `timeout_s` for one."""
        key = self._key(f"calls:{self.generator_id}")
        first = self.streams.r.blpop([key], timeout=timeout_s)
        if first is None:
            return []
        raws = [first[1], *(self.streams.r.lpop(key, MAX_CALLS_PER_READ - 1) or [])]
        out = []
        for raw in raws:
            try:
                out.append(decode(raw, AgentCall, max_bytes=self.streams.max_message_bytes))
            except DecodeError as exc:  # only the API writes here; a bad entry is dropped, said once
                log.warning("an agent call that does not decode was dropped: %s", exc.reason)
        return out

    def reply(self, call: AgentCall, status: int, body: Mapping[str, Any]) -> None:
        key = self._key(f"reply:{call.msg_id}")
        msg = AgentReply(job_id=call.job_id, msg_id=call.msg_id, status=status, body=json.dumps(body))
        self.streams.r.rpush(key, encode(msg))
        self.streams.r.expire(key, REPLY_TTL_S)


# --- the OpenAI requests ----------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # agents send many fields; the job's sampling rules

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | int | None = None
    stream: bool = False
    n: int = 1

    def turn_cap(self) -> int | None:
        caps = [c for c in (self.max_tokens, self.max_completion_tokens) if c is not None]
        return min(caps) if caps else None


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_Request):
    prompt: str | list[str]


class AgentError(Exception):
    """A call this episode refuses: the HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "code": self.status}}


def content_text(message: Mapping[str, Any]) -> str:
    """A message's text: its string content, or its text parts joined (an image part is refused)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise AgentError(400, "only text content parts are supported (the model is text-only)")
            texts.append(part["text"])
        return "".join(texts)
    raise AgentError(400, f"message content must be a string or a list of text parts, not {type(content).__name__}")


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A model turn as OpenAI's assistant message: its text before the first <tool_call>, and each
    well-formed call as a `tool_calls` entry (one that does not parse stays in the content)."""
    head, calls, rest = text.split(OPEN, 1)[0], [], text
    while OPEN in rest:
        block = rest[rest.index(OPEN) :]
        try:
            call = parse_tool_call(block)
        except ToolCallError:
            return (text.strip() or None), []
        assert call is not None
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
        )
        rest = block[block.index(CLOSE) + len(CLOSE) :] if CLOSE in block else ""
    if not calls:
        return (text or None), []
    return (head.strip() or None), calls


def _same(seen: Mapping[str, Any], sent: Mapping[str, Any]) -> bool:
    """The agent repeated a recorded message: same role and text (an assistant turn's text as we
    returned it; its tool_calls and the content the client leaves None are not compared)."""
    if seen.get("role") != sent.get("role"):
        return False
    if seen["role"] == "assistant":
        return (seen.get("content") or "").strip() == content_text(sent).strip()
    return bool(seen.get("content") == content_text(sent))


# --- one episode ------------------------------------------------------------------------------------


@dataclass
class AgentEpisode:
    """One episode's state in the generator: the Episode (ids, mask, logprobs, turns) and, beside
    it, the conversation as the agent sees it (`seen`: what each call must repeat)."""

    episode_id: str
    task: AgentTask
    episode: Episode | None = None
    codec: Codec | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""  # /v1/completions: the episode's text so far (prompt and completions)
    api: Literal["chat", "completion"] | None = None
    limit: str | None = None  # the limit that ended the episode's turns ("max_turns", "max_tokens")
    opened: bool = False


def _completion_body(
    kind: Literal["chat", "completion"],
    call: AgentCall,
    ae: AgentEpisode,
    ids: Sequence[int],
    logprobs: Sequence[float],
    text: str,
    finish: str | None,
    context: Sequence[int],
    version: int,
    tokens: Callable[[Sequence[int]], list[str]],
    want_logprobs: bool,
    started: float,
) -> dict[str, Any]:
    lp: dict[str, Any] | None = (
        {
            "content": [
                {"token": t, "logprob": float(x), "bytes": None, "top_logprobs": []}
                for t, x in zip(tokens(ids), logprobs, strict=True)
            ]
        }
        if want_logprobs
        else None
    )
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish or "stop", "logprobs": lp, "token_ids": list(ids)}
    if kind == "chat":
        content, calls = split_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            if finish == "stop":
                choice["finish_reason"] = "tool_calls"
        choice["message"] = message
        obj = "chat.completion"
    else:
        choice["text"] = text
        obj = "text_completion"
    return {
        "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{call.msg_id}",
        "object": obj,
        "created": int(time.time()),
        "model": call.job_id,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(context),
            "completion_tokens": len(ids),
            "total_tokens": len(context) + len(ids),
        },
        # beyond OpenAI's: what the trainer will train on, and where it came from
        "prompt_token_ids": list(context),
        "policy_version": version,
        "episode_id": ae.episode_id,
        "generator_ms": (time.perf_counter() - started) * 1000,  # from the reader's receipt
    }


class AgentPlayer:
    """Plays the episodes of one batch against the job's agents (episodes.Player).

    Args:
        desk: the Redis lists.
        tokenizer: the job model's tokenizer.
        chat_mode: the job's chat_template ("off": plain text, shared.environments.episode.PlainCodec).
        chat_kwargs: the job's chat_template_kwargs (the agent's `tools` are added per episode).
        limits: the job's environment limits: `max_turns`, `max_total_tokens`, and `step_timeout_s`,
            how long an agent may take between the calls of an episode it took.
        version: the policy version being sampled (the batch's).
        ended: whether the job ended (stopped, cancelled, drained): checked every second while the
            batch plays, so a batch whose episodes no agent takes never holds the generator.
    """

    def __init__(
        self,
        desk: AgentDesk,
        tokenizer: Any,
        chat_mode: ChatMode,
        chat_kwargs: Mapping[str, Any],
        limits: EpisodeLimits,
        version: Callable[[], int],
        ended: Callable[[], bool] = lambda: False,
    ) -> None:
        self.desk, self.tokenizer, self.limits, self.version = desk, tokenizer, limits, version
        self.chat_mode, self.ended = chat_mode, ended
        self._job_ended = False
        self.chat_kwargs = dict(chat_kwargs)
        self._codecs: dict[str, Codec] = {}
        self._inbox: dict[str, asyncio.Queue[AgentCall | None]] = {}  # None: the job ended
        self._received: dict[str, float] = {}  # call id -> when the reader took it (generator_ms)
        self._pool: ThreadPoolExecutor | None = None
        self.calls = 0

    # -- the batch's background: reading calls, keeping routes ------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="agent-redis")
        reader = asyncio.create_task(self._read())
        try:
            yield
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def _redis(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _read(self) -> None:
        last_refresh = time.monotonic()
        while True:
            try:
                calls = await self._redis(self.desk.calls, 1.0)
                now = time.perf_counter()
                for c in calls:
                    self._received[c.msg_id] = now
                    box = self._inbox.get(c.episode_id)
                    if box is None:
                        await self._redis(
                            self.desk.reply, c, 404, AgentError(404, f"episode {c.episode_id} has ended").body()
                        )
                    else:
                        box.put_nowait(c)
                if time.monotonic() - last_refresh > ROUTE_TTL_S / 3:
                    await self._redis(self.desk.refresh, list(self._inbox))
                    last_refresh = time.monotonic()
                if not self._job_ended and await self._redis(self.ended):
                    self._job_ended = True
                    for box in self._inbox.values():
                        box.put_nowait(None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the client rides it out; calls wait in their list
                log.warning("reading agent calls failed: %s", exc)
                await asyncio.sleep(1.0)

    # -- one episode ------------------------------------------------------------------------------

    async def play(self, group: PromptGroup, index: int, generate: Generate) -> Episode:
        """Offer the episode, then answer its calls until the agent ends it (or goes quiet). An
        episode the agent left before any model turn is offered again, so the group stays whole."""
        while True:
            episode_id = uuid.uuid4().hex
            ae = AgentEpisode(
                episode_id,
                AgentTask(
                    job_id=group.job_id,
                    msg_id=episode_id,
                    group_id=group.group_id,
                    policy_version=self.version(),
                    generator_id=self.desk.generator_id,
                    purpose=group.purpose,
                    eval_set=group.eval_set,
                    prompt_index=group.prompt_index,
                    prompt=group.prompt,
                    answer=group.answer,
                    metadata=dict(group.metadata),
                ),
            )
            if self._job_ended:
                raise JobEnded("the job ended while its agent episodes were being played")
            self._inbox[ae.episode_id] = asyncio.Queue()
            try:
                await self._redis(self.desk.offer, ae.task)
                ep = await self._serve(ae, generate)
            finally:
                del self._inbox[ae.episode_id]
                with contextlib.suppress(Exception):
                    await self._redis(self.desk.retire, ae.episode_id)
            if ep.ids:
                return ep
            log.warning(
                "agent episode %s of group %s ended with no model turn: offered again", ae.episode_id, group.group_id
            )

    async def _serve(self, ae: AgentEpisode, generate: Generate) -> Episode:
        box = self._inbox[ae.episode_id]
        while True:
            try:
                # untaken: wait as long as it takes; taken: the agent has step_timeout_s per call
                call = await asyncio.wait_for(box.get(), self.limits.step_timeout_s if ae.opened else None)
            except TimeoutError:
                ep = ae.episode or Episode([])
                return ep.end("agent_timeout")
            if call is None or self._job_ended:
                raise JobEnded("the job ended while its agent episodes were being played")
            if call.op == "open":
                ae.opened = True
                continue
            started = self._received.pop(call.msg_id, time.perf_counter())
            try:
                if call.op == "end":
                    ep = self._end(ae, call)
                    await self._redis(
                        self.desk.reply,
                        call,
                        200,
                        {
                            "episode_id": ae.episode_id,
                            "turns": ep.num_turns,
                            "tokens": ep.total_tokens,
                            "stop_reason": ep.stop_reason,
                        },
                    )
                    return ep
                body = await self._turn(ae, call, generate, started)
                status = 200
            except AgentError as exc:
                status, body = exc.status, exc.body()
            except Exception as exc:  # the engine's failure is the batch's: answer, then let it propagate
                await self._redis(self.desk.reply, call, 500, AgentError(500, f"generation failed: {exc}").body())
                raise
            self.calls += 1
            await self._redis(self.desk.reply, call, status, body)

    def _end(self, ae: AgentEpisode, call: AgentCall) -> Episode:
        try:
            body = json.loads(call.body or "{}")
            reward = body.get("reward")
            details = body.get("details") or {}
            if reward is not None and not isinstance(reward, int | float):
                raise ValueError(f"reward must be a number or null, not {type(reward).__name__}")
            if not isinstance(details, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int | float) for k, v in details.items()
            ):
                raise ValueError("details must be an object of numbers")
        except (ValueError, AttributeError) as exc:
            raise AgentError(400, f"end: {exc}") from None
        ep = ae.episode or Episode([])
        if ep.num_turns:
            ep.score_last_turn(None if reward is None else float(reward), dict(details))
        return ep.end(ae.limit or "done")

    def _codec(self, tools: list[dict[str, Any]] | None) -> Codec:
        """The episode's codec: the chat template (with the agent's `tools`), or plain text where
        the model has none or the job's chat_template is "off" (as the job's environments render)."""
        key = json.dumps(tools, sort_keys=True) if tools else ""
        codec = self._codecs.get(key)
        if codec is None:
            kw = {**self.chat_kwargs, **({"tools": tools} if tools else {})}
            try:
                codec = self._codecs[key] = codec_for(self.tokenizer, self.chat_mode, kw)
            except TemplateDeltaError as exc:
                raise AgentError(400, f"the model's chat template cannot run a multi-turn episode: {exc}") from None
        return codec

    async def _turn(self, ae: AgentEpisode, call: AgentCall, generate: Generate, started: float) -> dict[str, Any]:
        kind: Literal["chat", "completion"] = "chat" if call.op == "chat" else "completion"
        try:
            req: _Request = (ChatRequest if kind == "chat" else CompletionRequest).model_validate_json(call.body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise AgentError(400, f"invalid request: {where}: {first.get('msg')}") from None
        if req.stream:
            raise AgentError(400, "stream=true is not supported: the endpoint answers whole turns")
        if req.n != 1:
            raise AgentError(400, "n must be 1: an episode is one conversation (the job's group_size sets the samples)")
        if ae.api not in (None, kind):
            raise AgentError(400, f"this episode uses /v1/{'chat/completions' if ae.api == 'chat' else 'completions'}")
        ae.api = kind
        if ae.limit is not None:
            raise AgentError(400, f"the episode reached its {ae.limit} limit; end it (POST .../end)", "episode_limit")
        if kind == "chat":
            assert isinstance(req, ChatRequest)
            self._append_chat(ae, req)
        else:
            assert isinstance(req, CompletionRequest)
            self._append_text(ae, req)
        ep = ae.episode
        assert ep is not None
        if ep.num_turns >= self.limits.max_turns:
            ae.limit = "max_turns"
        room = self.limits.max_total_tokens - ep.total_tokens
        if room <= 0:
            ae.limit = "max_tokens"
        if ae.limit is not None:
            raise AgentError(400, f"the episode reached its {ae.limit} limit; end it (POST .../end)", "episode_limit")
        cap = req.turn_cap()
        context = ep.prompt_ids + ep.ids
        ids, logprobs, finish = await generate(context, min(room, cap) if cap else room)
        ids, logprobs = list(ids)[:room], list(logprobs)[:room]
        text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        ep.append_model(ids, logprobs, text, finish)
        if kind == "chat":
            content, calls = split_tool_calls(text)
            ae.seen.append({"role": "assistant", "content": content or ""})
        else:
            ae.text += text
        if ep.total_tokens >= self.limits.max_total_tokens:
            ae.limit = "max_tokens"
        return _completion_body(
            kind,
            call,
            ae,
            ids,
            logprobs,
            text,
            finish,
            context,
            self.version(),
            lambda xs: [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(xs))],
            bool(req.logprobs),
            started,
        )

    def _append_chat(self, ae: AgentEpisode, req: ChatRequest) -> None:
        """The opening (first call) or the messages added since the last call, rendered once."""
        sent = req.messages
        if ae.episode is None:
            codec = ae.codec = self._codec(req.tools)
            opening = [{"role": m.get("role"), "content": content_text(m)} for m in sent]
            if any(not isinstance(m["role"], str) for m in opening):
                raise AgentError(400, "every message needs a string role")
            try:
                ae.episode = Episode(codec.prompt_ids(opening))
            except Exception as exc:
                raise AgentError(400, f"the messages cannot be rendered by the model's chat template: {exc}") from None
            ae.episode.messages = list(opening)
            ae.seen = [dict(m) for m in opening]
            if ae.episode.total_tokens >= self.limits.max_total_tokens:
                ae.limit = "max_tokens"
            return
        n = len(ae.seen)
        if len(sent) <= n or not all(_same(a, b) for a, b in zip(ae.seen, sent, strict=False)):
            raise AgentError(
                409,
                f"the messages must repeat this episode's conversation ({n} messages) and add to it: an episode's "
                "history is append-only, the tokens already sampled being what the model saw (start a new "
                "episode for an edited history)",
                "conflict",
            )
        new = [{"role": m.get("role"), "content": content_text(m)} for m in sent[n:]]
        if any(m["role"] not in ("user", "tool", "system") for m in new):
            raise AgentError(400, "the messages added after the model's turn must be user, tool or system messages")
        assert ae.codec is not None
        ep = ae.episode
        last = ep.turns[-1]
        try:
            messages, ids = ae.codec.replies(ep.messages, ep.ids[last.start : last.end], new)
        except Exception as exc:
            raise AgentError(400, f"the new messages cannot be rendered as a continuation: {exc}") from None
        if ep.total_tokens + len(ids) > self.limits.max_total_tokens:
            ae.limit = "max_tokens"
            raise AgentError(400, "the new messages would pass the episode's max_total_tokens; end it", "episode_limit")
        ep.append_env(ids, "\n".join(str(m["content"]) for m in new), messages[0])
        ep.messages.extend(messages[1:])
        ae.seen.extend(new)

    def _append_text(self, ae: AgentEpisode, req: CompletionRequest) -> None:
        prompt = req.prompt if isinstance(req.prompt, str) else "".join(req.prompt) if len(req.prompt) == 1 else None
        if prompt is None:
            raise AgentError(400, "prompt must be one string")
        prompt = clean_text(prompt)
        if ae.episode is None:
            ae.episode = Episode(list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"]))
            ae.text = prompt
            return
        if not prompt.startswith(ae.text) or len(prompt) == len(ae.text):
            raise AgentError(
                409,
                "the prompt must extend this episode's text so far (its prompt and completions) with new text: "
                "an episode's history is append-only",
                "conflict",
            )
        suffix = prompt[len(ae.text) :]
        ids = list(self.tokenizer(suffix, add_special_tokens=False)["input_ids"])
        ep = ae.episode
        if ep.total_tokens + len(ids) > self.limits.max_total_tokens:
            ae.limit = "max_tokens"
            raise AgentError(400, "the new text would pass the episode's max_total_tokens; end it", "episode_limit")
        ep.append_env(ids, suffix, {"role": "user", "content": suffix})
        ae.text = prompt
