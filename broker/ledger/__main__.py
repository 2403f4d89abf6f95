"""`python -m broker.ledger upgrade [--url URL] [--revision REV]` (see `broker.ledger.cli`)."""

from broker.ledger.cli import main

raise SystemExit(main())
