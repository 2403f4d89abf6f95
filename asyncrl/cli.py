"""`asyncrl` command line (typer): the demo, `asyncrl run`, and thin clients of the job API.

The job commands only speak HTTP to the API (`--api`, default `$ASYNCRL_API`); an error answer
prints the API's `error` message on stderr and exits 1. `asyncrl run` also starts a fleet on this
box (asyncrl/local.py) when no API answers and none was named.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import httpx
import typer
from httpx import TransportError
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from asyncrl.report import TERMINAL_STATES, TIMEOUT_S, follow
from broker.guard_report import describe, guard_trips

app = typer.Typer(help="Asynchronous RL post-training: demo and job control.", no_args_is_help=True)

DEFAULT_API = "http://127.0.0.1:8000"
API = typer.Option(DEFAULT_API, "--api", envvar="ASYNCRL_API", help="Job API base URL.")
TOKEN = typer.Option(
    None,
    envvar="ASYNCRL_TOKEN",
    help="Bearer token for the job API (read-write for submit, stop and the other changes).",
)
__all__ = ["TERMINAL_STATES", "app"]


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _poll(api: str, path: str, token: str | None) -> Any:
    """A watcher's GET: rides out an outage of the API (or of Redis and the ledger behind it) for
    up to asyncrl.http_retry.DEFAULT_OUTAGE_S; exits 1 on a 4xx or when the outage lasts longer."""
    from asyncrl.report import api_get

    try:
        return api_get(api, path, _auth(token))
    except RuntimeError as exc:  # ApiError, ApiUnavailable
        _fail(str(exc))


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


def _percent(fraction: float | None) -> Text:
    """A fraction as a percentage cell, red when it is not 0 ("-": nothing to count yet)."""
    if fraction is None:
        return Text("-", style="dim")
    return Text(f"{fraction:.1%}", style="red" if fraction else "")


def _skewed(warnings: list[str]) -> Text:
    """What dropping biases, as a cell: the quantities its warnings name, in yellow ("-": nothing)."""
    if not warnings:
        return Text("-", style="dim")
    return Text(", ".join(w.split(":", 1)[0].removeprefix("dropping biases ") for w in warnings), style="yellow")


def _cell(value: Any, digits: int = 3) -> Text:
    """Table cell text; user data goes in as Text so that rich markup in it is not interpreted."""
    if value is None:
        return Text("-", style="dim")
    if isinstance(value, float):
        return Text(f"{value:.{digits}f}")
    return Text(str(value))


def _served_by(served: dict[str, list[str]]) -> Text:
    """Which services serve a job, by role: "generator g0, g1; reward r0" ("-": none)."""
    if not served:
        return Text("-", style="dim")
    return Text("; ".join(f"{role} {', '.join(ids)}" for role, ids in sorted(served.items())))


def _service_jobs(member: dict[str, Any]) -> Text:
    """The jobs a service serves, each with its share and work when its beacon says them:
    "a1 (share 2, 1.5 s, 300 tok)" ("-": idle). An entry from before `jobs` names one `job`."""
    jobs = member.get("jobs") or ([member["job"]] if member.get("job") else [])
    if not jobs:
        return Text("-", style="dim")
    load = member.get("load") or {}
    parts = []
    for job in jobs:
        done = load.get(job)
        parts.append(
            f"{job} (share {done['share']:g}, {done['seconds']:.1f} s, {done['tokens']} tok)" if done else str(job)
        )
    return Text(", ".join(parts))


def quiet_logging() -> None:
    """Logging of a command run at a terminal (demo, run): warnings and errors only, of any
    library; the libraries' INFO lines (alembic's per migration plugin and context, when the demo
    migrates its ledger) stay off the user's terminal. The services and the model tools the demo
    runs write everything to their own log files (asyncrl.launch.Supervisor, asyncrl.demo.run_tool)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("alembic", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # `kill -USR1 <pid>`: every thread's stack to stderr, where a stuck command is stuck (as the
    # services); not where stderr is no file (a command invoked in-process, as typer's CliRunner does)
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


@app.command()
def demo(
    steps: int = typer.Option(50, help="Trainer steps."),
    mode: str = typer.Option("async", help="async or sync."),
    max_staleness: int = typer.Option(1, help="Staleness bound k (async)."),
    generators: int = typer.Option(1, help="Generator processes."),
    workdir: str = typer.Option("runs/demo", help="Models, ledger, logs and the plot go here."),
    seed: int = typer.Option(0),
    placement: str = typer.Option(
        "split", help="split, or colocated (generator and trainer take turns on every core; sync)."
    ),
) -> None:
    """Build a tiny model, warm-start it, and run an RL job with every service as a process."""
    quiet_logging()
    from asyncrl.demo import run_demo

    if placement == "colocated":
        mode = "sync"  # co-located phases alternate
    run_demo(
        workdir=workdir,
        steps=steps,
        mode=mode,
        max_staleness=max_staleness,
        generators=generators,
        seed=seed,
        extra_spec={"placement": placement} if placement != "split" else None,
    )


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def bench(ctx: typer.Context) -> None:
    """Benchmarks measured in one run on this machine (`asyncrl bench --help`); `python -m bench`
    runs them: the benchmarks sit above the CLI, which does not import them."""
    os.execv(sys.executable, [sys.executable, "-m", "bench", *ctx.args])


def _read_spec(spec_file: Path) -> Any:
    try:
        return json.loads(spec_file.read_text())
    except (OSError, ValueError) as exc:
        _fail(f"cannot read the job spec {spec_file}: {exc}")


def _place(position: int) -> str:
    return f"position {position} in the queue" if position else "taken by a trainer already"


@app.command()
def submit(
    spec_file: Path,
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print the API's answer (id, state, position and the "
        "stored spec with every default) as JSON, for scripts.",
    ),
    api: str = API,
    token: str | None = TOKEN,
) -> None:
    """Queue a job spec (JSON file) on the fleet: prints its id, state, place in the queue and its
    status page."""
    job = _call("POST", api, "/jobs", token, json=_read_spec(spec_file))
    if as_json:
        _echo_json(job)
    else:
        typer.echo(
            f"job {job['id']} {job['state']}, {_place(job['position'])}; status page "
            f"{api.rstrip('/')}/status?job={job['id']}"
        )


