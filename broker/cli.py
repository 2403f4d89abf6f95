"""`asyncrl` command line (typer): the demo and thin clients of the job API."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import httpx
import typer

app = typer.Typer(help="Asynchronous RL post-training: demo and job control.", no_args_is_help=True)

API = os.environ.get("ASYNCRL_API", "http://127.0.0.1:8000")
TOKEN = typer.Option(
    None,
    envvar="ASYNCRL_TOKEN",
    help="Bearer token for the job API (read-write for submit and stop).",
)


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@app.command()
def demo(
    steps: int = typer.Option(50, help="Trainer steps."),
    mode: str = typer.Option("async", help="async or sync."),
    max_staleness: int = typer.Option(1, help="Staleness bound k (async)."),
    generators: int = typer.Option(1, help="Generator processes."),
    workdir: str = typer.Option("runs/demo", help="Models, ledger, logs and the plot go here."),
    seed: int = typer.Option(0),
) -> None:
    """Build a tiny model, warm-start it, and run an RL job with every service as a process."""
    logging.basicConfig(level=logging.WARNING)
    from broker.demo import run_demo

    run_demo(workdir=workdir, steps=steps, mode=mode, max_staleness=max_staleness, generators=generators, seed=seed)


@app.command()
def bench(
    which: str = typer.Argument(
        "async", help="async: T_gen, T_train, sync vs async; parity: learning curves; transfer: weight transfer."
    ),
    steps: int = typer.Option(0, help="Trainer steps per run (0: the bench's default)."),
    seeds: int = typer.Option(3, help="parity: number of seeds."),
    out: str = typer.Option("results", help="Folder for the JSON, markdown and PNG results."),
) -> None:
    """Benchmarks measured in one run on this machine; results under results/."""
    logging.basicConfig(level=logging.WARNING)
    from broker.bench import bench_async, bench_parity, bench_swap

    if which == "async":
        bench_async(steps=steps or 20, out_dir=out)
    elif which == "parity":
        bench_parity(steps=steps or 40, seeds=tuple(range(seeds)), out_dir=out)
    elif which == "transfer":
        from broker.bench_transfer import bench_transfer

        result = bench_transfer(out_dir=out)
        result["swap_latency_s"] = bench_swap(steps=steps or 12)
        (Path(out) / "transfer.json").write_text(json.dumps(result, indent=2) + "\n")
        with open(Path(out) / "transfer.md", "a") as f:
            f.write("\nSeconds from a trainer step's publish until every generator serves it (median, max): "
                    + "; ".join(f"{g} generator(s): {r['median_s']:.3f}, {r['max_s']:.3f}"
                                for g, r in result["swap_latency_s"].items()) + ".\n")
    else:
        raise typer.BadParameter(f"unknown bench '{which}'; valid: async, parity, transfer")


@app.command()
def submit(
    spec_file: Path,
    api: str = typer.Option(API, help="Job API base URL."),
    token: str | None = TOKEN,
) -> None:
    """Submit a job spec (JSON file)."""
    r = httpx.post(
        f"{api}/jobs", json=json.loads(spec_file.read_text()), headers=_auth(token), timeout=30
    )
    typer.echo(json.dumps(r.json(), indent=2))
    raise typer.Exit(0 if r.status_code == 201 else 1)


@app.command()
def status(
    job_id: str, api: str = typer.Option(API, help="Job API base URL."), token: str | None = TOKEN
) -> None:
    """Show a job's state, step and last metrics."""
    r = httpx.get(f"{api}/jobs/{job_id}", headers=_auth(token), timeout=30)
    typer.echo(json.dumps(r.json(), indent=2, default=str))
    raise typer.Exit(0 if r.status_code == 200 else 1)


@app.command()
def stop(
    job_id: str, api: str = typer.Option(API, help="Job API base URL."), token: str | None = TOKEN
) -> None:
    """Ask a running job to stop after its current step."""
    r = httpx.post(f"{api}/jobs/{job_id}/stop", headers=_auth(token), timeout=30)
    typer.echo(json.dumps(r.json(), indent=2))
    raise typer.Exit(0 if r.status_code == 202 else 1)


if __name__ == "__main__":
    app()
