"""results/correctness.json: the correctness gates' figures, one key each, written by several
benches (golden curve, step time, async bench, logprob match, importance weights, replay)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def update_correctness(out: Path, values: dict[str, Any]) -> dict[str, Any]:
    """Set `values` in `out`/correctness.json, keeping every other key; returns the whole file."""
    path = out / "correctness.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update(values)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    return merged
