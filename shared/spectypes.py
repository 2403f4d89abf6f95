"""Rules every model of the job spec shares, so that a spec which validates can also be stored,
read back and served by every service:

- numbers are finite (`allow_inf_nan=False`): JSON has no NaN or Infinity, and the ledger would
  store them as null, which the services then reject;
- every string has a length bound: its field's own `max_length`, else `MAX_STR`;
- names and paths hold no control characters (`PrintableStr`): they reach logs and file systems;
- no string anywhere holds NUL (PostgreSQL text cannot store it), a lone surrogate (not Unicode:
  no UTF-8, so no JSON answer, ledger row or log line), or a control character other than tab,
  newline and carriage return (none at all in keys) (`refuse_bad_text`);
- integers and booleans are strict (`strict=True`): `"3"`, `3.0` and `true` are not integers;
- a section with many unknown keys fails with one error rather than one per key (a 1 M-key body
  would otherwise build 1 M error records).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

MAX_STR = 4096
"""Length bound of a spec string whose field sets none."""
MAX_UNKNOWN_LISTED = 20
"""Up to this many unknown keys in one section are reported one by one; more are one error."""

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators (log viewers break lines
# at them too).
CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _printable(value: str) -> str:
    m = CONTROL_CHARS.search(value)
    if m is not None:
        raise ValueError(
            f"contains the control character {m.group()!r} at position {m.start()}; use printable text only"
        )
    return value


PrintableStr = Annotated[str, AfterValidator(_printable)]
"""A name or path: no control characters (give the length bounds on the field)."""


class SpecModel(BaseModel):
    """Base of the job spec's models: unknown fields rejected, finite numbers, bounded strings."""

    # strict: no coercion (`steps: true`, `steps: "3"`, `group_size: "4"` are refused with the field
    # named); an integer is still a valid float
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, str_max_length=MAX_STR, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(data) > len(cls.model_fields) + MAX_UNKNOWN_LISTED:
            unknown = [k for k in data if k not in cls.model_fields]
            if len(unknown) > MAX_UNKNOWN_LISTED:
                first = ", ".join(repr(str(k)[:40]) for k in unknown[:5])
                # A ValueError, not a custom error type: the reward union re-raises its members'
                # errors by type (shared.rewards.spec._untagged).
                raise ValueError(f"{len(unknown)} unknown fields ({first}, ...); remove them or check their spelling")
        return data


# In free text (templates, stop strings, kwargs values) tab, newline and carriage return are
# text; every other C0 or C1 control is refused. Keys (kwargs names, headers) take none.
TEXT_CONTROL_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
SURROGATES = re.compile("[\ud800-\udfff]")
MAX_BAD_TEXT_LISTED = 20


def text_problem(text: str, *, key: bool = False) -> tuple[str, str] | None:
    """(error type, message) when `text` cannot be stored and served as it is: NUL (PostgreSQL
    text cannot hold it), a lone surrogate (not Unicode: no UTF-8 encoding, so no JSON answer,
    ledger row or log line can carry it), or a control character (`key`: any, else any but tab,
    newline and carriage return); None when it can."""
    if "\x00" in text:
        return "nul_character", "contains a NUL character (\\u0000); remove it"
    if (m := SURROGATES.search(text)) is not None:
        return (
            "surrogate_character",
            f"contains a lone surrogate (\\u{ord(m.group()):04x}) at position {m.start()}, which is not valid "
            "Unicode text; remove it",
        )
    if (m := (CONTROL_CHARS if key else TEXT_CONTROL_CHARS).search(text)) is not None:
        return (
            "control_character",
            f"contains the control character \\x{ord(m.group()):02x} at position {m.start()}; use printable text"
            + ("" if key else " (tab, newline and carriage return are allowed)"),
        )
    return None


def _bad_text_locations(data: Any) -> Iterator[tuple[tuple[str | int, ...], str, tuple[str, str]]]:
    """(location, offending string, problem) of every string or key in `data` that `text_problem`
    refuses, depth first."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            if (problem := text_problem(value)) is not None:
                yield loc, value, problem
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                key_text = str(key)
                if (problem := text_problem(key_text, key=True)) is not None:
                    shown = key_text.encode("utf-8", "backslashreplace").decode()
                    yield (*loc, escape_controls(shown)), key_text, problem
                else:
                    stack.append(((*loc, key_text), item))
        elif isinstance(value, (list, tuple)):
            stack.extend(((*loc, i), item) for i, item in reversed(list(enumerate(value))))


def escape_controls(text: str) -> str:
    """`text` with control characters as `\\uNNNN` escapes (for a location in an error)."""
    return CONTROL_CHARS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def refuse_bad_text(title: str, data: Any) -> None:
    """Raise a ValidationError locating each string (value or key) in `data` that `text_problem`
    refuses: what is accepted can be stored, answered and logged (a lone surrogate used to be
    stored and then make every GET of the job a 500).

    For a model's `mode="before"` validator; `title` names the model.
    """
    details: list[InitErrorDetails] = []
    for loc, text, (kind, message) in _bad_text_locations(data):
        shown = text[:100].encode("utf-8", "backslashreplace").decode()
        details.append(InitErrorDetails(type=PydanticCustomError(kind, message), loc=loc, input=shown))
        if len(details) == MAX_BAD_TEXT_LISTED:
            break
    if details:
        raise ValidationError.from_exception_data(title, details)
