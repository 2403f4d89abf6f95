"""`asyncrl` command line (typer): the demo and thin clients of the job API.

The job commands only speak HTTP to the API (`--api`, default `$ASYNCRL_API`); an error answer
prints the API's `error` message on stderr and exits 1.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import httpx
import typer
from httpx import TransportError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Column, Table
from rich.text import Text

from broker.guard_report import describe, guard_trips

app = typer.Typer(help="Asynchronous RL post-training: demo and job control.", no_args_is_help=True)

API = typer.Option(
    "http://127.0.0.1:8000", "--api", envvar="ASYNCRL_API", help="Job API base URL."
)
TOKEN = typer.Option(
    None,
    envvar="ASYNCRL_TOKEN",
    help="Bearer token for the job API (read-write for submit, stop and the other changes).",
)
# Mirrors broker.api.TERMINAL_STATES (a test checks it); importing the API here would load
# FastAPI, Redis and SQLAlchemy for a thin HTTP client.
TERMINAL_STATES = frozenset({"finished", "stopped", "failed", "cancelled"})
TIMEOUT_S = 30.0


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _poll(api: str, path: str, token: str | None) -> Any:
    """A watcher's GET: rides out an outage of the API (or of Redis and the ledger behind it) for
    up to asyncrl.http_retry.DEFAULT_OUTAGE_S; exits 1 on a 4xx or when the outage lasts longer."""
    from asyncrl.http_retry import ApiUnavailable, get_json

    try:
        body = get_json(httpx.get, api.rstrip("/") + path, headers=_auth(token), timeout=TIMEOUT_S)
    except ApiUnavailable as exc:
        _fail(str(exc))
    if isinstance(body, dict) and "status_code" in body:
        _fail(str(body.get("error") or body))
    return body


def _call(method: str, api: str, path: str, token: str | None, **kwargs: Any) -> Any:
    """One API request; returns the decoded JSON body.

    Exits 1 with the API's `error` message on an error status, or when the API is unreachable.
    """
    url = api.rstrip("/") + path
    # httpx.get/post/patch rather than httpx.request: tests/broker/test_api_auth.py replaces the
    # module's per-method functions to relay requests to an in-process app.
    send = getattr(httpx, method.lower())
    try:
        r = send(url, headers=_auth(token), timeout=TIMEOUT_S, **kwargs)
    except TransportError as exc:
        _fail(f"cannot reach the job API at {api} ({exc}); set --api or ASYNCRL_API")
    if r.is_error:
        try:
            body = r.json()
        except ValueError:
            body = None
        message = body.get("error") if isinstance(body, dict) else None
        _fail(str(message) if message else f"{method} {url}: HTTP {r.status_code} {r.text[:200]}")
    return r.json()


def _echo_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


def _cell(value: Any, digits: int = 3) -> Text:
    """Table cell text; user data goes in as Text so that rich markup in it is not interpreted."""
    if value is None:
        return Text("-", style="dim")
    if isinstance(value, float):
        return Text(f"{value:.{digits}f}")
    return Text(str(value))


@app.command()
def demo(
    steps: int = typer.Option(50, help="Trainer steps."),
    mode: str = typer.Option("async", help="async or sync."),
    max_staleness: int = typer.Option(1, help="Staleness bound k (async)."),
    generators: int = typer.Option(1, help="Generator processes."),
    workdir: str = typer.Option("runs/demo", help="Models, ledger, logs and the plot go here."),
    seed: int = typer.Option(0),
    placement: str = typer.Option("split", help="split, or colocated (generator and trainer take turns on every "
                                  "core; sync)."),
) -> None:
    """Build a tiny model, warm-start it, and run an RL job with every service as a process."""
    logging.basicConfig(level=logging.WARNING)
    from asyncrl.demo import run_demo

    if placement == "colocated":
        mode = "sync"  # co-located phases alternate
    run_demo(workdir=workdir, steps=steps, mode=mode, max_staleness=max_staleness, generators=generators, seed=seed,
             extra_spec={"placement": placement} if placement != "split" else None)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def bench(ctx: typer.Context) -> None:
    """Benchmarks measured in one run on this machine (`asyncrl bench --help`); `python -m bench`
    runs them: the benchmarks sit above the CLI, which does not import them."""
    os.execv(sys.executable, [sys.executable, "-m", "bench", *ctx.args])


@app.command()
def submit(spec_file: Path, api: str = API, token: str | None = TOKEN) -> None:
    """Submit a job spec (JSON file)."""
    try:
        spec = json.loads(spec_file.read_text())
    except (OSError, ValueError) as exc:
        _fail(f"cannot read the job spec {spec_file}: {exc}")
    _echo_json(_call("POST", api, "/jobs", token, json=spec))


@app.command("list")
def list_jobs(
    limit: int = typer.Option(100, min=1, help="Newest jobs shown."),
    api: str = API,
    token: str | None = TOKEN,
) -> None:
    """The newest jobs: id, name, state, step, created and updated times."""
    jobs = _call("GET", api, "/jobs", token, params={"limit": limit})
    table = Table("id", "name", "state", "step", "created", "updated")
    for job in jobs:
        table.add_row(*(_cell(job[k]) for k in ("id", "name", "state", "step", "created_at", "updated_at")))
    Console().print(table)


def _watch(job_id: str, api: str, token: str | None, interval: float) -> dict[str, Any]:
    """Redraw the job's progress every `interval` seconds until it reaches a terminal state."""
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        TextColumn("{task.fields[state]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}"),
        TextColumn("held-out {task.fields[held_out]}"),
        TextColumn("staleness {task.fields[staleness]}"),
        TextColumn("{task.fields[guard]}", style="bold red"),
    )
    job = _call("GET", api, f"/jobs/{job_id}", token)  # an unknown job fails before drawing
    with progress:
        task = progress.add_task(job_id, total=None, state="", reward="-", held_out="-", staleness="-", guard="")
        while True:
            metrics = job.get("last_metrics") or {}
            evals = [e for e in job.get("evals") or [] if e.get("source") == "pipeline"]
            evals = [e for e in evals if e.get("name", "held_out") == evals[0].get("name", "held_out")]  # first set
            progress.update(
                task,
                description=escape(f"{job['name']} {job_id}"),
                completed=job["step"],
                total=(job.get("spec") or {}).get("steps"),
                state=job["state"],
                reward=_cell(metrics.get("reward/mean")).plain,
                held_out=_cell(evals[-1]["reward_mean"] if evals else None).plain,
                staleness=_cell(metrics.get("off_policy/mean"), digits=2).plain,
                guard=f"guard trips {int(metrics['guard/trips'])}" if metrics.get("guard/trips") else "",
            )
            if job["state"] in TERMINAL_STATES:
                return job
            time.sleep(interval)
            job = _poll(api, f"/jobs/{job_id}", token)


