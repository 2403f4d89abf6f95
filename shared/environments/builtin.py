"""The single-turn environment: one model turn, no reply (the behaviour of a job without one)."""

from __future__ import annotations

from shared.environments.base import ModelTurn, Opening, Row, StepResult, row_messages
from shared.tasks import Problem


class SingleTurnEnv:
    """The row's prompt (its messages if it has any), one model turn, done."""

    def start(self, row: Row) -> Opening:
        has_messages = row.messages if isinstance(row, Problem) else row.get("messages")
        if has_messages:
            return row_messages(row)
        # A plain string, so a template-less tokenizer sees exactly the prompt, as shared.prompts renders it.
        return row.prompt if isinstance(row, Problem) else str(row.get("prompt", ""))

    def step(self, turn: ModelTurn) -> StepResult:
        return StepResult(done=True)