@app.command("list")
def list_jobs(
    limit: int = typer.Option(100, min=1, help="Newest jobs shown."),
    api: str = API,
    token: str | None = TOKEN,
) -> None:
    """The newest jobs: id, name, state, place in the queue (queued jobs), priority, step, share and
    the services serving it (running jobs), created and updated times."""
    jobs = _call("GET", api, "/jobs", token, params={"limit": limit})
    queue = _call("GET", api, "/queue", token)
    positions = {q["id"]: q["position"] for q in queue["queued"]}
    running = {j["id"]: j for j in queue["running"]}
    table = Table(
        "id",
        "name",
        "state",
        Column("queue", justify="right"),
        Column("priority", justify="right"),
        Column("step", justify="right"),
        Column("share", justify="right"),
        "served by",
        "created",
        "updated",
    )
    for job in jobs:
        run = running.get(job["id"])
        table.add_row(
            _cell(job["id"]),
            _cell(job["name"]),
            _cell(job["state"]),
            _cell(f"#{positions[job['id']]}" if job["id"] in positions else None),
            *(_cell(job[k]) for k in ("priority", "step")),
            _cell(f"{run['share']:g}" if run else None),
            _served_by(run["served_by"]) if run else _cell(None),
            *(_cell(job[k]) for k in ("created_at", "updated_at")),
        )
    Console().print(table)


