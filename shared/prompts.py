"""Prompt rendering: the one place a problem becomes the text and token ids the model sees.

The trainer's feeder renders each prompt once and sends its token ids on the prompts stream; the
generator generates from exactly those ids and the rollout carries them back, so the trainer
trains on the ids the generator saw (no second tokenization anywhere, and so no drift between
what was sampled and what is scored under the current policy).

Two renderings, chosen by the job spec's `chat_template` (auto | on | off):

- chat: the problem's messages (a system prompt, then the user turn; or the dataset's own
  messages) through ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``, as the
  model was instruction-tuned to see them. The template carries its special tokens itself, so the
  text is tokenized without adding any (what transformers and vLLM's chat endpoint do).
- plain: the prompt text, tokenized with the tokenizer's special tokens (BOS), which is what
  vLLM does with a text prompt.

`auto` uses the chat rendering when the tokenizer has a chat template. Light: the tokenizer is any
object with the transformers tokenizer interface; nothing heavy is imported here.

Before a job trains, every problem it will feed or evaluate is rendered once (`usable`): a problem
that the chat template refuses or the tokenizer cannot encode is a bad row (the job's
`task.bad_rows`: the load fails naming its file and row, or it is dropped and counted), and a chat
template that breaks a limit (`RenderLimits`: time, output size, memory; checked in a child
process, shared/chat_render.py) fails the job at load with the reason.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from shared.datasets import DatasetError
from shared.tasks import Problem

log = logging.getLogger(__name__)

ChatMode = Literal["auto", "on", "off"]


class Tokenizer(Protocol):  # the part of a transformers tokenizer rendering uses
    chat_template: Any

    def __call__(self, text: str, add_special_tokens: bool = ...) -> Any: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Rendered:
    text: str  # what the model is conditioned on, as text
    ids: list[int]  # the same, as token ids: what the generator generates from


def uses_chat(tokenizer: Tokenizer, mode: ChatMode) -> bool:
    """Whether prompts are rendered with the tokenizer's chat template.

    Raises:
        ValueError: mode "on" with a tokenizer that has no chat template.
    """
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has:
        raise ValueError(
            "chat_template is 'on' but the model's tokenizer has no chat template; "
            "add one to tokenizer_config.json (chat_template) or set chat_template to 'auto'/'off'"
        )
    return has and mode != "off"


def messages_of(prompt: str, messages: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation to render: the problem's messages (a system prompt, the dataset's own
    turns) if it has them, else the prompt as the one user turn."""
    if messages:
        return [dict(m) for m in messages]
    return [{"role": "user", "content": prompt}]


def render(
    tokenizer: Tokenizer,
    prompt: str,
    messages: Sequence[Mapping[str, Any]] | None = None,
    *,
    chat: bool,
    chat_kwargs: Mapping[str, Any] | None = None,
) -> Rendered:
    """The prompt as text and token ids (see the module docstring).

    Args:
        prompt: the templated user text (plain rendering; the user turn when `messages` is None).
        messages: the conversation (chat rendering); None: built from `prompt`.
        chat: render with the chat template (`uses_chat`).
        chat_kwargs: extra template variables (e.g. {"enable_thinking": False}).
    """
    if not chat:
        prompt = _plain_text(prompt, messages)
        return Rendered(prompt, list(tokenizer(prompt, add_special_tokens=True)["input_ids"]))
    conv = messages_of(prompt, messages)
    kwargs = dict(chat_kwargs or {})
    text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False, **kwargs)
    return Rendered(text, list(tokenizer(text, add_special_tokens=False)["input_ids"]))


@dataclass(frozen=True)
class RenderLimits:
    """What rendering one conversation through a chat template may take (docs/reliability.md)."""

    timeout_s: float = 2.0  # a template renders a prompt in well under a millisecond
    max_chars: int = 4 << 20  # the rendered text (task.max_row_bytes bounds a row likewise)
    memory_bytes: int = 1 << 30  # the rendering process's address space beyond its start
    start_s: float = 60.0  # the rendering process's start-up (importing transformers) on a busy box


