"""The SQL ledger: the source of truth for jobs, samples, policy versions and train steps.

Redis is only the transport; every fact a job's history depends on lands here, keyed so that a
redelivered message has no second effect. Each process (generator, reward, trainer, API) opens its
own `Ledger`; all of them write concurrently.

Contract for every write method: one transaction per call, many rows per call, idempotent.
Only plain dicts cross the boundary (their shapes in `rows`); no ORM object escapes the package.

SQLite (default) and PostgreSQL (production) are supported. The schema is owned by the Alembic
migrations in `broker/migrations`; the models (`models`) must match them (a test compares the two).

The package: `models` (tables), `engine` (engine, SQLite/PostgreSQL set-up, migrations), `rows`
(row shapes and enumerations), one repository module per family of tables (`jobs`, `changes`,
`samples`, `versions`, `steps`, `evals`, `admin_tasks`), `audit` (the queries of
`broker.verify`), `isolation` (`write_isolating`), `roles` (`GeneratorLedger`, `RewardLedger`,
`TrainerLedger`: each service's view of the ledger, as a `Protocol`), `core` (`Ledger`, all of
them over one database) and `cli`. Operators migrate an existing database with::

    python -m broker.ledger upgrade --url postgresql+psycopg://user@host/db
"""

from __future__ import annotations

from broker.ledger.cli import main
from broker.ledger.core import Ledger
from broker.ledger.engine import MIGRATIONS_DIR
from broker.ledger.isolation import row_error, write_isolating
from broker.ledger.models import (
    AdminTask,
    Base,
    Checkpoint,
    Eval,
    GeneratorLoad,
    Job,
    JobChange,
    PolicyVersion,
    Sample,
    StepInput,
    TrainStep,
    UTCDateTime,
)
from broker.ledger.roles import GeneratorLedger, RewardLedger, TrainerLedger
from broker.ledger.rows import (
    ADMIN_TASK_KINDS,
    ADMIN_TASK_STATES,
    EVAL_SOURCES,
    JOB_STATES,
    REWARD_STATUSES,
    SAMPLE_KINDS,
    SAMPLE_STATUSES,
    USED_STATUSES,
)

__all__ = [
    "ADMIN_TASK_KINDS",
    "ADMIN_TASK_STATES",
    "EVAL_SOURCES",
    "JOB_STATES",
    "MIGRATIONS_DIR",
    "REWARD_STATUSES",
    "SAMPLE_KINDS",
    "SAMPLE_STATUSES",
    "USED_STATUSES",
    "AdminTask",
    "Base",
    "Checkpoint",
    "Eval",
    "GeneratorLedger",
    "GeneratorLoad",
    "Job",
    "JobChange",
    "Ledger",
    "PolicyVersion",
    "RewardLedger",
    "Sample",
    "StepInput",
    "TrainStep",
    "TrainerLedger",
    "UTCDateTime",
    "main",
    "row_error",
    "write_isolating",
]
