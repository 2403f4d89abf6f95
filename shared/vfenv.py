"""verifiers environments by module name: the rows of a `verifiers` task, the environment that plays
its multi-turn episodes, and the reward that scores it with the environment's own rubric.

verifiers 0.4 (an optional extra: ``pip install 'asyncrl[verifiers]'``; its stack is
``verifiers.v1``) packages an environment as an installed module exporting a ``vf.Taskset``: the
taskset loads ``vf.Task`` objects, each a row (``TaskData``: prompt, system prompt, the task's own
fields) with the rubric as methods (``@vf.reward(weight=...)``, each its own weighted term;
``@vf.metric``), optionally tools (``Task.toolsets``: ``vf.Toolset`` classes whose ``@vf.tool``
methods the model may call) and ``@vf.stop`` predicates. A job names the module::

    "task": {"name": "verifiers", "env": "vf_reverse_text", "args": {"num_tasks": 500}, "n_test": 50}

``args`` is the taskset's config (its ``TasksetConfig`` fields); ``eval_args``, when given, is the
config of the held-out taskset (e.g. ``{"split": "test"}``), else ``n_test`` tasks are held out of
the training ones by the usual seeded split. Each task becomes a row: ``messages`` (its system
prompt and prompt) and the ``verifiers`` column (env, args and the task's data as JSON), which
reaches the generator and the reward service as the problem's metadata; a task is rebuilt there as
verifiers' own env server rebuilds one, ``TaskCls(DataCls.model_validate(data), config.task)``.

Single-turn (no tools): an ordinary job. The built-in reward ``verifiers`` rebuilds the task and a
``vf.Trace`` of the conversation (the opening and the completion as the assistant's reply) and
calls the task's own ``score(trace)``: each reward function's score is a named reward component
(``reward/<name>`` in the trainer's metrics, the ledger's details), the reward their weighted sum.

Multi-turn (the task has tools): the environment ``verifiers`` (``VerifiersEnv``, the job's
``environment`` unless another is given) plays each episode through shared.environments, so the
trainer trains on exactly the generated ids. Its tools are the task's toolsets run in-process:
each registered on an MCP server object (``mcp``'s ``MCPServer``, as verifiers registers them) and
called through it, so the names (``<server>_<tool>``), schemas and argument checks are verifiers'
and MCP's own, without a server process. Calls use the Hermes ``<tool_call>`` format of the
``tools`` environment. ``@vf.stop`` predicates on the trace are checked after each reply. When the
episode ends the environment scores its trace with the task's ``score`` and hands the scores on
as the episode's metrics (``rubric/<name>``, ``rubric_reward``); the ``verifiers`` reward reads
them. Not run: verifiers' harnesses and sandboxes (the model is this project's engine), tasks that
need a container or a runtime to score, toolsets with their own ``State`` (kept in verifiers'
rollout server), multi-agent ``Env`` subclasses, and ``Request``/``Response`` stops: each is
refused at submission, naming it.

The package is imported only when a job names it (about 3 s); the API, the trainer, the generator
and the reward service then need it and the environment's module installed (or on PYTHONPATH).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.rewards.base import RewardResult
from shared.tasks import Problem

if TYPE_CHECKING:  # shared.environments imports this module (its registry): imported where used
    from shared.environments.base import Message, ModelTurn, Row, StepResult

__all__ = [
    "COLUMN",
    "INSTALL_HINT",
    "TOTAL",
    "VerifiersEnv",
    "VerifiersError",
    "check",
    "is_multi_turn",
    "rubric_result",
    "score_sample",
    "task_rows",
]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'asyncrl[verifiers]'"
COLUMN = "verifiers"
"""The row column (then the problem's metadata key) holding {env, args, task} for the reward."""
SCORE_PREFIX = "rubric/"
"""Episode metric of one reward function's score (``rubric/<name>``)."""
TOTAL = "rubric_reward"
"""Episode metric of the rubric's weighted sum."""
FAILED = "rubric_failed"
"""Episode metric set when the rubric raised in the generator (the log has the traceback)."""
# An episode carries at most 16 metrics (shared.environments.episode.MAX_METRICS): the turns'
# info keys (tool_call, tool_ok), the total, and one per reward function.
MAX_REWARDS = 13
MAX_NAME = 64 - len(SCORE_PREFIX)


class VerifiersError(ValueError):
    """A verifiers task cannot be built or scored; the message says what to change."""


def _vf() -> Any:
    """verifiers' stack, ``verifiers.v1``.

    Raises:
        VerifiersError: verifiers is not installed (the message says how to install it).
    """
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise VerifiersError(
            f"task.name='verifiers' needs the verifiers package, which is not installed here ({exc}): {INSTALL_HINT}"
        ) from None
    return vf


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def args_key(args: Mapping[str, Any]) -> str:
    return json.dumps(dict(args), sort_keys=True)


@functools.lru_cache(maxsize=32)
def _taskset(env: str, args_json: str) -> Any:
    """The environment's taskset with `args` as its config (one object per process and config;
    loading it reads no data: its tasks are read when it is iterated).

    Raises:
        VerifiersError: not installed, no such module, no Taskset exported, or a config it refuses.
    """
    vf = _vf()
    from pydantic import ValidationError

    args = json.loads(args_json)
    if "id" in args:
        raise VerifiersError("task.args may not set id: task.env names the environment")
    try:
        config_cls = vf.taskset_config_type(env)
    except ModuleNotFoundError as exc:
        raise VerifiersError(
            f"no verifiers environment {env!r} is installed here ({exc}); install its package where the "
            "services run (pip install ...), or put it on PYTHONPATH"
        ) from None
    except (TypeError, AttributeError, ValueError) as exc:
        raise VerifiersError(f"module {env!r} is not a verifiers environment: {exc}") from None
    except Exception as exc:  # the module itself fails to import
        raise VerifiersError(f"importing verifiers environment {env!r} failed: {_why(exc)}") from None
    try:
        config = config_cls.model_validate({**args, "id": env})
    except ValidationError as exc:
        fields = ", ".join(f for f in config_cls.model_fields if f != "id")
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(args)'}: {e['msg']}" for e in exc.errors()[:5])
        raise VerifiersError(
            f"verifiers environment {env!r} refuses task.args {args}: {problems} (its config fields: {fields})"
        ) from None
    try:
        return vf.load_taskset(config)
    except Exception as exc:
        raise VerifiersError(f"verifiers environment {env!r} failed to build its taskset: {_why(exc)}") from None


def taskset(env: str, args: Mapping[str, Any]) -> Any:
    return _taskset(env, args_key(args))


def rebuild(info: Mapping[str, Any]) -> tuple[Any, Any]:
    """(task, taskset) of the task a row's ``verifiers`` column describes, rebuilt as verifiers' env server rebuilds a
    dispatched task: its data validated into the taskset's TaskData type, with the config's task
    subtree.

    Raises:
        VerifiersError: the column is missing or malformed, or the environment cannot be loaded.
    """
    if not isinstance(info, Mapping) or not isinstance(info.get("env"), str) or not isinstance(info.get("task"), dict):
        raise VerifiersError(
            f"the verifiers reward and environment need the problem's metadata[{COLUMN!r}] (env, args, task), "
            "which a task with name 'verifiers' gives; this problem has none"
        )
    ts = taskset(info["env"], info.get("args") or {})
    task_cls = type(ts).task_type()
    try:
        data = task_cls.data_type().model_validate(info["task"])
    except Exception as exc:
        raise VerifiersError(
            f"verifiers environment {info['env']!r}: the task's data does not validate: {exc}"
        ) from None
    return task_cls(data, ts.config.task), ts


# --- the opening --------------------------------------------------------------------------------


def opening_messages(data: Any) -> list[Any]:
    """The task's opening as verifiers messages: its system prompt, then its prompt (a string is
    one user turn).

    Raises:
        VerifiersError: the task has no prompt (the user opens: a user simulator this adapter
            does not run) or its prompt holds a tool message.
    """
    vf = _vf()
    out: list[Any] = []
    if data.system_prompt:
        out.append(vf.SystemMessage(content=data.system_prompt))
    if data.prompt is None:
        raise VerifiersError(
            f"verifiers task {data.idx} has no prompt (its user opens the conversation, a simulated user this "
            "project does not run)"
        )
    if isinstance(data.prompt, str):
        out.append(vf.UserMessage(content=data.prompt))
    else:
        for m in data.prompt:
            if m.role == "tool":
                raise VerifiersError(f"verifiers task {data.idx}: its prompt holds a tool message")
            out.append(m)
    return out


def as_chat(messages: Iterable[Any]) -> list[Message]:
    """verifiers messages as {"role", "content"} dicts (content as text: images are dropped)."""
    from verifiers.v1.types import content_text

    return [{"role": m.role, "content": content_text(m.content) or ""} for m in messages]


# --- checks -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What a verifiers task is, as far as this project runs it."""

    multi_turn: bool  # it has tools
    rewards: tuple[tuple[str, float], ...]  # (name, weight) of each reward function


def _runtime_needed(fn: Any) -> bool:
    import inspect

    p = inspect.signature(fn).parameters.get("runtime")
    return p is not None and p.default is inspect.Parameter.empty


def _toolsets(task: Any, ts: Any) -> list[Any]:
    return [*type(task).toolsets(task.config), *type(ts).toolsets(ts.config)]


def check(env: str, args: Mapping[str, Any]) -> Shape:
    """What the API checks for a `verifiers` task: the environment loads with `args`, is a plain
    single-agent taskset, its first task has a prompt and a rubric this project can score, and
    nothing it needs is refused (module docstring). Remembered per process for a valid (env, args).

    Raises:
        VerifiersError: saying which of those fails.
    """
    return _check(env, args_key(args))


@functools.lru_cache(maxsize=64)
def _check(env: str, args_json: str) -> Shape:
    vf = _vf()
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.state import State, state_cls

    ts = _taskset(env, args_json)
    env_cls = vf.environment_class(env)
    if not issubclass(env_cls, vf.SingleAgentEnv):
        raise VerifiersError(
            f"verifiers environment {env!r} exports {env_cls.__name__}, a multi-agent Env; only single-agent "
            "tasksets run here (one policy, its own tools)"
        )
    try:
        task = next(iter(ts))
    except StopIteration:
        raise VerifiersError(
            f"verifiers environment {env!r} with task.args {json.loads(args_json)} has no tasks"
        ) from None
    except Exception as exc:
        raise VerifiersError(f"verifiers environment {env!r} failed to load its first task: {_why(exc)}") from None
    opening_messages(task.data)
    name = type(task).__name__
    if type(task).NEEDS_CONTAINER:
        raise VerifiersError(
            f"verifiers task {name} needs a container (NEEDS_CONTAINER), which this project does not run"
        )
    rewards = task.hooks("reward")
    if not rewards and not task.config.judges:
        raise VerifiersError(f"verifiers task {name} has no @vf.reward: nothing would score its rollouts")
    for fn in [*rewards, *task.hooks("metric")]:
        if _runtime_needed(fn):
            raise VerifiersError(
                f"verifiers task {name}: {fn.__name__} scores with a runtime (a sandbox box), which this project "
                "does not run"
            )
    names = [fn.__name__ for fn in rewards]
    if len(names) > MAX_REWARDS or any(len(n) > MAX_NAME for n in names):
        raise VerifiersError(
            f"verifiers task {name} has reward functions {names}: at most {MAX_REWARDS}, names at most {MAX_NAME} "
            "characters (each is an episode metric)"
        )
    for fn in task.hooks("stop"):
        try:
            boundary = hook_boundary(fn, allow_trace=True)
        except TypeError as exc:
            raise VerifiersError(f"verifiers task {name}: {exc}") from None
        if boundary is not vf.Trace:
            raise VerifiersError(
                f"verifiers task {name}: @vf.stop {fn.__name__} reads a {boundary.__name__}; only stops on the "
                "trace run here"
            )
    toolsets = _toolsets(task, ts)
    for t in toolsets:
        if state_cls(type(t)) is not State:
            raise VerifiersError(
                f"verifiers toolset {type(t).__name__} keeps a State of its own ({state_cls(type(t)).__name__}), "
                "which lives in verifiers' rollout server; toolsets without one run here"
            )
    return Shape(bool(toolsets), tuple((fn.__name__, float(getattr(fn, "_vf_weight", 1.0))) for fn in rewards))


def is_multi_turn(env: str, args: Mapping[str, Any]) -> bool:
    """Whether the environment's tasks have tools (their episodes then need the `verifiers`
    environment)."""
    return check(env, args).multi_turn


# --- rows ---------------------------------------------------------------------------------------


def task_rows(env: str, args: Mapping[str, Any], limit: int | None) -> Iterable[tuple[str, dict[str, Any]]]:
    """(where, row) of each task of the environment with `args`, in its load order, at most
    `limit` (required for an infinite taskset). Row columns: ``messages`` (the opening) and
    ``verifiers`` ({env, args, task}: the task's data as JSON, defaults left out).

    Raises:
        VerifiersError: as `check`; an infinite taskset without a limit; a task without a prompt.
    """
    check(env, args)
    ts = taskset(env, args)
    if not ts.bounded and limit is None:
        raise VerifiersError(
            f"verifiers environment {env!r} yields tasks forever: set task.n_train (and task.n_test) to bound it"
        )
    view = ts if limit is None else ts.take(limit)
    for task in view:
        data = task.data
        yield (
            f"verifiers {env} task {data.idx}",
            {
                "messages": as_chat(opening_messages(data)),
                COLUMN: {"env": env, "args": dict(args), "task": data.model_dump(mode="json", exclude_defaults=True)},
            },
        )


# --- scoring ------------------------------------------------------------------------------------


def new_trace(task: Any, name: str = "asyncrl") -> Any:
    """An empty trace of `task`, as verifiers' offline tools (validate, debug) make one."""
    vf = _vf()
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import TraceTask

    return vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name=name, trainable=True),
    )


