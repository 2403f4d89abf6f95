"""Ledger database fixtures: a fresh SQLite file and a fresh PostgreSQL database per test.

PostgreSQL runs on this machine kind; when it is unreachable the PostgreSQL cases fail (they are
never skipped). Point `TEST_POSTGRES_URL` at another server's admin database to use it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from broker.ledger import Ledger

PG_ADMIN_URL = os.environ.get(
    "TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def _libpq_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def pg_url() -> Iterator[str]:
    """URL of a newly created, uniquely named PostgreSQL database, dropped afterwards."""
    name = f"ledger_test_{uuid.uuid4().hex[:12]}"
    admin = _libpq_dsn(PG_ADMIN_URL)
    with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
            # FORCE: a leaked pool connection must not leave the database behind.
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


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
