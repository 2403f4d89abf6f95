"""The tool-calling environment: a calculator and a sandboxed Python interpreter.

Tool-call format (the Hermes/Qwen convention HF chat templates with tools use): the model writes

    <tool_call>{"name": "calculator", "arguments": {"expression": "123+456"}}</tool_call>

and the result comes back as a `tool` message (with a chat template; a template without a tool
role, or none, gets it inside <tool_response>...</tool_response>). Only the first call of a turn
runs (the reply says how many were ignored). A malformed call (bad JSON, no closing tag, unknown
tool, bad arguments) or a failing tool is answered with an error message as the result, so the
model can correct itself; it ends nothing. A turn without a tool call is the final answer and ends
the episode.

Each turn's info records `tool_call` (the turn has one), `parsed` (it is well-formed JSON with a
name), `ok` (the tool ran and succeeded), and `tool` and `error` where known: the tool-call
success rate is the mean of `ok` over turns with `tool_call`. The episode's `metrics()`:
`tool_calls` (how many) and `tool_success` (1.0 when at least one ran and succeeded).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared.environments.base import Message, ModelTurn, Row, StepResult, row_messages
from shared.sandbox import Limits, run_python

# --- the calculator -------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 4096  # any integer along the way, ~1233 decimal digits
MAX_DEPTH = 100


class ToolError(ValueError):
    """A tool cannot run on its arguments; the message is the result the model sees."""


def _pow(a: int | float, b: int | float) -> int | float:
    if (
        isinstance(a, int)
        and isinstance(b, int)
        and b > 0
        and abs(a) > 1
        and abs(a).bit_length() * b > MAX_INT_BITS * 2
    ):
        raise ToolError(f"({a})**({b}) is too large (more than {MAX_INT_BITS} bits)")
    result = a**b
    if isinstance(result, complex):
        raise ToolError(f"({a})**({b}) is not a real number")
    return result


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_ALLOWED = "numbers, + - * / // % **, unary minus and parentheses"


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression, walked over its syntax tree (never evaluated as code).

    Raises:
        ToolError: anything but numbers, + - * / // % **, unary +/- and parentheses; a division by
            zero; an integer over MAX_INT_BITS, a float overflow or a non-finite number.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ToolError(f"not an arithmetic expression ({type(exc).__name__}); use {_ALLOWED}") from None
    return _eval(tree.body, 0)


def _eval(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise ToolError(f"the expression nests more than {MAX_DEPTH} deep")
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("the result is too large") from None
    if isinstance(node, ast.Constant):
        raise ToolError(f"{node.value!r} is not a number; use {_ALLOWED}")
    what = type(node.op).__name__ if isinstance(node, ast.BinOp | ast.UnaryOp) else type(node).__name__
    raise ToolError(f"{what} is not allowed; use {_ALLOWED}")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError(f"the result is too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is not a finite number")
    return value


# --- tool calls -----------------------------------------------------------------------------------

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A tool call that is not well-formed; the message is the result the model sees."""


def count_tool_calls(text: str) -> int:
    """Opening tags in the text (complete or not)."""
    return text.count(OPEN)