class TemplateLimitError(ValueError):
    """The chat template broke a limit (time, output size, memory) on a problem: a fault of the
    template, not of the row, so the job fails whatever its bad_rows says."""


@dataclass(frozen=True)
class _Refused:
    why: str  # the template raised on this conversation


CHECK_BATCH = 256  # texts tokenized per call when every problem is checked


class Renderer:
    """`render` for the problems of a job (its `chat_template` and `chat_template_kwargs`): what
    the feeder, the evaluation, the offline evaluation and the warm start all call, so they render
    alike; `failures` checks a whole list at once."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        mode: ChatMode = "auto",
        chat_kwargs: Mapping[str, Any] | None = None,
        limits: RenderLimits = RenderLimits(),
    ) -> None:
        self.tokenizer = tokenizer
        self.chat = uses_chat(tokenizer, mode)
        self.chat_kwargs = dict(chat_kwargs or {})
        self.limits = limits

    def __call__(self, p: Problem) -> Rendered:
        return render(self.tokenizer, p.prompt, p.messages, chat=self.chat, chat_kwargs=self.chat_kwargs)

    def failures(self, problems: Sequence[Problem]) -> list[tuple[int, str]]:
        """(position, why) of each problem that cannot be rendered: the chat template raised on it,
        or the tokenizer cannot encode its text. Each is rendered once (the chat template in a
        child process with `limits`, the tokenizer here in batches); nothing is kept.

        Raises:
            TemplateLimitError: the chat template broke a limit (the message names the problem).
        """
        texts: Iterable[str | _Refused]
        if self.chat:
            template = _template_of(self.tokenizer)
            kwargs = {**_special_tokens(self.tokenizer), **self.chat_kwargs}
            convs = (messages_of(p.prompt, p.messages) for p in problems)
            texts = chat_texts(template, kwargs, convs, self.limits, [_where(p) for p in problems])
        else:
            texts = (_plain_text(p.prompt, p.messages) for p in problems)
        bad: list[tuple[int, str]] = []
        batch: list[tuple[int, str]] = []
        for i, t in enumerate(texts):
            if isinstance(t, _Refused):
                bad.append((i, f"the chat template refuses it ({t.why})"))
                continue
            batch.append((i, t))
            if len(batch) == CHECK_BATCH:
                bad += self._encodes(batch)
                batch = []
        bad += self._encodes(batch)
        return sorted(bad)

    def _encodes(self, batch: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """The texts of `batch` the tokenizer cannot encode, as (position, why)."""
        if not batch:
            return []
        try:
            self.tokenizer([t for _, t in batch], add_special_tokens=not self.chat)  # type: ignore[arg-type]
            return []
        except Exception:  # one of them (or a tokenizer that takes one text at a time): each alone
            pass
        bad = []
        for i, t in batch:
            try:
                self.tokenizer(t, add_special_tokens=not self.chat)
            except Exception as e:
                bad.append((i, f"the tokenizer cannot encode it ({_brief(e)})"))
        return bad


def renderer(tokenizer: Tokenizer, mode: ChatMode = "auto", chat_kwargs: Mapping[str, Any] | None = None) -> Renderer:
    """`render` for the problems of a job (see `Renderer`)."""
    return Renderer(tokenizer, mode, chat_kwargs)


def usable(
    problems: Sequence[Problem], render: Callable[[Problem], Rendered], bad_rows: str, what: str
) -> list[Problem]:
    """`problems` less those that cannot be rendered, every one tried now (before the job trains;
    `Renderer.failures`, or `render` on each for another callable). One that cannot: the load
    fails naming its row (`bad_rows` "reject"), or it is left out and counted in the log ("drop").

    Raises:
        DatasetError: a problem cannot be rendered and bad_rows is "reject".
        TemplateLimitError: the chat template broke a limit (whatever bad_rows says).
    """
    if isinstance(render, Renderer):
        bad = render.failures(problems)
    else:
        bad = [(i, why) for i, p in enumerate(problems) if (why := _fails(render, p)) is not None]
    if not bad:
        return list(problems)
    notes = [f"{_where(problems[i])}: {why}" for i, why in bad]
    if bad_rows == "reject":
        raise DatasetError(f"{notes[0]} (task.bad_rows=drop leaves such rows out)")
    dropped = {i for i, _ in bad}
    kept = [p for i, p in enumerate(problems) if i not in dropped]
    if not kept:
        raise DatasetError(f"no {what} problem can be rendered ({len(bad)} dropped), e.g. {notes[0]}")
    log.warning(
        "%s: %d problems dropped (task.bad_rows=drop), %d kept; first: %s",
        what,
        len(bad),
        len(kept),
        "; ".join(notes[:3]),
    )
    return kept


def chat_texts(
    template: str,
    kwargs: Mapping[str, Any],
    conversations: Iterable[list[dict[str, Any]]],
    limits: RenderLimits,
    where: Sequence[str],
) -> Iterator[str | _Refused]:
    """Each conversation through `template` (with `add_generation_prompt` and `kwargs`), rendered
    in a child process within `limits` (shared/chat_render.py); a conversation the template raises
    on comes as `_Refused`. `where` names each conversation's problem in errors.

    Raises:
        TemplateLimitError: a conversation broke a limit, or the child process died.
    """
    with tempfile.TemporaryDirectory(prefix="asyncrl-render-") as tmp:
        src, err = Path(tmp) / "in.jsonl", Path(tmp) / "stderr"
        with src.open("w", encoding="utf-8") as f:
            head = {"template": template, "kwargs": dict(kwargs), "timeout_s": limits.timeout_s}
            head |= {"max_chars": limits.max_chars, "memory_bytes": limits.memory_bytes}
            f.write(json.dumps(head) + "\n")
            n = 0
            for conv in conversations:
                f.write(json.dumps(conv) + "\n")
                n += 1
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        with err.open("wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "shared.chat_render", str(src)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
            )
        lines: queue.Queue[bytes] = queue.Queue()
        assert proc.stdout is not None
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        try:
            for i in range(n):
                wait = limits.timeout_s + 10.0 + (limits.start_s if i == 0 else 0.0)
                try:
                    line = lines.get(timeout=wait)
                except queue.Empty:
                    raise TemplateLimitError(
                        f"the chat template did not render {where[i]} within {wait:.0f} s; fix the template "
                        "(the model's tokenizer_config.json) or set chat_template: off"
                    ) from None
                if not line:
                    proc.wait()
                    tail = err.read_text(errors="replace")[-500:].strip()
                    raise TemplateLimitError(
                        f"the chat template renderer died (exit {proc.returncode}) rendering {where[i]}: {tail}"
                    )
                answer = json.loads(line)
                if "limit" in answer:
                    raise TemplateLimitError(
                        f"the chat template broke a limit on {where[i]}: {answer['limit']}; fix the template "
                        "(the model's tokenizer_config.json) or set chat_template: off"
                    )
                yield _Refused(answer["error"]) if "error" in answer else answer["text"]
        finally:
            proc.kill()
            proc.wait()


def _pump(stream: Any, out: queue.Queue[bytes]) -> None:
    for line in stream:
        out.put(line)
    out.put(b"")


def _template_of(tokenizer: Tokenizer) -> str:
    get = getattr(tokenizer, "get_chat_template", None)
    return str(get() if callable(get) else tokenizer.chat_template)


def _special_tokens(tokenizer: Tokenizer) -> dict[str, Any]:
    # apply_chat_template passes the special tokens (bos_token, eos_token, ...) to the template
    return {k: v for k, v in dict(getattr(tokenizer, "special_tokens_map", None) or {}).items()}


def _plain_text(prompt: str, messages: Sequence[Mapping[str, Any]] | None) -> str:
    # A conversation without a template: its turns' text, one per line (as `render`).
    return "\n".join(str(m.get("content", "")) for m in messages) if messages else prompt


def _where(p: Problem) -> str:
    return p.origin or f"problem {p.index} of {p.source or 'the task'}"


def _brief(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"[:300]
    return text.encode("utf-8", "backslashreplace").decode()


def _fails(render: Callable[[Problem], Rendered], p: Problem) -> str | None:
    try:
        render(p)
    except Exception as e:
        return f"it cannot be rendered ({_brief(e)})"
    return None
