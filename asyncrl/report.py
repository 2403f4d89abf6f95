"""What a user sees of a job: a progress bar while it waits and runs, and its summary when it ends.

`asyncrl demo`, `asyncrl run` and `asyncrl status --watch` all draw the same bar and print the
same summary, from the job API alone (GET /jobs/{id}, GET /queue, GET /jobs/{id}/summary), so a
job on a remote fleet looks like one on this box.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from asyncrl.http_retry import get_json

# Mirrors broker.api.TERMINAL_STATES (a test checks it); importing the API here would load
# FastAPI, Redis and SQLAlchemy for a thin HTTP client.
TERMINAL_STATES = frozenset({"finished", "stopped", "failed", "cancelled"})
TIMEOUT_S = 30.0


class ApiError(RuntimeError):
    """The job API answered a 4xx (an unknown job, a refused token): its `error` message."""


def api_get(api: str, path: str, headers: Mapping[str, str] | None = None) -> Any:
    """GET `path`'s JSON, riding out an outage of the API (asyncrl.http_retry).

    Raises:
        ApiError: a 4xx answer (the API's message).
        asyncrl.http_retry.ApiUnavailable: the outage outlasted the budget.
    """
    body = get_json(httpx.get, api.rstrip("/") + path, headers=dict(headers or {}), timeout=TIMEOUT_S)
    if isinstance(body, dict) and "status_code" in body:
        raise ApiError(str(body.get("error") or body))
    return body


def fmt(value: Any, digits: int = 3) -> str:
    """A figure as the bar and the summary show it: `-` when there is none."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _queue_place(api: str, job_id: str, headers: Mapping[str, str] | None) -> str:
    """`queued #N: waiting for ...` from GET /queue (just `queued` once a trainer took it)."""
    queued = api_get(api, "/queue", headers).get("queued", [])
    mine = next((q for q in queued if q.get("id") == job_id), None)
    return f"queued #{mine['position']}: waiting for {mine['waiting_for']}" if mine else "queued"


def follow(
    api: str,
    job_id: str,
    *,
    headers: Mapping[str, str] | None = None,
    interval: float = 1.0,
    show: bool = True,
    check: Callable[[], None] | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Draw the job's progress every `interval` seconds until it ends: its place in the queue while
    it waits, then step of steps, train and held-out reward, staleness and guard trips.

    Args:
        check: called every round; what it raises (a local fleet's process died) ends the watch.

    Returns:
        The job's last GET /jobs/{id} body (a terminal state).

    Raises:
        ApiError, ApiUnavailable: as `api_get`.
    """
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        TextColumn("{task.fields[state]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}"),
        TextColumn("held-out {task.fields[held_out]}"),
        TextColumn("staleness {task.fields[staleness]}"),
        TextColumn("{task.fields[guard]}", style="bold red"),
        TimeElapsedColumn(),
        console=console,
        disable=not show,
    )
    job = api_get(api, f"/jobs/{job_id}", headers)  # an unknown job fails before drawing
    with progress:
        task = progress.add_task(job_id, total=None, state="", reward="-", held_out="-", staleness="-", guard="")
        while True:
            metrics = job.get("last_metrics") or {}
            evals = [e for e in job.get("evals") or [] if e.get("source") == "pipeline"]
            evals = [e for e in evals if e.get("name", "held_out") == evals[0].get("name", "held_out")]  # first set
            state = job["state"]
            if state == "queued":
                state = _queue_place(api, job_id, headers)
            progress.update(
                task,
                description=escape(f"{job['name']} {job_id}"),
                completed=job["step"],
                total=(job.get("spec") or {}).get("steps"),
                state=escape(state),
                reward=fmt(metrics.get("reward/mean")),
                held_out=fmt(evals[-1]["reward_mean"] if evals else None),
                staleness=fmt(metrics.get("off_policy/mean"), digits=2),
                guard=f"guard trips {int(metrics['guard/trips'])}" if metrics.get("guard/trips") else "",
            )
            if job["state"] in TERMINAL_STATES:
                return job
            if check is not None:
                check()
            time.sleep(interval)
            job = api_get(api, f"/jobs/{job_id}", headers)


def _mean(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def show_summary(summary: Mapping[str, Any], wall_s: float, console: Console | None = None) -> None:
    """Print a job's summary (broker.job_summary, or GET /jobs/{id}/summary): reward and staleness
    per block of steps, the held-out curve, staleness and sample counts, the collapse guard's
    trips, weight swap latency and steady-state throughput."""
    console = console or Console()
    steps = summary["per_step"]
    held = {int(s): r for s, r in summary["held_out"]}
    table = Table(title=f"job {summary['job_id']}: reward and staleness per block of steps")
    for col in ("steps", "train reward", "held-out reward (at end)", "staleness mean / max", "dropped"):
        table.add_column(col, justify="right")
    block = max(1, len(steps) // 10)
    for lo in range(0, len(steps), block):
        chunk = steps[lo : lo + block]
        last = chunk[-1]["step"]
        top = [int(s["off_policy/max"]) for s in chunk if s["off_policy/max"] is not None]
        table.add_row(
            f"{chunk[0]['step']}-{last}",
            fmt(_mean([s["reward/mean"] for s in chunk])),
            fmt(held.get(last)),
            f"{fmt(_mean([s['off_policy/mean'] for s in chunk]), 2)} / {max(top) if top else '-'}",
            str(sum(int(s["off_policy/dropped"] or 0) for s in chunk)),
        )
    console.print(table)
    if summary["held_out"]:
        console.print("held-out reward: " + " -> ".join(f"{r:.2f} (step {s})" for s, r in summary["held_out"]))
    console.print(f"staleness of trained samples (versions: count): {summary['staleness_histogram']}")
    console.print(f"samples by status: {summary['sample_status']}")
    # every collapse-guard trip (a roll-back, a kept policy or a restart changes what the curves
    # above mean)
    trips = summary["guard_trips"]
    if trips:
        console.print(f"[bold red]collapse guard tripped {len(trips)} time(s):[/]")
        for line in trips:
            console.print(f"  [red]{escape(line)}[/]")
    else:
        console.print("collapse guard: no trips")
    if summary["swap_latency_s_median"] is not None:
        console.print(
            f"weight swap, publish -> every generator ({summary['generators']}) serving it: "
            f"median {summary['swap_latency_s_median']:.3f} s, max {summary['swap_latency_s_max']:.3f} s"
        )
    console.print(
        f"throughput (steady state): {summary['samples_per_s']:.1f} samples/s, "
        f"{summary['tokens_per_s']:.0f} tokens/s, {summary['mean_step_s']:.2f} s/step; wall time {wall_s:.0f} s"
    )


def plot(summary: Mapping[str, Any], out: Path) -> Path:
    """Reward (train, held-out) and staleness (mean, max) per step, as a PNG at `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nan = float("nan")
    steps = summary["per_step"]
    xs = [s["step"] for s in steps]

    def column(key: str) -> list[float]:
        return [nan if s[key] is None else s[key] for s in steps]

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(xs, column("reward/mean"), label="train reward (sampled)", alpha=0.6)
    if summary["held_out"]:
        ax1.plot(*zip(*summary["held_out"], strict=True), "o-", label="held-out reward (greedy)")
    ax1.set_ylabel("reward")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend(loc="lower right")
    ax2.plot(xs, column("off_policy/mean"), label="staleness mean")
    ax2.plot(xs, column("off_policy/max"), label="staleness max", linestyle="--")
    ax2.set_ylabel("policy versions")
    top = max([s["off_policy/max"] for s in steps if s["off_policy/max"] is not None] + [1.0])
    ax2.set_ylim(-0.05, top * 1.6)  # room for the legend above the curves
    ax2.set_xlabel("trainer step")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
