"""Alembic environment for the ledger.

Two ways in: `Ledger.upgrade()` passes an open connection (already inside its transaction and,
on PostgreSQL, holding the migration advisory lock) through `config.attributes["connection"]`;
the alembic CLI passes a URL (`-x url=...` or $DATABASE_URL).
"""

from __future__ import annotations

import os
from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import create_engine, pool

from broker.ledger import Base

config = context.config
target_metadata = Base.metadata

# Only the CLI has an ini file; inside a service, leave the application's logging alone.
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = (
        context.get_x_argument(as_dictionary=True).get("url")
        or os.environ.get("DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise SystemExit("no database URL: pass -x url=... or set DATABASE_URL")
    return url


def _configure(**kwargs: Any) -> None:
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=True,
        **kwargs,
    )


def run_offline() -> None:
    _configure(url=_url(), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        # Joins the caller's transaction; the caller commits.
        with context.begin_transaction():
            context.run_migrations()
        return
    # The alembic CLI (mostly `revision --autogenerate`); services use Ledger.upgrade(), which
    # adds cross-process locking.
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as conn:
        _configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
