"""What a read hands around: the consumer it reads for, an entry as the server returned it, and
the decoded delivery a consumer gets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from shared.schema import Message

from .keys import FIELD

# The message kind(s) a consumer accepts on a stream: anything else is dead-lettered.
Expected = type[Message] | tuple[type[Message], ...]
# The message type a consumer's deliveries carry (Consumer[Scored] -> Delivery[Scored]).
M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Consumer(Generic[M]):
    """One reader of a consumer group: the stream it reads, its group, its name in the group (a
    restarted process of the same name resumes what its predecessor left pending), and the message
    kind(s) it accepts; anything else on the stream is dead-lettered."""

    stream: str
    group: str
    name: str
    expected: type[M] | tuple[type[M], ...]


@dataclass(frozen=True)
class Delivery(Generic[M]):
    """One decoded stream entry handed to a consumer; ack it with
    `JobStreams.ack(consumer.stream, consumer.group, [entry_id])`."""

    entry_id: str
    message: M
    deliveries: int = 1


@dataclass(frozen=True)
class Entry:
    """One entry as a read returns it: its fields, or (refused unread) why not and its size."""

    entry_id: str
    fields: dict | None
    refusal: str = ""  # "big" (over max_message_bytes) or "fields" (more than MAX_FIELDS fields)
    size: int = 0
    deliveries: int = 1
    prefix: bytes = b""  # an oversized entry's first DEAD_RAW_BYTES, for its dead letter


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def message_field(fields: dict | None) -> Any:
    """The message field of an entry's fields (byte keys, or str keys from a decoding client)."""
    if not fields:
        return None
    raw = fields.get(FIELD)
    return fields.get(FIELD.decode()) if raw is None else raw


def dead_payload(e: Entry) -> bytes:
    """What a dead letter of `e` keeps of it: the bytes of its message field, or of an oversized
    entry its first DEAD_RAW_BYTES."""
    if e.fields is None:
        return e.prefix
    raw = message_field(e.fields)
    return raw if isinstance(raw, bytes) else b""


def entry_from_row(row: list) -> Entry:
    """An entry of the READ script's reply: {id, status, payload or size, deliveries, prefix}."""
    eid, status, payload, n, prefix = row
    status = text(status)
    if status == "ok":
        it = iter(payload)
        return Entry(text(eid), dict(zip(it, it, strict=True)), deliveries=int(n))
    return Entry(text(eid), None, status, int(payload), int(n), bytes(prefix or b""))
