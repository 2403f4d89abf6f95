"""The boundary between a stream and its readers: what a read returned becomes valid messages of
this job, and what cannot be used goes to `{job}:dead` with its reason (and is acked)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

from shared.ids import dead_letter_id
from shared.schema import (
    DEAD_RAW_BYTES,
    DeadLetter,
    DecodeError,
    Message,
    PromptGroup,
    Rollout,
    Scored,
    clean_text,
    decode,
    encode,
)

from .entries import Delivery, Entry, Expected, M, dead_payload, message_field
from .keys import DEAD, FIELD, JobKeys
from .reads import Reads

log = logging.getLogger(__name__)


def _identity(msg: Message) -> Message:
    """`msg` without its bulk: who it is (ids, group, sample index), not what it says."""
    if isinstance(msg, Rollout):
        return msg.model_copy(
            update={
                "prompt_ids": b"",
                "completion_ids": b"",
                "logprobs": b"",
                "completion": "",
                "answer": "",
                "prompt": "",
                "metadata": {},
            }
        )
    if isinstance(msg, Scored):
        return msg.model_copy(update={"rollout": _identity(msg.rollout), "details": {}, "reward_reason": ""})
    if isinstance(msg, PromptGroup):
        return msg.model_copy(update={"prompt": "-", "prompt_ids": b"", "answer": "", "metadata": {}})
    return msg


class DeadLetters:
    """Decoding and dead-lettering for one job: entries that fail to decode, that are oversized,
    that are another job's, or (read by a group) that were delivered more than `max_deliveries`
    times go to the dead stream; the rest are handed on as deliveries."""

    def __init__(self, client: Any, keys: JobKeys, reads: Reads, *, max_deliveries: int):
        self.r = client
        self.keys = keys
        self.reads = reads
        self.max_deliveries = max_deliveries
        # Called with (stream, code) for every dead-lettered entry: services count them in their
        # metrics (shared.metrics *.dead_letter). Set by the service after construction.
        self.on_dead_letter: Callable[[str, str], None] | None = None

    def deliver(
        self, stream: str, group: str | None, rows: list[Entry], expected: type[M] | tuple[type[M], ...]
    ) -> list[Delivery[M]]:
        """Decode what a read returned; dead-letter (and ack, with a `group`) what cannot be
        used."""
        out: list[Delivery[M]] = []
        for e in rows:
            try:
                msg = self.decode(stream, e, expected)
            except DecodeError as exc:
                self.dead_letter(stream, group, e.entry_id, exc.reason, dead_payload(e), code=exc.code)
                continue
            if group is not None and e.deliveries > self.max_deliveries:
                self.dead_letter(
                    stream,
                    group,
                    e.entry_id,
                    f"delivered {e.deliveries} times (limit {self.max_deliveries})",
                    dead_payload(e),
                    code="max_deliveries",
                )
                continue
            out.append(Delivery(e.entry_id, cast(M, msg), e.deliveries))  # decode checked its kind
        return out

    def decode(self, stream: str, e: Entry, expected: Expected) -> Message:
        """The one message entry `e` carries, of the `expected` kind and of this job.

        Raises:
            DecodeError: refused unread (oversized, too many fields), no message field, not a
                valid message of that kind, or another job's.
        """
        if e.refusal == "big":
            raise DecodeError(
                f"entry of {e.size} bytes exceeds the limit of "
                f"{self.reads.max_entry(stream)} bytes (MAX_MESSAGE_BYTES); refused "
                "without reading it",
                "oversized",
            )
        if e.refusal:
            raise DecodeError(
                f"entry has {e.size} fields; a stream entry carries one ('{FIELD.decode()}')", "malformed"
            )
        raw = message_field(e.fields)
        if raw is None:
            names = sorted(map(str, e.fields or {}))
            raise DecodeError(f"entry has no '{FIELD.decode()}' field (fields: {names})"[:500], "malformed")
        msg = decode(raw, expected, max_bytes=self.reads.max_entry(stream))
        if msg.job_id != self.keys.job_id:
            raise DecodeError(f"message for job '{msg.job_id}' on a stream of job '{self.keys.job_id}'", "wrong_job")
        return msg

    def dead_letter(
        self,
        stream: str,
        group: str | None,
        entry_id: str,
        reason: str,
        raw: bytes = b"",
        *,
        code: str = "rejected",
        message: Message | None = None,
    ) -> None:
        """Move one entry to `{job}:dead` with the reason, then ack it so it is not redelivered.

        `code` is a short fixed word for metrics (shared.schema.REJECT_CODES or the consumer's own).
        `reason` may be anyone's text (a database's error, a decoder's): control characters are
        replaced and it is cut at 4000 characters; `raw` is cut at DEAD_RAW_BYTES. `message`, the
        decoded entry when the consumer has it, stands in for `raw`: encoded whole when it fits,
        else with its bulk (text, token ids, metadata) emptied, so the dead letter still names the
        group member it was (trainer_svc.feeder.dead_members) however long the completion.
        """
        if message is not None:
            raw = encode(message)
            if len(raw) > DEAD_RAW_BYTES:
                raw = encode(_identity(message))
        reason = clean_text(reason)[:4000]
        log.error("dead-lettering %s %s (%s): %s", self.keys.key(stream), entry_id, code, reason[:1000])
        dl = DeadLetter(
            job_id=self.keys.job_id,
            msg_id=dead_letter_id(stream, entry_id),
            policy_version=0,
            stream=stream,
            entry_id=entry_id,
            reason=reason,
            code=code,
            raw=bytes(raw[:DEAD_RAW_BYTES]),
        )
        self.r.xadd(self.keys.key(DEAD), {FIELD: encode(dl), b"reason": reason.encode()[:1024]})
        if group is not None:
            self.r.xack(self.keys.key(stream), group, entry_id)
        if self.on_dead_letter is not None:
            self.on_dead_letter(stream, code)

    def oldest(self, count: int = 100) -> list[DeadLetter]:
        """The oldest `count` dead letters (read in bounded pages); entries on the dead stream that
        are not dead letters (someone else's XADD) are skipped."""
        out: list[DeadLetter] = []
        start = "-"
        while len(out) < count:
            start, rows = self.reads.read(DEAD, "range", count=min(1000, count - len(out)), start=start)
            if not rows:
                break
            for e in rows:
                try:
                    out.append(self.decode(DEAD, e, DeadLetter))  # type: ignore[arg-type]
                except DecodeError as exc:
                    log.warning("skipping %s %s: not a dead letter (%s)", self.keys.key(DEAD), e.entry_id, exc.reason)
        return out