def _ago(ts: float) -> str:
    s = max(0.0, time.time() - ts)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _show_queue(api: str, token: str | None) -> None:
    """The running jobs, the queue with each job's place and what it waits for, and the fleet's
    services (GET /queue, GET /fleet); a line instead of an empty table."""
    queue = _call("GET", api, "/queue", token)
    services = _call("GET", api, "/fleet", token)["services"]
    console = Console()
    if queue["running"]:
        running = Table(
            "id",
            "name",
            "state",
            Column("step", justify="right"),
            Column("priority", justify="right"),
            Column("share", justify="right"),
            "served by",
            "started",
            Column("reward errors", justify="right"),
            "drop skew",
            title="running",
            title_justify="left",
        )
        for j in queue["running"]:
            running.add_row(
                _cell(j["id"]),
                _cell(j["name"]),
                _cell(j["state"]),
                _cell(f"{j['step']}/{j['steps']}"),
                _cell(j["priority"]),
                _cell(f"{j.get('share', 1.0):g}"),
                _served_by(j.get("served_by") or {}),
                _cell(j["started_at"]),
                _percent(j.get("reward_error_fraction")),
                _skewed(j.get("drop_skew_warnings") or []),
            )
        console.print(running)
    else:
        console.print("running: no job")
    if queue["queued"]:
        queued = Table(
            Column("#", justify="right"),
            "id",
            "name",
            Column("priority", justify="right"),
            "submitted",
            "waiting for",
            title="queued",
            title_justify="left",
        )
        for q in queue["queued"]:
            queued.add_row(
                _cell(q["position"]),
                _cell(q["id"]),
                _cell(q["name"]),
                _cell(q["priority"]),
                _cell(q["submitted_at"]),
                _cell(q["waiting_for"]),
            )
        console.print(queued)
    else:
        console.print("queued: no job")
    if services:
        fleet = Table(
            "role",
            "id",
            "host",
            Column("pid", justify="right"),
            "state",
            "jobs",
            "since",
            Column("jobs served", justify="right"),
            title="fleet",
            title_justify="left",
        )
        for m in services:
            fleet.add_row(
                _cell(m["role"]),
                _cell(m["id"]),
                _cell(m["host"]),
                _cell(m["pid"]),
                _cell(m["state"]),
                _service_jobs(m),
                _cell(_ago(m["since"])),
                _cell(m["jobs_served"]),
            )
        console.print(fleet)
    else:
        console.print("fleet: no service is up (python -m asyncrl.launch starts one)")


def _follow(job_id: str, api: str, token: str | None, interval: float, **kwargs: Any) -> dict[str, Any]:
    """report.follow, its errors as the CLI's (message on stderr, exit 1)."""
    try:
        return follow(api, job_id, headers=_auth(token), interval=interval, **kwargs)
    except RuntimeError as exc:  # ApiError, ApiUnavailable, a local fleet that stopped
        _fail(str(exc))


@app.command()
def status(
    job_id: str | None = typer.Argument(None, help="A job; none: the queue and the fleet."),
    watch: bool = typer.Option(False, "--watch", help="Live progress until the job ends; exits 1 if it failed."),
    interval: float = typer.Option(1.0, min=0.1, help="--watch: seconds between refreshes."),
    api: str = API,
    token: str | None = TOKEN,
) -> None:
    """Show a job's state, step and last metrics (JSON, with its usage: generator-seconds and
    tokens, also one line on stderr), or watch it live; either way, every collapse-guard trip (what
    it did to the policy) follows on stderr. Without a job: the running jobs (each one's share and
    the services serving it), the queue (each job's place and what it waits for) and the fleet's
    services (the jobs each serves)."""
    if job_id is None:
        if watch:
            _fail("--watch follows one job: give its id")
        _show_queue(api, token)
        return
    if not watch:
        job = _call("GET", api, f"/jobs/{job_id}", token)
        _echo_json(job)
        _echo_usage(job)
        _echo_reward_errors(job)
        _echo_drop_skew(job)
        _echo_guard_trips(job_id, api, token)
        return
    job = _follow(job_id, api, token, interval)
    typer.echo(f"job {job_id} {job['state']} at step {job['step']}")
    _echo_guard_trips(job_id, api, token)
    if job["state"] == "failed":
        _fail(job.get("error") or "the job failed")


@app.command()
def queue(api: str = API, token: str | None = TOKEN) -> None:
    """The running jobs, the queue (each job's place and what it waits for) and the fleet's
    services: `asyncrl status` without a job."""
    _show_queue(api, token)


def _answers(api: str) -> bool:
    """Whether anything answers HTTP at `api` (a degraded API's 503 too: it is there)."""
    try:
        httpx.get(api.rstrip("/") + "/health", timeout=3.0)
    except TransportError:
        return False
    return True


