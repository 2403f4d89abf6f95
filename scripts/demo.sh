#!/usr/bin/env bash
# Set up .venv and run the demo RL job on a tiny locally built model. Needs no Redis or database
# set-up: REDIS_URL if set, else a local Redis, else a private redis-server; the ledger is SQLite.
# Extra args go to `asyncrl demo` (e.g. --steps 100 --mode sync).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m asyncrl.cli demo "$@"