@app.command()
def status(
    job_id: str,
    watch: bool = typer.Option(
        False, "--watch", help="Live progress until the job ends; exits 1 if it failed."
    ),
    interval: float = typer.Option(1.0, min=0.1, help="--watch: seconds between refreshes."),
    api: str = API,
    token: str | None = TOKEN,
) -> None:
    """Show a job's state, step and last metrics (JSON), or watch it live; either way, every
    collapse-guard trip (what it did to the policy) follows on stderr."""
    if not watch:
        _echo_json(_call("GET", api, f"/jobs/{job_id}", token))
        _echo_guard_trips(job_id, api, token)
        return
    job = _watch(job_id, api, token, interval)
    typer.echo(f"job {job_id} {job['state']} at step {job['step']}")
    _echo_guard_trips(job_id, api, token)
    if job["state"] == "failed":
        _fail(job.get("error") or "the job failed")


PAGES = typer.Argument(..., help="The services' Prometheus pages, e.g. http://127.0.0.1:9101/metrics (each "
                       "service serves one on its GEN_/REWARD_/TRAINER_METRICS_PORT).")


@app.command()
def phases(urls: list[str] = PAGES,
           as_json: bool = typer.Option(False, "--json", help="JSON instead of a table.")) -> None:
    """Where a step's time goes: per role and phase (generate, fetch, verify, swap, score, ledger,
    Redis hops, flatten, checksum, serve, probe, learner step, ...), how many spans, their median
    and mean milliseconds, and the total, since each service started."""
    from shared.metrics import phase_summary  # prometheus-client only

    rows = []
    for url in urls:
        try:
            r = httpx.get(url, timeout=TIMEOUT_S)
        except TransportError as exc:
            _fail(f"{url}: {exc}")
        if r.status_code != 200:
            _fail(f"{url}: HTTP {r.status_code}")
        rows += phase_summary(r.text)
    if as_json:
        _echo_json(rows)
        return
    if not rows:
        _fail("no phase timings on those pages (is it a service's metrics port?)")
    table = Table("role", "phase", Column("spans", justify="right"), Column("median ms", justify="right"),
                  Column("mean ms", justify="right"), Column("total s", justify="right"))
    for p in rows:
        table.add_row(str(p["role"]), str(p["phase"]), f"{int(p['count'])}", f"{1000 * float(p['median_s']):.2f}",
                      f"{1000 * float(p['mean_s']):.2f}", f"{float(p['total_s']):.2f}")
    Console().print(table)


