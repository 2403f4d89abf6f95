"""Bad dataset rows and hostile dataset shapes (issue 31): every kind either fails the job at load
naming the file and the row (or the limit) before step 0, or, with `task.bad_rows: drop`, is left
out and the job runs; and loading stays within a memory bound whatever the file's shape.

Each probe loads its file the way a job's trainer does (shared.datasets.load_task) in a child
process, with both bad_rows settings, and reports the child's peak RSS. The default run uses small
versions (seconds); `pytest -m bench` runs the issue's sizes (a 200 MB single-line prompt, a 25 MB
CSV of 5M rows, a 2 GiB sparse file, a 10 MB CSV of 100k columns, 1M-deep nesting).

Figures (results/hostile.json): `bad_row_jobs_failed` (the probes and the real job below that ended
otherwise; docs/reliability.md defines it) and `dataset_<probe>_peak_rss_mib` / `peak_rss_mib`,
each under RSS_LIMIT_MIB.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hostile_results import record_hostile  # tests/ is on sys.path
from shared_fleet import Fleet

REPO = Path(__file__).resolve().parent.parent
RSS_LIMIT_MIB = 1024
"""The loader's peak RSS on every probe, imports included (docs/reliability.md)."""
GOOD_ROWS = 1000
BAD_LINE = 500  # the bad row's line in the JSON Lines probes

# Runs in the child: load the task with both bad_rows settings, say what happened and the peak RSS.
CHILD = r"""
import json, resource, sys
from shared.datasets import DatasetError, TaskSpec, load_task
task = json.loads(sys.argv[1])
out = {}
for mode in ("reject", "drop"):
    try:
        train, test = load_task(TaskSpec.model_validate({**task, "bad_rows": mode}), 0)
        out[mode] = {"rows": len(train) + len(test)}
    except DatasetError as e:
        out[mode] = {"error": str(e)[:1000]}
# VmHWM: this process image's own peak (ru_maxrss keeps the forking parent's peak across exec)
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
kib = int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out["peak_rss_mib"] = kib / 1024
print(json.dumps(out))
"""


def _jsonl_with(path: Path, bad: bytes) -> Path:
    with path.open("wb") as f:
        for i in range(GOOD_ROWS):
            if i == BAD_LINE - 1:
                f.write(bad + b"\n")
            f.write(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}).encode() + b"\n")
    return path


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _huge_line(path: Path, full: bool) -> Path:
    size = 200_000_000 if full else 16 << 20
    with path.open("wb") as f:
        for i in range(GOOD_ROWS):
            if i == BAD_LINE - 1:
                f.write(b'{"prompt": "')
                for _ in range(size >> 20):
                    f.write(b"x" * (1 << 20))
                f.write(b'", "answer": 1}\n')
            f.write(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}).encode() + b"\n")
    return path


def _wide_csv(path: Path, full: bool) -> Path:
    cols = 100_000  # 10 MB either way: refused at the header, before a row is read
    with path.open("w") as f:
        f.write(",".join(["prompt", "answer", *(f"c{i}" for i in range(cols))]) + "\n")
        row = "1+1=,2," + ",".join("0" * cols) + "\n"
        for _ in range(48):
            f.write(row)
    return path


def _many_rows_csv(path: Path, full: bool) -> Path:
    with path.open("w") as f:
        f.write("prompt,answer\n")
        f.writelines(f"{i % 100}+,{i % 7}\n" for i in range(5_000_000 if full else 300_000))
    return path


def _sparse(path: Path, full: bool) -> Path:
    with path.open("wb") as f:
        f.truncate((2 << 30) - 1 if full else 256 << 20)  # under task.max_bytes (2 GiB): zeros, no newline
    return path


@dataclass(frozen=True)
class Probe:
    name: str
    file: str
    write: Callable[[Path, bool], Path]
    reject: str  # what the reject run's error must say after the file's name (a row or a limit)
    drop: str | None  # None: the drop run loads every good row; else what its error says
    task: dict[str, Any] | None = None  # extra task fields, by size ("ci" / "full")