@app.command()
def run(
    spec_file: Path,
    api: str | None = typer.Option(
        None,
        "--api",
        envvar="ASYNCRL_API",
        show_default=False,
        help="Job API of the fleet to run on. Unset: the one at 127.0.0.1:$BROKER_PORT (8000), else a fleet "
        "started on this box for the job (python -m asyncrl.launch: Redis found or private, the SQLite ledger "
        "runs/ledger.db unless DATABASE_URL is set), its API on that port.",
    ),
    token: str | None = TOKEN,
    keep: bool = typer.Option(
        False,
        "--keep",
        help="Leave the fleet this command started up after the job: the "
        "next `asyncrl run` finds it, its engines warm.",
    ),
    generators: int = typer.Option(1, min=1, help="Generator processes of a fleet started here."),
    interval: float = typer.Option(1.0, min=0.1, help="Seconds between progress refreshes."),
    plot_file: str | None = typer.Option(None, "--plot", help="Also write reward and staleness per step to this PNG."),
) -> None:
    """Run a job to its end: submit it to the fleet, show its place in the queue and its progress,
    print its summary, and exit 0 when it finished (1 with its error otherwise). Ctrl-C cancels
    the job on a fleet started here, and only stops following on any other."""
    from asyncrl.local import default_api, start_local_fleet
    from asyncrl.report import plot, show_summary

    quiet_logging()
    t0 = time.monotonic()
    spec = _read_spec(spec_file)
    console = Console()
    url, local = api or default_api(), None
    if not _answers(url):
        if api is not None:
            _fail(f"no job API answers at {api}; unset --api and ASYNCRL_API to start a fleet on this box")

        console.print(f"no fleet answers at {url}: starting one on this box (python -m asyncrl.launch)", soft_wrap=True)
        placement = spec.get("placement") if isinstance(spec, dict) else None
        try:
            local = start_local_fleet(generators=generators, placement=placement if placement == "colocated" else None)
        except (RuntimeError, TimeoutError) as exc:
            _fail(str(exc))
        url = local.api
        console.print(f"fleet up (launcher pid {local.pid}): API {url}, logs {local.logdir}", soft_wrap=True)
    try:
        submitted = _call("POST", url, "/jobs", token, json=spec)
        job_id = submitted["id"]
        console.print(
            f"job {job_id} {submitted['state']}, {_place(submitted['position'])}; "
            f"status page {url}/status?job={job_id}",
            soft_wrap=True,
        )
        try:
            job = _follow(job_id, url, token, interval, check=local.check if local else None, console=console)
        except KeyboardInterrupt:
            if local is not None and not keep:
                with contextlib.suppress(httpx.HTTPError):  # else the fleet's stop would leave it running
                    httpx.post(f"{url}/jobs/{job_id}/cancel", headers=_auth(token), timeout=5)
                typer.echo(f"interrupted: job {job_id} cancelled", err=True)
            else:
                typer.echo(
                    f"stopped following: job {job_id} goes on at {url} (asyncrl cancel {job_id} ends it)", err=True
                )
            raise typer.Exit(130) from None
        summary = _call("GET", url, f"/jobs/{job_id}/summary", token)
        if summary["steps"]:
            show_summary(summary, time.monotonic() - t0, console)
        if plot_file is not None:
            console.print(f"plot: {plot(summary, Path(plot_file))}")
        if job["state"] != "finished":
            _fail(
                f"job {job_id} {job['state']} at step {job['step']}" + (f": {job['error']}" if job.get("error") else "")
            )
        console.print(f"job {job_id} finished at step {job['step']}")
    finally:
        if local is not None and keep:
            # soft_wrap: addresses and paths stay whole, to be copied
            console.print(
                f"the fleet stays up: API {url} (status page {url}/status), logs {local.logdir}", soft_wrap=True
            )
            if url != DEFAULT_API:
                console.print(f"the other asyncrl commands find it with: export ASYNCRL_API={url}", soft_wrap=True)
            console.print(f"stop it with: kill {local.pid}")
        elif local is not None:
            console.print("stopping the fleet started for this job")
            local.stop()


PAGES = typer.Argument(
    ...,
    help="The services' Prometheus pages, e.g. http://127.0.0.1:9101/metrics (each "
    "service serves one on its GEN_/REWARD_/TRAINER_METRICS_PORT).",
)


