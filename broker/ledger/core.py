"""`Ledger`: every repository of the package over one database, one instance per process."""

from __future__ import annotations

from sqlalchemy.engine import URL, Engine

from broker.ledger.admin_tasks import AdminTaskRepository
from broker.ledger.audit import AuditRepository
from broker.ledger.changes import ChangeRepository
from broker.ledger.engine import Database
from broker.ledger.evals import EvalRepository
from broker.ledger.jobs import JobRepository
from broker.ledger.samples import SampleRepository
from broker.ledger.steps import StepRepository
from broker.ledger.versions import VersionRepository

__all__ = ["Ledger"]


class Ledger(
    JobRepository,
    ChangeRepository,
    SampleRepository,
    VersionRepository,
    StepRepository,
    EvalRepository,
    AdminTaskRepository,
    AuditRepository,
):
    """Synchronous access to the ledger database, one instance per process.

    The repositories it is made of share one `Database` and define disjoint methods; each is
    usable alone over a `Database` as well.

    Args:
        url: SQLAlchemy URL, e.g. ``sqlite:///runs/ledger.db`` (parent directory created) or
            ``postgresql+psycopg://user@host/db`` (a bare ``postgresql://`` means psycopg 3).
        migrate: run Alembic ``upgrade head`` first. Safe when several processes start at once
            (PostgreSQL: advisory lock; SQLite: the database write lock).

    Raises:
        ValueError: the URL's backend is neither SQLite nor PostgreSQL.
    """

    def __init__(self, url: str | URL, *, migrate: bool = True) -> None:
        super().__init__(Database(url))
        self.url: URL = self._db.url
        self.engine: Engine = self._db.engine
        if migrate:
            self.upgrade()

    def close(self) -> None:
        """Close every pooled connection."""
        self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.url.render_as_string(hide_password=True)!r})"

    def upgrade(self, revision: str = "head") -> None:
        """Run Alembic migrations up to `revision` in one transaction, serialised across processes.

        A database already at `revision` is left untouched.
        """
        self._db.upgrade(revision)

    def current_revision(self) -> str | None:
        """The Alembic revision the database is at; None before the first migration."""
        return self._db.current_revision()