def append(trace: Any, message: Any, sampled: bool = False) -> None:
    """Add a message to the trace's one branch (sampled: the model produced it)."""
    from verifiers.v1.graph import MessageNode

    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))


def rubric_result(scores: Mapping[str, float], weights: Mapping[str, float]) -> RewardResult:
    """The reward of a scored trace: each reward function's score a component under its name, the
    reward their weighted sum (verifiers' ``Trace.reward``: sum of score * weight)."""
    return RewardResult(
        reward=math.fsum(scores[k] * weights[k] for k in scores), components={k: float(v) for k, v in scores.items()}
    )


async def score_trace(task: Any, trace: Any) -> tuple[dict[str, float], dict[str, float]]:
    """The task's own scoring of `trace` (no runtime): (score, weight) per reward name.

    Raises:
        VerifiersError: a reward function raised, or did not score.
    """
    try:
        await task.score(trace)
    except Exception as exc:
        raise VerifiersError(f"the verifiers rubric raised: {_why(exc)}") from None
    missing = [k for k, r in trace.rewards.items() if r is None]
    if missing:
        raise VerifiersError(f"verifiers reward functions {missing} did not score")
    return {k: r.score for k, r in trace.rewards.items()}, {k: r.weight for k, r in trace.rewards.items()}


def score_sample(completion: str, metadata: Mapping[str, Any], episode: Mapping[str, float]) -> RewardResult:
    """The built-in ``verifiers`` reward of one sample: an episode the ``verifiers`` environment
    scored carries its rubric's scores (read back here); a single-turn completion is scored now,
    as the assistant's reply to the task's opening.

    Raises:
        VerifiersError: the episode's rubric raised in the generator, a multi-turn episode was not
            played in the verifiers environment, the metadata is not a verifiers task's, or the
            rubric raised here.
    """
    if FAILED in episode:
        raise VerifiersError(
            "the verifiers rubric raised while the generator scored this episode (the generator's log has the reason)"
        )
    if TOTAL in episode:
        scores = {k[len(SCORE_PREFIX) :]: v for k, v in episode.items() if k.startswith(SCORE_PREFIX)}
        return RewardResult(reward=float(episode[TOTAL]), components=scores)
    if episode:
        raise VerifiersError(
            "this episode carries no verifiers rubric scores: a multi-turn verifiers task runs in the environment "
            "'verifiers' (environment.name), which scores it"
        )
    vf = _vf()
    task, _ = rebuild(metadata.get(COLUMN) or {})
    trace = new_trace(task)
    for m in opening_messages(task.data):
        append(trace, m)
    append(trace, vf.AssistantMessage(content=completion), sampled=True)
    scores, weights = asyncio.run(score_trace(task, trace))
    return rubric_result(scores, weights)


