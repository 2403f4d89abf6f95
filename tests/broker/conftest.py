"""Ledger database fixtures: a fresh SQLite file and a fresh PostgreSQL database per test
(PostgreSQL databases come from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

from broker.ledger import Ledger


@pytest.fixture
def pg_url(postgres_database: Callable[[], AbstractContextManager[str]]) -> Iterator[str]:
    """URL of a newly created, uniquely named PostgreSQL database, dropped afterwards."""
    with postgres_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A URL of an empty ledger database, once per backend."""
    if request.param == "sqlite":
        # A subdirectory that does not exist yet: the Ledger creates it.
        return f"sqlite:///{tmp_path}/runs/ledger.db"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def ledger(ledger_url: str) -> Iterator[Ledger]:
    """A migrated Ledger on each backend."""
    with Ledger(ledger_url) as led:
        yield led