def _echo_guard_trips(job_id: str, api: str, token: str | None) -> None:
    """The job's collapse-guard trips from its change log, one line each on stderr (stdout stays
    the JSON a script reads)."""
    trips = guard_trips(_call("GET", api, f"/jobs/{job_id}/changes", token))
    if trips:
        typer.secho(f"collapse guard tripped {len(trips)} time(s):", fg="red", bold=True, err=True)
    for t in trips:
        typer.secho(f"  {describe(t)}", fg="red", err=True)


@app.command()
def stop(job_id: str, api: str = API, token: str | None = TOKEN) -> None:
    """Ask a running job to stop after its current step."""
    _echo_json(_call("POST", api, f"/jobs/{job_id}/stop", token))


@app.command()
def pause(job_id: str, api: str = API, token: str | None = TOKEN) -> None:
    """Pause a job: no new generation, scoring or training; nothing in flight is lost."""
    _echo_json(_call("POST", api, f"/jobs/{job_id}/pause", token))


@app.command()
def resume(job_id: str, api: str = API, token: str | None = TOKEN) -> None:
    """Resume a paused job."""
    _echo_json(_call("POST", api, f"/jobs/{job_id}/resume", token))


@app.command()
def cancel(job_id: str, api: str = API, token: str | None = TOKEN) -> None:
    """Cancel a job now, without finishing the step or evaluating."""
    _echo_json(_call("POST", api, f"/jobs/{job_id}/cancel", token))


@app.command("set")
def set_knobs(
    job_id: str,
    lr: float | None = typer.Option(None, help="Learning rate."),
    max_staleness: int | None = typer.Option(None, help="Staleness bound k (async jobs)."),
    temperature: float | None = typer.Option(None, help="Sampling temperature of new rollouts."),
    top_p: float | None = typer.Option(None, help="Nucleus mass of new rollouts."),
    generation_batch: int | None = typer.Option(None, help="Prompt groups per generate call."),
    api: str = API,
    token: str | None = TOKEN,
) -> None:
    """Change live knobs of a running job; the services apply them at their next step."""
    given = {
        "lr": lr,
        "max_staleness": max_staleness,
        "temperature": temperature,
        "top_p": top_p,
        "generation_batch": generation_batch,
    }
    changes = {k: v for k, v in given.items() if v is not None}
    if not changes:
        _fail("nothing to change: give at least one of " + ", ".join(f"--{k.replace('_', '-')}" for k in given))
    result = _call("PATCH", api, f"/jobs/{job_id}", token, json=changes)
    _echo_json({"id": result["id"], "changed": result["changed"]})


@app.command()
def samples(
    job_id: str,
    status: str | None = typer.Option(None, help="generated, scored, trained, dropped, evaluated or lost."),
    kind: str | None = typer.Option(None, help="train or eval."),
    min_step: int | None = typer.Option(None, help="Lowest step (trainer_version) that used the sample."),
    max_step: int | None = typer.Option(None, help="Highest step (trainer_version) that used the sample."),
    min_staleness: int | None = typer.Option(None),
    max_staleness: int | None = typer.Option(None),
    min_reward: float | None = typer.Option(None),
    max_reward: float | None = typer.Option(None),
    limit: int = typer.Option(20, help="Rows shown (the API allows 1..1000)."),
    offset: int = typer.Option(0, help="Rows skipped, oldest first."),
    api: str = API,
    token: str | None = TOKEN,
) -> None:
    """Browse a job's samples (oldest first) as a table."""
    params = {
        "status": status,
        "kind": kind,
        "min_step": min_step,
        "max_step": max_step,
        "min_staleness": min_staleness,
        "max_staleness": max_staleness,
        "min_reward": min_reward,
        "max_reward": max_reward,
        "limit": limit,
        "offset": offset,
    }
    page = _call(
        "GET", api, f"/jobs/{job_id}/samples", token, params={k: v for k, v in params.items() if v is not None}
    )
    items = page["items"]
    shown = f"{offset + 1}-{offset + len(items)}" if items else "none"
    table = Table(
        Column("msg_id", overflow="fold"),
        "kind",
        "status",
        "step",
        "stale",
        "reward",
        "tokens",
        # Takes the width left over, one line per sample.
        Column("completion", ratio=1, min_width=20, no_wrap=True, overflow="ellipsis"),
        caption=f"samples {shown} of {page['total']}",
        expand=True,
    )
    for s in items:
        table.add_row(
            _cell(s["msg_id"]),
            _cell(s["kind"]),
            _cell(s["status"]),
            _cell(s["trainer_version"]),
            _cell(s["staleness"]),
            _cell(s["reward"]),
            _cell(s["num_completion_tokens"]),
            # One line per sample: newlines shown as the \n escape.
            _cell(s["completion"].replace("\n", "\\n")),
        )
    Console().print(table)