# --- the multi-turn environment -----------------------------------------------------------------


@dataclass
class _Tool:
    server: Any  # mcp's MCPServer holding the toolset's tools
    name: str  # the toolset's own name for it
    schema: dict[str, Any]  # the OpenAI/HF function schema the model is shown


class VerifiersEnv:
    """A verifiers task's episode (module docstring): the task's opening, its toolsets' tools in
    the Hermes <tool_call> format (the `tools` environment's), its trace stops; at the end its
    rubric, as the episode's metrics.

    Args:
        system_prompt: put the tools and the call format in the system message (joined to the
            task's own). Off when the chat template renders the tools itself.
        max_output_chars: a tool result's bound (its end is kept).
    """

    def __init__(self, system_prompt: bool = True, max_output_chars: int = 2000) -> None:
        self.system_prompt = system_prompt
        self.max_output_chars = max_output_chars
        self.task: Any = None
        self.taskset: Any = None
        self.trace: Any = None
        self.tools: dict[str, _Tool] = {}
        self.toolsets: list[Any] = []
        self.calls = 0
        self.stopped: str | None = None

    async def start(self, row: Row) -> list[Message]:
        metadata = row.metadata if isinstance(row, Problem) else row.get("metadata") or {}
        self.task, self.taskset = rebuild(metadata.get(COLUMN) or {})
        self.trace = new_trace(self.task)
        opening = opening_messages(self.task.data)
        for m in opening:
            append(self.trace, m)
        await self._open_tools()
        messages = as_chat(opening)
        if not (self.tools and self.system_prompt):
            return messages
        if messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{self.instructions()}"}, *messages[1:]]
        return [{"role": "system", "content": self.instructions()}, *messages]

    async def _open_tools(self) -> None:
        from mcp.server.mcpserver import MCPServer

        for toolset in _toolsets(self.task, self.taskset):
            await toolset._exit_stack.__aenter__()
            self.toolsets.append(toolset)
            await toolset.setup()
            await toolset.setup_task(self.task)
            server = MCPServer(toolset.server_name or type(toolset).__name__)
            toolset.register(server)
            for t in await server.list_tools():
                full = f"{toolset.server_name}_{t.name}" if toolset.server_name else t.name
                if full in self.tools:
                    raise VerifiersError(f"two verifiers tools are named {full!r}")
                schema = {"name": full, "description": t.description or "", "parameters": t.input_schema}
                self.tools[full] = _Tool(server, t.name, {"type": "function", "function": schema})

    def instructions(self) -> str:
        """The system prompt's text: the tools and the call format (as the `tools` environment's)."""
        tools = "\n".join(json.dumps(t.schema) for t in self.tools.values())
        return (
            "You may call tools. To call one, write\n"
            '<tool_call>{"name": <tool name>, "arguments": <arguments as a JSON object>}</tool_call>\n'
            "and its result comes back in <tool_response></tool_response>. One call per turn; when you "
            "have the final answer, reply without a tool call.\n"
            f"<tools>\n{tools}\n</tools>"
        )

    async def step(self, turn: ModelTurn) -> StepResult:
        from shared.environments.base import StepResult
        from shared.environments.tools import count_tool_calls, parse_tool_call

        vf = _vf()
        n_calls = count_tool_calls(turn.text)
        try:
            call = parse_tool_call(turn.text) if self.tools else None
        except ValueError as exc:  # a malformed call: the model is told, as a user turn
            append(self.trace, vf.AssistantMessage(content=turn.text), sampled=True)
            append(self.trace, vf.UserMessage(content=f"error: {exc}"))
            info = {"tool_call": True, "tool_ok": False}
            return await self._after(StepResult(f"error: {exc}", info=info, role="user"))
        if call is None:
            append(self.trace, vf.AssistantMessage(content=turn.text), sampled=True)
            return StepResult(done=True, info={"tool_call": False})
        self.calls += 1
        call_id = f"call_{self.calls}"
        before = turn.text[: turn.text.find("<tool_call>")].strip()
        append(
            self.trace,
            vf.AssistantMessage(
                content=before or None,
                tool_calls=[vf.ToolCall(id=call_id, name=call.name, arguments=json.dumps(call.arguments))],
            ),
            sampled=True,
        )
        text, ok = await self._call(call.name, call.arguments)
        if n_calls > 1:
            text += f"\n(only the first tool call of a turn runs; {n_calls - 1} more ignored)"
        append(self.trace, vf.ToolMessage(tool_call_id=call_id, content=text, name=call.name))
        return await self._after(StepResult(text, info={"tool_call": True, "tool_ok": ok}))

    async def _call(self, name: str, arguments: Mapping[str, Any]) -> tuple[str, bool]:
        """The tool's result text and whether it succeeded; a failure is the error, for the model."""
        tool = self.tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}; available: {list(self.tools)}", False
        try:
            result = await tool.server.call_tool(tool.name, dict(arguments))
        except Exception as exc:  # mcp's ToolError: arguments that do not validate, or the tool raised
            return self._bounded(f"error: {exc}"), False
        texts = [getattr(b, "text", None) or str(b) for b in getattr(result, "content", [])]
        ok = not getattr(result, "is_error", False)
        return self._bounded(("" if ok else "error: ") + "\n".join(texts)), ok

    def _bounded(self, text: str) -> str:
        n = self.max_output_chars
        return text if len(text) <= n else "..." + text[-n:]

    async def _after(self, result: StepResult) -> StepResult:
        """The trace stops (`@vf.stop` on the trace), checked once the reply is in the trace, as
        verifiers checks them before the next model call."""
        from verifiers.v1.session import call_hook

        from shared.environments.base import StepResult

        vf = _vf()
        for fn in self.task.hooks("stop"):
            stop = await call_hook(fn, {vf.Trace: self.trace})
            if not isinstance(stop, bool):
                raise VerifiersError(f"@vf.stop {fn.__name__} returned {type(stop).__name__}; expected a bool")
            if stop:
                self.stopped = fn.__name__
                self.trace.stop(fn.__name__)
                return StepResult(result.text, result.reward, True, result.info, result.role)
        return result

    async def end(self, turn: ModelTurn) -> None:
        """The model turn that ended the episode without a step (cut at the token budget or by the
        engine) is still the conversation's last reply, as in verifiers' trace."""
        append(self.trace, _vf().AssistantMessage(content=turn.text), sampled=True)

    async def metrics(self) -> dict[str, float]:
        """The rubric's scores (``rubric/<name>``) and weighted sum (``rubric_reward``), or
        ``rubric_failed`` when it raised (logged); the toolsets are closed."""
        try:
            scores, weights = await score_trace(self.task, self.trace)
            if len(scores) > MAX_REWARDS or any(len(k) > MAX_NAME for k in scores):
                # an episode carries 16 metrics: more would be dropped, and the reward with them
                raise VerifiersError(
                    f"the rubric gave scores {sorted(scores)}: at most {MAX_REWARDS}, names at most "
                    f"{MAX_NAME} characters"
                )
            out = {TOTAL: rubric_result(scores, weights).reward or 0.0}
            out.update({f"{SCORE_PREFIX}{k}": v for k, v in scores.items()})
            return out
        except VerifiersError as exc:
            log.error("verifiers task %s: %s", getattr(self.task.data, "idx", "?"), exc)
            return {FAILED: 1.0}
        finally:
            for t in self.toolsets:
                try:
                    await t._exit_stack.aclose()
                except Exception as exc:  # closing noise costs the episode nothing
                    log.warning("closing verifiers toolset %s: %s", type(t).__name__, _why(exc))
