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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from shared.tasks import Problem

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
        if messages:
            # A conversation without a template: its turns' text, one per line.
            prompt = "\n".join(str(m.get("content", "")) for m in messages)
        return Rendered(prompt, list(tokenizer(prompt, add_special_tokens=True)["input_ids"]))
    conv = messages_of(prompt, messages)
    kwargs = dict(chat_kwargs or {})
    text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False, **kwargs)
    return Rendered(text, list(tokenizer(text, add_special_tokens=False)["input_ids"]))


def renderer(
    tokenizer: Tokenizer, mode: ChatMode = "auto", chat_kwargs: Mapping[str, Any] | None = None
) -> Callable[[Problem], Rendered]:
    """`render` for the problems of a job (its `chat_template` and `chat_template_kwargs`): what
    the feeder, the offline evaluation and the warm start all call, so they render alike."""
    chat = uses_chat(tokenizer, mode)
    return lambda p: render(tokenizer, p.prompt, p.messages, chat=chat, chat_kwargs=chat_kwargs)
