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


COUNTERS = (
    "good_lost",
    "good_dead_lettered",
    "service_exits",
    "server_errors",
    "schemathesis_cases",
    "patch_lost_updates",
    "terminal_state_overwritten",
    "bad_row_jobs_failed",
    "forged_rollout_jobs_failed",
    "crash_loops",
    "redis_empty_restart_stalled",
    "all_rewards_error_jobs_finished",
)
PEAKS = (
    "peak_rss_mib",
    "http_gzip_bomb_peak_rss_mib",
    # tests/test_bad_rows.py: the loader's peak RSS per dataset probe (the bench size's, when it ran)
    "dataset_lone_surrogate_peak_rss_mib",
    "dataset_invalid_utf8_peak_rss_mib",
    "dataset_deep_nesting_peak_rss_mib",
    "dataset_huge_line_peak_rss_mib",
    "dataset_wide_csv_peak_rss_mib",
    "dataset_many_rows_csv_peak_rss_mib",
    "dataset_sparse_file_peak_rss_mib",
)


def record_hostile(**figures: Any) -> None:
    """Merge figures into results/hostile.json (the hostile-input suite's results file).

    Each test's figures are kept under `by_test` (the calling test's id, from pytest), replacing
    what that test wrote before, so a rerun does not count twice. The top-level figures are
    recomputed from them: counters (`COUNTERS`) are summed over the tests, peaks (`PEAKS`) are the
    largest, anything else is the latest value written. Each call also stamps `machine` and
    `date`. Safe across processes (an flock on a side file).
    """
    import platform

    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    HOSTILE_RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(HOSTILE_RESULTS.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(HOSTILE_RESULTS.read_text()) if HOSTILE_RESULTS.exists() else {}
        except ValueError:
            data = {}
        by_test = data.get("by_test", {})
        by_test[test] = {**by_test.get(test, {}), **figures}
        out: dict[str, Any] = {k: v for k, v in data.items() if k not in (*COUNTERS, *PEAKS, "by_test")}
        out.update({k: v for k, v in figures.items() if k not in (*COUNTERS, *PEAKS)})
        for key in COUNTERS:
            vals = [t[key] for t in by_test.values() if key in t]
            if vals:
                out[key] = sum(vals)
        for key in PEAKS:
            vals = [t[key] for t in by_test.values() if key in t]
            if vals:
                out[key] = max(vals)
        out["by_test"] = by_test
        out["machine"] = {"cores": len(os.sched_getaffinity(0)), "python": platform.python_version()}
        out["date"] = time.strftime("%Y-%m-%d")
        HOSTILE_RESULTS.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