PROBES = [
    Probe(
        "lone_surrogate",
        "surrogate.jsonl",
        lambda p, full: _jsonl_with(p, b'{"prompt": "\\ud800=", "answer": 1}'),
        rf" line {BAD_LINE}: field 'prompt': a lone surrogate",
        None,
    ),
    Probe(
        "invalid_utf8",
        "latin1.jsonl",
        lambda p, full: _jsonl_with(p, b'{"prompt": "caf\xe9", "answer": 1}'),
        rf" line {BAD_LINE}: not UTF-8",
        None,
    ),
    Probe(
        "deep_nesting",
        "deep.jsonl",
        lambda p, full: _jsonl_with(
            p, b'{"prompt": "x", "answer": 1, "m": ' + _nested(10**6 if full else 10**5) + b"}"
        ),
        rf" line {BAD_LINE}: JSON nested too deeply",
        None,
    ),
    Probe("huge_line", "huge_line.jsonl", _huge_line, rf" line {BAD_LINE}: longer than task.max_row_bytes", None),
    Probe(
        "wide_csv",
        "wide.csv",
        _wide_csv,
        r" has 100002 columns, over task.max_columns=1000",
        r" has 100002 columns, over task.max_columns=1000",
    ),
    Probe(
        "many_rows_csv",
        "rows.csv",
        _many_rows_csv,
        r" has more rows than task.max_rows=",
        r" has more rows than task.max_rows=",
        {"ci": {"max_rows": 100_000}, "full": {}},
    ),
    Probe(
        "sparse_file",
        "sparse.jsonl",
        _sparse,
        r" line 1: longer than task.max_row_bytes",
        r": every row is bad \(1 dropped\)",
    ),
]


def _run(probe: Probe, tmp: Path, size: str) -> tuple[dict[str, Any], list[str]]:
    """The probe's child result and how it went wrong (empty: handled)."""
    path = probe.write(tmp / probe.file, size == "full")
    task = {"path": str(path), "n_test": 10, **(probe.task or {}).get(size, {})}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(task)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        return {}, [f"{probe.name}: the load hung (10 min)"]
    finally:
        path.unlink()
    if proc.returncode != 0:  # killed (OOM) or an exception that is not a DatasetError naming the row
        return {}, [f"{probe.name}: the loader exited {proc.returncode}: {proc.stderr[-1500:]}"]
    out = json.loads(proc.stdout.splitlines()[-1])
    wrong = []
    if not re.match(re.escape(str(path)) + probe.reject, out["reject"].get("error", "")):
        wrong.append(f"{probe.name} reject: {out['reject']}")
    if probe.drop is None:
        if out["drop"].get("rows") != GOOD_ROWS:
            wrong.append(f"{probe.name} drop: {out['drop']}")
    elif not re.match(re.escape(str(path)) + probe.drop, out["drop"].get("error", "")):
        wrong.append(f"{probe.name} drop: {out['drop']}")
    return out, wrong


@pytest.mark.hostile
@pytest.mark.parametrize("size", ["ci", pytest.param("full", marks=pytest.mark.bench)])
def test_every_bad_row_kind_is_named_or_dropped_within_the_memory_bound(tmp_path: Path, size: str) -> None:
    figures: dict[str, float] = {}
    failed: list[str] = []
    for probe in PROBES:
        out, wrong = _run(probe, tmp_path, size)
        failed += wrong
        if out:
            figures[f"dataset_{probe.name}_peak_rss_mib"] = round(out["peak_rss_mib"], 1)
    record_hostile(
        bad_row_jobs_failed=len(failed),
        peak_rss_mib=max(figures.values(), default=0.0),
        dataset_probe_size=size,
        dataset_rss_limit_mib=RSS_LIMIT_MIB,
        **figures,
    )
    assert not failed, "\n".join(failed)
    over = {k: v for k, v in figures.items() if v > RSS_LIMIT_MIB}
    assert not over, over


@pytest.mark.hostile
@pytest.mark.integration
def test_a_bad_row_job_fails_at_load_naming_the_row_and_the_next_job_runs(fleet: Fleet) -> None:
    data = _jsonl_with(fleet.tmp / "bad_rows.jsonl", b'{"prompt": "\\ud800=", "answer": 1}')
    bad = fleet.submit("bad-row", task={"path": str(data), "n_test": 8, "n_train": 64})
    good = fleet.submit("after-bad-row", steps=1)
    failed = fleet.wait(bad)
    handled = (
        failed["state"] == "failed"
        and failed["step"] == 0  # at load, before step 0: nothing was trained
        and f"bad_rows.jsonl line {BAD_LINE}: field 'prompt': a lone surrogate" in (failed["error"] or "")
        and fleet.alive()
    )
    record_hostile(bad_row_jobs_failed=0 if handled else 1)
    assert handled, failed
    assert fleet.wait(good)["state"] == "finished"
