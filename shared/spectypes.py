"""Rules every model of the job spec shares, so that a spec which validates can also be stored,
read back and served by every service:

- numbers are finite (`allow_inf_nan=False`): JSON has no NaN or Infinity, and the ledger would
  store them as null, which the services then reject;
- every string has a length bound: its field's own `max_length`, else `MAX_STR`;
- names and paths hold no control characters (`PrintableStr`): they reach logs and file systems;
- no string anywhere holds NUL (`refuse_nul`): PostgreSQL text cannot store it;
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
MAX_NUL_LISTED = 20

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

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, str_max_length=MAX_STR)

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


def _nul_locations(data: Any) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """(location, offending string) of every string or key holding NUL, depth first."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                yield loc, value
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                key_text = str(key)
                if "\x00" in key_text:
                    yield (*loc, key_text.replace("\x00", "\\u0000")), key_text
                else:
                    stack.append(((*loc, key_text), item))
        elif isinstance(value, (list, tuple)):
            stack.extend(((*loc, i), item) for i, item in reversed(list(enumerate(value))))


def refuse_nul(title: str, data: Any) -> None:
    """Raise a ValidationError locating each string (value or key) in `data` that holds NUL.

    For a model's `mode="before"` validator; `title` names the model.
    """
    details: list[InitErrorDetails] = []
    for loc, text in _nul_locations(data):
        details.append(
            InitErrorDetails(
                type=PydanticCustomError("nul_character", "contains a NUL character (\\u0000); remove it"),
                loc=loc,
                input=text[:100],
            )
        )
        if len(details) == MAX_NUL_LISTED:
            break
    if details:
        raise ValidationError.from_exception_data(title, details)
