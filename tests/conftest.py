"""Fixtures shared by every test package: a fresh PostgreSQL database on demand, and one standing
fleet of real services for the session (tests/shared_fleet.py).

PostgreSQL runs on this machine kind; when it is unreachable the PostgreSQL cases fail (they are
never skipped). Point `TEST_POSTGRES_URL` at another server's admin database to use it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from shared_fleet import Fleet, standing_fleet  # tests/ is on sys.path
from sqlalchemy.engine import make_url

PG_ADMIN_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _libpq_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
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
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def postgres_database() -> Callable[[], AbstractContextManager[str]]:
    """A factory of fresh databases, usable from fixtures of any scope: `with postgres_database() as url`."""
    return fresh_postgres_database


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One standing fleet (broker, generator, reward service, trainer; SQLite ledger) for every test
    that only needs real jobs to run: its vLLM engine is built once per session. Do not kill or
    reconfigure its processes from a test."""
    with standing_fleet(tmp_path_factory.mktemp("fleet")) as f:
        yield f


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's warm-started tiny model (asyncrl.demo.prepare_model, seed 0: ~30 s, once a session)."""
    from asyncrl.demo import prepare_model

    return prepare_model(tmp_path_factory.mktemp("demo-model"), seed=0)
