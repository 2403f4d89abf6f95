#!/usr/bin/env bash
# Run the test suite on a fresh machine: set up .venv, make sure Redis and PostgreSQL answer
# (installing/starting them from Debian if needed), then pytest. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
export TEST_POSTGRES_URL=${TEST_POSTGRES_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/test}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy shared broker generator_svc reward_svc trainer_svc asyncrl
set +e
# Benchmarks run end to end (-m bench) are for bench/; the compose tier (-m compose, scripts/compose-test.sh,
# ~16-30 min) runs before a change to deploy/ is resolved: neither is in the default run.
# --durations: every run names the tests that cost its time
.venv/bin/python -m pytest -m "not gpu and not bench and not compose" --durations=25 "$@"
rc=$?
set -e
# pytest exit code 5 = no tests collected (e.g. a -k filter that matches nothing): not a failure.
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"