@app.command()
def verify(job_id: str, api: str = API, token: str | None = TOKEN) -> None:
    """Check the job's ledger invariants (nothing lost, nothing trained twice); exits 1 on violations."""
    res = _call("GET", api, f"/jobs/{job_id}/verify", token)
    table = Table("check", "violating rows", title=f"ledger of job {job_id} ({res['job_state']})")
    for check, n in res["checks"].items():
        table.add_row(_cell(check), Text(str(n), style="red" if n else "green"))
    console = Console()
    console.print(table)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(res["counts"].items()))
    console.print(f"samples: {counts or 'none'}; in flight {res['in_flight']}; steps {res['steps']}")
    for f in res["violations"] + res["info"]:
        console.print(Text(f"{f['level']}: {f['check']}: {f['message']}", style="red" if f["level"] == "violation" else "dim"))
    if not res["ok"]:
        raise typer.Exit(1)


# -- admin tasks (the job API hands them to the Celery worker) ------------------------------


def _checkpoint_step(job_id: str, step: int | None, api: str, token: str | None) -> int:
    """`step`, or the newest checkpoint's step when it is None."""
    if step is not None:
        return step
    checkpoints = _call("GET", api, f"/jobs/{job_id}/checkpoints", token)
    if not checkpoints:
        _fail(f"job {job_id} has no checkpoint yet (the trainer writes one every checkpoint_every steps and at the end)")
    return int(checkpoints[-1]["step"])


def _follow_task(task: dict[str, Any], wait: bool, interval: float, api: str, token: str | None) -> None:
    """Print the task; with `wait`, poll it until it ends (exit 1 if it failed) and print the result."""
    if not wait:
        _echo_json(task)
        return
    console = Console(stderr=True)
    with console.status(f"{task['kind']} task {task['id']}: {task['state']}") as spinner:
        while task["state"] not in ("succeeded", "failed"):
            time.sleep(interval)
            task = _poll(api, f"/tasks/{task['id']}", token)
            spinner.update(f"{task['kind']} task {task['id']}: {task['state']} (attempt {task['attempts']})")
    if task["state"] == "failed":
        _fail(f"{task['kind']} task {task['id']} failed: {task['error']}")
    _echo_json(task)


def _submit_admin(
    job_id: str, step: int | None, action: str, body: dict | None, wait: bool, interval: float,
    api: str, token: str | None,
) -> None:
    """POST /jobs/{job}/checkpoints/{step}/{action} (newest checkpoint when `step` is None), then follow it."""
    step = _checkpoint_step(job_id, step, api, token)
    task = _call("POST", api, f"/jobs/{job_id}/checkpoints/{step}/{action}", token, json=body)
    _follow_task(task, wait, interval, api, token)


WAIT = typer.Option(False, "--wait", help="Wait for the task to end and print its result; exits 1 if it failed.")
INTERVAL = typer.Option(1.0, min=0.1, help="--wait: seconds between polls.")
STEP = typer.Option(None, "--step", help="Checkpoint step; default the newest checkpoint.")


@app.command("eval")
def evaluate(
    job_id: str,
    step: int | None = STEP,
    wait: bool = WAIT,
    interval: float = INTERVAL,
    api: str = API,
    token: str | None = TOKEN,
) -> None:
    """Evaluate a checkpoint on the job's held-out set (admin worker; result in the ledger)."""
    _submit_admin(job_id, step, "evaluate", None, wait, interval, api, token)


@app.command()
def export(
    job_id: str,
    step: int | None = STEP,
    name: str | None = typer.Option(
        None, help="Folder under the worker's ADMIN_EXPORT_DIR; default <job id>/step-NNNNNN."
    ),
    wait: bool = WAIT,
    interval: float = INTERVAL,
    api: str = API,
    token: str | None = TOKEN,
) -> None:
    """Export a checkpoint as an HF-format model directory (admin worker)."""
    _submit_admin(job_id, step, "export", {"name": name} if name is not None else None, wait, interval, api, token)


@app.command()
def task(
    task_id: str,
    wait: bool = WAIT,
    interval: float = INTERVAL,
    api: str = API,
    token: str | None = TOKEN,
) -> None:
    """Show an admin task (queued, running, succeeded with its result, failed with the error)."""
    _follow_task(_call("GET", api, f"/tasks/{task_id}", token), wait, interval, api, token)


if __name__ == "__main__":
    app()