@app.command()
def phases(
    urls: list[str] = PAGES, as_json: bool = typer.Option(False, "--json", help="JSON instead of a table.")
) -> None:
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
    table = Table(
        "role",
        "phase",
        Column("spans", justify="right"),
        Column("median ms", justify="right"),
        Column("mean ms", justify="right"),
        Column("total s", justify="right"),
    )
    for p in rows:
        table.add_row(
            str(p["role"]),
            str(p["phase"]),
            f"{int(p['count'])}",
            f"{1000 * float(p['median_s']):.2f}",
            f"{1000 * float(p['mean_s']):.2f}",
            f"{float(p['total_s']):.2f}",
        )
    Console().print(table)


def _echo_usage(job: dict[str, Any]) -> None:
    """What the job cost the generators, one line on stderr once it generated a sample: the
    figures a shared fleet bills it by (GET /jobs/{id} `usage`)."""
    usage = job.get("usage") or {}
    if not usage.get("samples"):
        return
    typer.echo(
        f"usage: {usage['generator_seconds']:.1f} generator-seconds, {usage['samples']} samples, "
        f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens "
        f"on {len(usage.get('by_generator') or {})} generator(s)",
        err=True,
    )


def _echo_reward_errors(job: dict[str, Any]) -> None:
    """The job's reward error fraction on stderr when any reward failed (a scorer that only
    fails leaves every reward 0: the curves alone would not say why)."""
    errors = job.get("reward_errors") or {}
    fraction, by_status = errors.get("fraction"), errors.get("by_status") or {}
    if fraction:
        counts = ", ".join(f"{s} {n}" for s, n in sorted(by_status.items()))
        typer.secho(
            f"reward errors: {fraction:.1%} of {sum(by_status.values())} scored samples ({counts})",
            fg="red" if fraction >= 0.5 else "yellow",
            err=True,
        )


def _echo_drop_skew(job: dict[str, Any]) -> None:
    """What dropping skewed, on stderr once the job dropped a sample: the counts by reason, the
    length and reward shifts, then each warning (the curves show what was trained, not what was not)."""
    skew = job.get("drop_skew") or {}
    dropped = (skew.get("dropped") or {}).get("count") or 0
    if not dropped:
        return
    reasons = ", ".join(f"{r} {side['count']}" for r, side in (skew.get("by_reason") or {}).items())
    shifts = ", ".join(f"{q} {s['mean']:+.2f}" for q, s in (skew.get("shift") or {}).items() if s) or "none"
    trained = (skew.get("trained") or {}).get("count") or 0
    typer.echo(f"drop skew: {dropped} dropped ({reasons}) against {trained} trained; shift {shifts}", err=True)
    for warning in skew.get("warnings") or []:
        typer.secho(f"warning: {warning}", fg="yellow", err=True)


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
    """Ask a running job to stop after its current step (a queued one: at once, never started)."""
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
    """Cancel a job: a queued one never starts; a running one ends now, without finishing its step
    or evaluating, and the fleet takes the next."""
    _echo_json(_call("POST", api, f"/jobs/{job_id}/cancel", token))


