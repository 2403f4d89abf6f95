"""One-shot set-up of `docker compose up` with nothing prepared: the compose service `init`.

With MODEL_DIR unset (no .env), the services mount the compose volume `models` at /models. This
builds the demo's tiny model there (asyncrl.tiny_model and its supervised warm start, as
`asyncrl demo` does; skipped when already built), waits for the job API, submits the demo job
(deploy/jobs/demo.json, its model_path pointed at the built model) unless the API already holds a
job, and prints where the status page is. A second `docker compose up` finds both and submits
nothing. With MODEL_DIR set, the services mount that folder instead and this does nothing: jobs
are the user's to submit, as before.

    python deploy/compose_init.py --models /models --spec deploy/jobs/demo.json \
        --api http://broker:8000 --page http://127.0.0.1:8000

Environment: MODEL_DIR (non-empty: do nothing), ASYNCRL_TOKEN (a read-write token of the API's;
a comma-separated list, as BROKER_TOKENS holds them: the first is used).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx


def wait_healthy(api: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{api}/health", timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"init: the job API at {api} did not answer /health within {timeout_s:.0f} s")
        time.sleep(1)


def build_model(models: Path, warm_steps: int | None) -> Path:
    """The tiny model and its warm start, as asyncrl.demo.prepare_model builds them (seed 0), each
    skipped when already there. `warm_steps`: fewer warm-start steps than its default (tests)."""
    base, warm = models / "tiny-base", models / "tiny-warm"
    if not (base / "config.json").exists():
        print(f"init: building the tiny model -> {base}", flush=True)
        subprocess.run([sys.executable, "-m", "asyncrl.tiny_model", "--out", str(base), "--seed", "0"], check=True)
    if not (warm / "config.json").exists():
        print(f"init: supervised warm start -> {warm}", flush=True)
        steps = ["--steps", str(warm_steps)] if warm_steps else []
        subprocess.run(
            [
                sys.executable,
                "-m",
                "asyncrl.warmstart",
                "--model",
                str(base),
                "--out",
                str(warm),
                "--seed",
                "0",
                *steps,
            ],
            check=True,
        )
    return warm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", required=True, type=Path, help="folder the services mount at /models")
    p.add_argument("--spec", required=True, type=Path, help="the demo job spec (JSON)")
    p.add_argument("--api", required=True, help="job API URL from this container")
    p.add_argument("--page", required=True, help="job API URL from the user's browser")
    p.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for the API")
    p.add_argument("--warm-steps", type=int, default=None, help="warm-start steps (default: the warm start's own)")
    args = p.parse_args(argv)
    api, page = args.api.rstrip("/"), args.page.rstrip("/")
    if os.environ.get("MODEL_DIR"):
        print(
            f"init: MODEL_DIR is set ({os.environ['MODEL_DIR']}): no demo; submit your jobs to "
            f"{page}/jobs, status page {page}/status",
            flush=True,
        )
        return 0
    token = os.environ.get("ASYNCRL_TOKEN", "").split(",")[0].strip()
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    model = build_model(args.models, args.warm_steps)
    spec = json.loads(args.spec.read_text())
    spec["model_path"] = str(model)

    wait_healthy(api, args.wait_s)
    jobs = httpx.get(f"{api}/jobs", headers=headers, timeout=30)
    jobs.raise_for_status()
    if jobs.json():
        job_id = jobs.json()[0]["id"]
        print(f"init: the API already holds jobs (newest {job_id}): no demo job submitted", flush=True)
    else:
        resp = httpx.post(f"{api}/jobs", json=spec, headers=headers, timeout=30)
        if resp.status_code != 201:
            print(f"init: submitting the demo job failed ({resp.status_code}): {resp.text}", file=sys.stderr)
            return 1
        job_id = resp.json()["id"]
        print(f"init: demo job {job_id} submitted ({spec['steps']} steps on {model})", flush=True)
    print(f"init: status page {page}/status?job={job_id}   (follow: docker compose logs -f trainer)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
