"""results/hostile.json: the hostile-input suite's figures, merged by the tests that measure them.

    from hostile_results import record_hostile   # tests/ is on sys.path
    record_hostile(good_lost=0, good_dead_lettered=0, service_exits=0, peak_rss_mib=212.0)
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

HOSTILE_RESULTS = Path(__file__).resolve().parent.parent / "results" / "hostile.json"


def record_hostile(**figures: Any) -> None:
    """Merge figures into results/hostile.json (the hostile-input suite's results file).

    Counters (`good_lost`, `good_dead_lettered`, `service_exits`, `server_errors`,
    `schemathesis_cases`) add up over the tests that report them; `peak_rss_mib` keeps the
    largest; anything else is set. Each call also stamps `machine` and `date`. Safe across
    processes (an flock on a side file).
    """
    import platform

    HOSTILE_RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(HOSTILE_RESULTS.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(HOSTILE_RESULTS.read_text()) if HOSTILE_RESULTS.exists() else {}
        except ValueError:
            data = {}
        for key, value in figures.items():
            if key in ("good_lost", "good_dead_lettered", "service_exits", "server_errors", "schemathesis_cases"):
                data[key] = data.get(key, 0) + value
            elif key == "peak_rss_mib":
                data[key] = max(data.get(key, 0), value)
            else:
                data[key] = value
        data["machine"] = {"cores": len(os.sched_getaffinity(0)), "python": platform.python_version()}
        data["date"] = time.strftime("%Y-%m-%d")
        HOSTILE_RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