@app.command("set")
def set_knobs(
    job_id: str,
    lr: float | None = typer.Option(None, help="Learning rate."),
    max_staleness: int | None = typer.Option(None, help="Staleness bound k (async jobs)."),
    temperature: float | None = typer.Option(None, help="Sampling temperature of new rollouts."),
    top_p: float | None = typer.Option(None, help="Nucleus mass of new rollouts."),
    top_k: int | None = typer.Option(None, help="Top-k of new rollouts (0: none)."),
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
        "top_k": top_k,
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
        console.print(
            Text(f"{f['level']}: {f['check']}: {f['message']}", style="red" if f["level"] == "violation" else "dim")
        )
    if not res["ok"]:
        raise typer.Exit(1)


@app.command("replay")
def replay_job(
    job_id: str,
    to_step: int | None = typer.Option(
        None, "--to-step", min=1, help="The last step to replay (default: the last recorded)."
    ),
    from_step: int = typer.Option(
        1,
        "--from-step",
        min=1,
        help="Start from the newest checkpoint before this step (default 1: from the initial model).",
    ),
    db: str = typer.Option(
        "sqlite:///runs/ledger.db",
        "--db",
        envvar="DATABASE_URL",
        help="The job's ledger (as the services' DATABASE_URL).",
    ),
    device: str | None = typer.Option(None, help="Torch device (default: the recorded one where this box has it)."),
    as_json: bool = typer.Option(False, "--json", help="Print the outcome as JSON rather than a table."),
) -> None:
    """Re-run the trainer side of a job from its ledger and checkpoints alone: the same batches in
    the same order, at the same lr and RNG state, and compare the weights' checksum (and the loss
    and the other learner metrics) with those recorded at training time, step by step. Runs here,
    on this box's torch (the model and checkpoints must be readable at their recorded paths).
    Exits 0 when every replayed step matched bit for bit, 1 at the first step that differs (named)
    or when the job cannot be replayed (the reason)."""
    from transformers.utils import logging as hf_logging

    from broker.ledger import Ledger
    from trainer_svc.replay import CannotReplay, Start, StepResult, replay, report

    quiet_logging()
    hf_logging.disable_progress_bar()  # the model loads: not the user's business here
    console = Console(stderr=as_json)
    events: list[Start | StepResult] = []
    with Ledger(db) as ledger:
        try:
            with console.status(f"replaying job {job_id}") as status:
                for ev in replay(ledger, job_id, from_step=from_step, to_step=to_step, device=device):
                    events.append(ev)
                    if isinstance(ev, Start):
                        _echo_replay_start(console, ev)
                    status.update(f"replaying job {job_id}: step {ev.step} done")
        except CannotReplay as exc:
            _fail(str(exc))
    out = report(job_id, events)
    if as_json:
        _echo_json(out)
    else:
        _echo_replay_table(console, job_id, events, out)
    if not out["bitwise"]:
        raise typer.Exit(1)


def _echo_replay_start(console: Console, start: Any) -> None:
    console.print(Text(f"start: after step {start.step}, from {start.source}"), soft_wrap=True)
    if start.not_comparable:
        console.print(
            Text("not comparable (bit-exactness not expected): " + "; ".join(start.not_comparable), style="yellow"),
            soft_wrap=True,
        )
    else:
        console.print(Text("software and hardware as recorded: comparable", style="dim"))


def _echo_replay_table(console: Console, job_id: str, events: list[Any], out: dict[str, Any]) -> None:
    table = Table(
        "step",
        "version",
        "lr",
        Column("loss", justify="right"),
        "recorded",
        "replayed",
        "result",
        title=f"replay of job {job_id}",
    )
    for e in events[1:]:
        table.add_row(
            _cell(e.step),
            _cell(e.version),
            Text(f"{e.lr:.3g}"),
            _cell(e.loss, 5),
            _cell(e.expected[:12]),
            _cell(e.got[:12] or None),
            Text("same", style="green") if e.same else Text("DIFFERS", style="bold red"),
        )
    console.print(table)
    if out["bitwise"]:
        n = len(out["steps"])
        span = f"steps {out['steps'][0]['step']}..{out['steps'][-1]['step']}" if n else "no step"
        console.print(Text(f"{span} replayed bit for bit", style="green"))
        return
    first = out["first_differing_step"]
    where = "the starting weights" if first == out["start"]["step"] and not out["steps"] else f"step {first}"
    console.print(Text(f"{where} differs: " + "; ".join(out["differs"]), style="bold red"), soft_wrap=True)
    if out["not_comparable"]:
        console.print(Text("(recorded on other software or hardware: see above)", style="yellow"))


# -- admin tasks (the job API hands them to the Celery worker) ------------------------------


def _checkpoint_step(job_id: str, step: int | None, api: str, token: str | None) -> int:
    """`step`, or the newest checkpoint's step when it is None."""
    if step is not None:
        return step
    checkpoints = _call("GET", api, f"/jobs/{job_id}/checkpoints", token)
    if not checkpoints:
        _fail(
            f"job {job_id} has no checkpoint yet (the trainer writes one every checkpoint_every steps and at the end)"
        )
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
    job_id: str,
    step: int | None,
    action: str,
    body: dict | None,
    wait: bool,
    interval: float,
    api: str,
    token: str | None,
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
