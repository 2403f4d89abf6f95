"""Fixtures of the trainer's tests on real Redis."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from broker.streams import JobStreams, connect


@pytest.fixture
def streams() -> Iterator[JobStreams]:
    """Job `job1`'s streams under a fresh key prefix on the real Redis, deleted afterwards."""
    s = JobStreams(
        connect(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")), "job1", prefix=f"test-{uuid.uuid4().hex}:"
    )
    yield s
    s.delete_all()
