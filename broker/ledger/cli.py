"""`python -m broker.ledger upgrade [--url URL] [--revision REV]`: migrate a ledger database."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

from broker.ledger.core import Ledger

__all__ = ["main"]

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m broker.ledger upgrade [--url URL] [--revision REV]`."""
    parser = argparse.ArgumentParser(prog="python -m broker.ledger", description="Ledger database maintenance.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upgrade", help="migrate the ledger database to a revision (default head)")
    up.add_argument(
        "--url",
        default=os.environ.get("DATABASE_URL"),
        required="DATABASE_URL" not in os.environ,
        help="SQLAlchemy URL (default: $DATABASE_URL)",
    )
    up.add_argument("--revision", default="head")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    ledger = Ledger(args.url, migrate=False)
    try:
        ledger.upgrade(args.revision)
        log.info("ledger %r at revision %s", ledger, ledger.current_revision())
    finally:
        ledger.close()
    return 0
