"""The OpenAI-compatible endpoint of a job whose episodes an agent program plays (environment "agent").

    POST /jobs/{id}/episodes                                 take an episode: its task and base URL
    POST /jobs/{id}/episodes/{episode}/v1/chat/completions   a model turn (OpenAI's request and answer)
    POST /jobs/{id}/episodes/{episode}/v1/completions        the same on plain text
    GET  /jobs/{id}/episodes/{episode}/v1/models             the job's model, by the job's id
    POST /jobs/{id}/episodes/{episode}/end                   end it: {"reward": r | null, "details": {...}}

An agent points the `openai` client at the episode's `base_url` with its API token as the key
and runs its own loop. The API is only the front: each call goes over Redis to the generator that
offered the episode, which renders, generates and records it (generator_svc/agents.py says how,
ARCHITECTURE.md why here). Errors of the OpenAI routes have OpenAI's shape ({"error": {...}}).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Body, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse

from broker.api.deps import ContextDep, LedgerDep
from broker.api.errors import error_responses
from broker.api.models import (
    AgentCompletion,
    AgentEpisodeEnd,
    AgentEpisodeView,
    AgentModel,
    AgentModels,
    OpenAIErrorBody,
)
from broker.streams.keys import JobKeys
from shared.schema import AgentCall, AgentReply, AgentTask, DecodeError, decode, encode

router = APIRouter(tags=["agents"])

_OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": OpenAIErrorBody, "description": why}
    for code, why in {
        400: "A request the episode cannot serve (the message says why), or a limit it reached.",
        404: "No such episode (unknown, ended, or its generator is gone).",
        409: "The messages do not repeat the episode's conversation: its history is append-only.",
        413: "Request too large.",
        504: "The episode's generator did not answer in BROKER_AGENT_REPLY_TIMEOUT_S.",
    }.items()
}
OPENAI_ROUTE = {200: {"model": AgentCompletion}, **_OPENAI_ERRORS, **error_responses(422)}

MAX_TAKE_WAIT_S = 60.0


def _key(ctx: ContextDep, job_id: str, name: str) -> str:
    return JobKeys(ctx.settings.stream_prefix, job_id).key(f"agent:{name}")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _agent_job(ledger: LedgerDep, job_id: str) -> None:
    job = ledger.get_job(job_id)
    if job is None:
        raise HTTPException(404, f"job {job_id} not found")
    env = (job["spec"] or {}).get("environment") or {}
    if env.get("name") != "agent":
        raise HTTPException(
            409, f"job {job_id} does not run agent episodes: its spec needs environment {{'name': 'agent'}}"
        )


@router.post("/jobs/{job_id}/episodes", response_model=AgentEpisodeView, responses=error_responses(404, 409, 422))
async def take_episode(
    job_id: str,
    request: Request,
    ctx: ContextDep,
    ledger: LedgerDep,
    wait_s: Annotated[float, Query(ge=0.0, le=MAX_TAKE_WAIT_S)] = 20.0,
) -> Any:
    """Take one episode of the job to play: the dataset row's `prompt`, `answer` and `metadata`,
    `purpose` (train or eval), and the `base_url` to give the `openai` client. Waits up to `wait_s`
    for a generator to offer one (`episode_id` null if none did: ask again)."""
    await asyncio.to_thread(_agent_job, ledger, job_id)
    r = ctx.agent_redis()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        left = deadline - loop.time()
        got = await r.blpop([_key(ctx, job_id, "tasks")], timeout=max(left, 0.01)) if left > 0 else None
        if got is None:
            return AgentEpisodeView()
        try:
            task = decode(got[1], AgentTask)
        except DecodeError:
            continue
        # a task whose generator is gone (its route expired) is no longer playable: the next one
        if await r.get(_key(ctx, job_id, f"route:{task.msg_id}")) is None:
            continue
        await _send(ctx, job_id, task.generator_id, task.msg_id, "open", "")
        base = str(request.base_url).rstrip("/")
        return AgentEpisodeView(
            **{
                "episode_id": task.msg_id,
                "base_url": f"{base}/jobs/{job_id}/episodes/{task.msg_id}/v1",
                "model": job_id,
                "purpose": task.purpose,
                "eval_set": task.eval_set,
                "prompt_index": task.prompt_index,
                "prompt": task.prompt,
                "answer": task.answer,
                "metadata": task.metadata,
                "policy_version": task.policy_version,
            }
        )


async def _send(ctx: ContextDep, job_id: str, generator_id: str, episode_id: str, op: str, body: str) -> str:
    call = AgentCall(job_id=job_id, msg_id=uuid.uuid4().hex, episode_id=episode_id, op=op, body=body)
    await ctx.agent_redis().rpush(_key(ctx, job_id, f"calls:{generator_id}"), encode(call))
    return call.msg_id


async def _call(ctx: ContextDep, job_id: str, episode_id: str, op: str, body: bytes) -> Response:
    """Forward one call to the episode's generator and return its answer."""
    r = ctx.agent_redis()
    generator = await r.get(_key(ctx, job_id, f"route:{episode_id}"))
    if generator is None:
        return _error(404, f"episode {episode_id} of job {job_id} is unknown, ended, or its generator is gone")
    if len(body) > ctx.settings.max_body_bytes:
        return _error(413, "request too large")
    try:
        text = body.decode("utf-8")
        json.loads(text or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return _error(400, f"the body is not JSON: {exc}")
    call_id = await _send(ctx, job_id, generator.decode(), episode_id, op, text)
    timeout = ctx.settings.agent_reply_timeout_s
    got = await r.blpop([_key(ctx, job_id, f"reply:{call_id}")], timeout=timeout)
    if got is None:
        return _error(
            504,
            f"the episode's generator did not answer in {timeout:.0f} s (BROKER_AGENT_REPLY_TIMEOUT_S); if it "
            "restarted, the episode is lost: take a new one",
            "timeout",
        )
    reply = decode(got[1], AgentReply)
    return Response(reply.body, status_code=reply.status, media_type="application/json")  # the generator's JSON


@router.post("/jobs/{job_id}/episodes/{episode_id}/v1/chat/completions", responses=OPENAI_ROUTE)
async def chat_completions(job_id: str, episode_id: str, request: Request, ctx: ContextDep) -> Response:
    """OpenAI's chat completions for one turn of the episode; the answer adds `prompt_token_ids`,
    each choice's `token_ids` and the `policy_version` it was sampled at."""
    return await _call(ctx, job_id, episode_id, "chat", await request.body())


@router.post("/jobs/{job_id}/episodes/{episode_id}/v1/completions", responses=OPENAI_ROUTE)
async def completions(job_id: str, episode_id: str, request: Request, ctx: ContextDep) -> Response:
    """OpenAI's (legacy) completions on plain text: each call's prompt extends the episode's text."""
    return await _call(ctx, job_id, episode_id, "completion", await request.body())


@router.get(
    "/jobs/{job_id}/episodes/{episode_id}/v1/models",
    response_model=AgentModels,
    responses=error_responses(404, 409, 422),
)
async def models(job_id: str, episode_id: str, ledger: LedgerDep) -> AgentModels:
    """The one model an episode samples from: the job's policy, named by the job's id."""
    await asyncio.to_thread(_agent_job, ledger, job_id)
    return AgentModels(data=[AgentModel(id=job_id)])


@router.post(
    "/jobs/{job_id}/episodes/{episode_id}/end",
    responses={200: {"model": AgentEpisodeEnd}, **_OPENAI_ERRORS, **error_responses(422)},
)
async def end_episode(
    job_id: str,
    episode_id: str,
    ctx: ContextDep,
    body: Annotated[dict[str, Any] | None, Body()] = None,
) -> Response:
    """End the episode: `reward` (a number: the episode's reward, read by the job's reward
    `environment`; null: the job's reward scores the final answer) and `details` (numbers, logged
    with the episode). The episode is trained on once its group's episodes have all ended."""
    return await _call(ctx, job_id, episode_id, "end", json.dumps(body or {}).encode())