def parse_tool_call(text: str) -> ToolCall | None:
    """The first tool call of a turn, or None when the turn has none.

    The body is JSON: {"name": str, "arguments": {...}}; `arguments` may also be a JSON string
    holding the object (the OpenAI wire form), or absent (no arguments).

    Raises:
        ToolCallError: the first call has no closing tag, is not JSON, or not of that shape.
    """
    start = text.find(OPEN)
    if start < 0:
        return None
    m = _CALL.match(text, start)
    if m is None:
        raise ToolCallError(f'{OPEN} without {CLOSE}; write {OPEN}{{"name": ..., "arguments": {{...}}}}{CLOSE}')
    try:
        body = json.loads(m.group(1))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ToolCallError(f"the tool call is not valid JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise ToolCallError('the tool call must be a JSON object with a "name" (a string) and "arguments" (an object)')
    args = body.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            raise ToolCallError('"arguments" is a string that is not a JSON object') from None
    if not isinstance(args, dict):
        raise ToolCallError(f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(body["name"], args)


# --- the tools ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A tool: its JSON-schema description (what the model is shown) and how it runs."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments object
    run: Callable[[Mapping[str, Any]], str]

    def schema(self) -> dict[str, Any]:
        """The OpenAI/HF function schema (what `apply_chat_template(tools=...)` takes)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


def _string_arg(arguments: Mapping[str, Any], name: str) -> str:
    """The one argument a tool takes, checked."""
    extra = sorted(set(arguments) - {name})
    if extra:
        raise ToolError(f"unexpected arguments {extra}; this tool takes only {name!r}")
    value = arguments.get(name)
    if not isinstance(value, str):
        raise ToolError(f"argument {name!r} must be a string, got {type(value).__name__}")
    return value


def calculator_tool() -> Tool:
    def run(arguments: Mapping[str, Any]) -> str:
        return str(calculate(_string_arg(arguments, "expression")))

    return Tool(
        "calculator",
        f"Evaluate an arithmetic expression: {_ALLOWED}.",
        {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        run,
    )


def python_tool(limits: Limits, max_output_chars: int) -> Tool:
    """Runs the program in the project's sandbox (shared.sandbox); SandboxUnavailable propagates,
    ending the episode with the reason (a machine that cannot confine code must not pretend to)."""

    def run(arguments: Mapping[str, Any]) -> str:
        res = run_python(_string_arg(arguments, "code"), limits)
        if res.ok:
            return _tail(res.stdout, max_output_chars) or "(no output)"
        why = (
            f"killed: over the time limit of {limits.wall_s:g} s" if res.timed_out else f"exit status {res.returncode}"
        )
        raise ToolError(_tail(f"{res.stdout}{res.stderr}".strip() + f"\n[{why}]", max_output_chars))

    return Tool(
        "python",
        "Run a Python program (standard library only, no network) and return what it prints.",
        {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        run,
    )


def _tail(text: str, n: int) -> str:
    return text if len(text) <= n else "..." + text[-n:]


TOOLS = ("calculator", "python")


class ToolEnv:
    """Tool calling, multi-turn: see the module docstring for the format and the info it records.

    Args:
        tools: which tools to offer (of TOOLS).
        system_prompt: prepend a system message describing the tools and the call format (joined to
            the row's own system message if it has one). Off when the chat template renders the
            tools itself (`tool_schemas()` as the template's `tools` variable).
        max_output_chars: a tool result's bound (its end is kept).
        python_wall_s, python_memory_mb: the sandbox's limits for one python call.
    """

    def __init__(
        self,
        tools: Sequence[str] = TOOLS,
        system_prompt: bool = True,
        max_output_chars: int = 2000,
        python_wall_s: float = 5.0,
        python_memory_mb: int = 256,
    ) -> None:
        unknown = sorted(set(tools) - set(TOOLS))
        if unknown or not tools:
            raise ValueError(f"unknown tools {unknown}; valid: {list(TOOLS)}" if unknown else "tools is empty")
        limits = Limits(wall_s=python_wall_s, memory_bytes=python_memory_mb * 1024 * 1024)
        every = {"calculator": calculator_tool(), "python": python_tool(limits, max_output_chars)}
        self.tools = {name: every[name] for name in tools}
        self.system_prompt = system_prompt
        self.max_output_chars = max_output_chars
        self.calls = self.calls_ok = 0  # this episode's

    def metrics(self) -> dict[str, float]:
        """The episode's tool use: `tool_calls` and `tool_success` (any call ran and succeeded)."""
        return {"tool_calls": float(self.calls), "tool_success": float(self.calls_ok > 0)}

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def instructions(self) -> str:
        """The system prompt's text: the tools and the call format."""
        tools = "\n".join(json.dumps(s) for s in self.tool_schemas())
        return (
            "You may call tools. To call one, write\n"
            '<tool_call>{"name": <tool name>, "arguments": <arguments as a JSON object>}</tool_call>\n'
            "and its result comes back in <tool_response></tool_response>. One call per turn; when you "
            "have the final answer, reply without a tool call.\n"
            f"<tools>\n{tools}\n</tools>"
        )

    def start(self, row: Row) -> list[Message]:
        messages = row_messages(row)
        if not self.system_prompt:
            return messages
        if messages[0].get("role") == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{self.instructions()}"}, *messages[1:]]
        return [{"role": "system", "content": self.instructions()}, *messages]

    def step(self, turn: ModelTurn) -> StepResult:
        calls = count_tool_calls(turn.text)
        self.calls += calls > 0
        try:
            call = parse_tool_call(turn.text)
        except ToolCallError as exc:
            return StepResult(
                f"error: {exc}", info={"tool_call": True, "parsed": False, "ok": False, "error": str(exc)}
            )
        if call is None:
            return StepResult(done=True, info={"tool_call": False})
        info: dict[str, Any] = {"tool_call": True, "parsed": True, "tool": call.name}
        tool = self.tools.get(call.name)
        try:
            if tool is None:
                raise ToolError(f"unknown tool {call.name!r}; available: {list(self.tools)}")
            result, info["ok"] = tool.run(call.arguments), True
        except ToolError as exc:
            result, info["ok"], info["error"] = f"error: {exc}", False, str(exc)
        self.calls_ok += info["ok"]
        if calls > 1:
            result += f"\n(only the first tool call of a turn runs; {calls - 1} more ignored)"
        return StepResult(result, info=info)
