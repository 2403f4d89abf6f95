"""Migration 0007: a job's samples page by (job_id, id), not by walking other jobs' rows."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import psycopg
from sqlalchemy.engine import make_url

from broker.ledger import Ledger

# Another job's rows ahead of the paged one (the planner needs enough of them to prefer an index).
_FILL = """
INSERT INTO samples (msg_id, job_id, group_id, sample_index, kind, prompt_index, generator_id, gen_version_min,
    gen_version_max, num_prompt_tokens, num_completion_tokens, completion, status, created_at)
SELECT %(job)s || '/' || i, %(job)s, 'g' || i, 0, 'train', i, 'gen-0', 0, 0, 5, 9, 'text', 'trained', now()
FROM generate_series(1, %(n)s) AS i
"""


def test_a_jobs_first_page_uses_the_job_order_index(
    postgres_database: Callable[[], AbstractContextManager[str]],
) -> None:
    with postgres_database() as url:
        ledger = Ledger(url)
        try:
            for job in ("old", "new"):
                ledger.create_job(job, job, {})
            dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(_FILL, {"job": "old", "n": 50_000})
                conn.execute(_FILL, {"job": "new", "n": 100})
                conn.execute("ANALYZE samples")
                indexes = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'samples'")}
                plan = "\n".join(
                    r[0]
                    for r in conn.execute("EXPLAIN SELECT * FROM samples WHERE job_id = 'new' ORDER BY id LIMIT 50")
                )
            assert "ix_samples_job_id_id" in indexes
            assert "ix_samples_job_id_id" in plan, plan
            page = ledger.samples("new", limit=50)
            assert [s["msg_id"] for s in page] == [f"new/{i}" for i in range(1, 51)]
        finally:
            ledger.close()
