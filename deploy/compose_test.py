"""The scenarios of the compose test (scripts/compose-test.sh runs this once the images are built).

Against a real `docker compose` project (its own name, so it touches nothing else), through the job
API, the `asyncrl` CLI and `docker compose ps --format json`:

  a. zero-setup `docker compose up -d`: `init` builds the tiny model and submits the demo job; the
     job finishes, `asyncrl verify` passes, the status page answers, every service's health check
     is green;
  b. `up -d --scale generator=2` and a second job (`asyncrl submit`): both generators serve it, and
     the fleet's services are the same containers that ran the demo (no restart between jobs);
  c. mid-job, the trainer's container is killed, then a generator's: the restart policy brings each
     back, the job finishes, `verify` reports 0 lost and 0 trained twice;
  d. a third job running: `docker compose down` (volumes kept) then `up -d`: the ledger and Redis
     (AOF) survive and the job resumes from its newest checkpoint.

Writes results/compose.json (--out). Exits 1 when a scenario fails (the JSON says which).

    python deploy/compose_test.py --project asyncrl-ct --env-file .compose-test/empty.env \
        --api http://127.0.0.2:8000 --out results/compose.json --build-s 150
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
TERMINAL = ("finished", "failed", "stopped", "cancelled")
JOB_SERVICES = ("trainer", "generator", "reward")


def log(msg: str) -> None:
    print(f"[compose-test {datetime.now(timezone.utc):%H:%M:%S}] {msg}", flush=True)


class Stack:
    def __init__(self, project: str, env_file: str, api: str) -> None:
        self.project, self.api = project, api.rstrip("/")
        self.base = [
            "nice",
            "-n",
            "19",
            "docker",
            "compose",
            "-p",
            project,
            "--env-file",
            env_file,
            "-f",
            str(ROOT / "docker-compose.yml"),
        ]

    # -- docker ---------------------------------------------------------------------------------

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> str:
        res = subprocess.run([*self.base, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)} exited {res.returncode}: {res.stderr[-3000:]}")
        return res.stdout

    def ps(self) -> list[dict[str, Any]]:
        """`docker compose ps -a --format json`: one JSON object per line (an array in older v2)."""
        out = self.compose("ps", "-a", "--format", "json").strip()
        if not out:
            return []
        if out.startswith("["):
            return list(json.loads(out))
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def containers(self, service: str) -> list[dict[str, Any]]:
        return [c for c in self.ps() if c["Service"] == service]

    @staticmethod
    def inspect(container: str) -> dict[str, Any]:
        out = subprocess.run(["docker", "inspect", container], capture_output=True, text=True, check=True).stdout
        return dict(json.loads(out)[0])

    # -- the job API ----------------------------------------------------------------------------

    def get(self, path: str, **params: Any) -> Any:
        r = httpx.get(self.api + path, params=params or None, timeout=30)
        r.raise_for_status()
        return r.json() if "json" in r.headers.get("content-type", "") else r.text

    def answers(self) -> bool:
        try:
            return httpx.get(self.api + "/health", timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """The `asyncrl` CLI of this checkout, pointed at the published API."""
        code = "import sys; from asyncrl.cli import app; sys.argv[0] = 'asyncrl'; app()"
        return subprocess.run(
            [sys.executable, "-c", code, *args, "--api", self.api],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=timeout,
        )

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.get(f"/jobs/{job_id}"))


def wait(what: str, cond, timeout: float, every: float = 2.0):
    """Poll `cond()` until it returns something truthy; its value. Errors while polling (the API
    down during a restart) count as not yet."""
    deadline = time.monotonic() + timeout
    last_err = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except (httpx.HTTPError, RuntimeError, subprocess.SubprocessError, KeyError, ValueError) as exc:
            last_err = exc
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s (last error: {last_err!r})")


def wait_step(s: Stack, job_id: str, step: int, timeout: float) -> dict[str, Any]:
    def reached():
        j = s.job(job_id)
        if j["state"] in TERMINAL:
            raise AssertionError(f"job {job_id} ended ({j['state']}: {j.get('error')}) before step {step}")
        return j if j["step"] >= step else None

    return dict(wait(f"job {job_id} at step {step}", reached, timeout))


def wait_done(s: Stack, job_id: str, timeout: float) -> dict[str, Any]:
    def ended():
        j = s.job(job_id)
        return j if j["state"] in TERMINAL else None

    j = dict(wait(f"job {job_id} to end", ended, timeout))
    log(f"job {job_id} {j['state']} at step {j['step']}{': ' + str(j['error']) if j.get('error') else ''}")
    return j


def verify(s: Stack, job_id: str) -> dict[str, Any]:
    """`asyncrl verify` (its exit status) and GET /jobs/{id}/verify (the figures)."""
    cli = s.cli("verify", job_id)
    res = dict(s.get(f"/jobs/{job_id}/verify"))
    out = {
        "cli_rc": cli.returncode,
        "ok": bool(res["ok"]) and cli.returncode == 0,
        "lost": res["counts"].get("lost", 0),
        "trained_twice": res["checks"]["trained_once"],
        "steps": res["steps"],
        "counts": res["counts"],
        "violations": [f"{v['check']}: {v['message']}" for v in res["violations"]],
    }
    log(
        f"verify {job_id}: {'ok' if out['ok'] else 'FAILED'}, lost {out['lost']}, trained twice "
        f"{out['trained_twice']}, steps {out['steps']}"
    )
    if cli.returncode != 0:
        log(cli.stdout[-2000:] + cli.stderr[-2000:])
    return out


def health(s: Stack) -> dict[str, str]:
    """Service -> its containers' health (`healthy`, or the state of one without a check)."""
    out: dict[str, str] = {}
    for c in s.ps():
        h = c.get("Health") or c.get("State", "")
        if c["Service"] == "init":
            h = f"exited {c.get('ExitCode')}" if c.get("State") == "exited" else c.get("State", "")
        prev = out.get(c["Service"])
        out[c["Service"]] = h if prev in (None, h) else f"{prev},{h}"
    return out


def all_green(s: Stack) -> dict[str, str] | None:
    h = health(s)
    running = {k: v for k, v in h.items() if k != "init"}
    ok = (
        h.get("init") == "exited 0"
        and set(running) >= {"redis", "postgres", "broker", "admin", *JOB_SERVICES}
        and all(set(v.split(",")) == {"healthy"} for v in running.values())
    )
    return h if ok else None


def started(s: Stack, service: str) -> dict[str, tuple[str, int]]:
    """Container id -> (StartedAt, RestartCount) of a service's containers."""
    out = {}
    for c in s.containers(service):
        st = s.inspect(c["ID"])
        out[st["Id"][:12]] = (st["State"]["StartedAt"], int(st["RestartCount"]))
    return out


def spec(name: str, steps: int, checkpoint_every: int) -> dict[str, Any]:
    demo = json.loads((ROOT / "deploy/jobs/demo.json").read_text())
    return {**demo, "name": name, "steps": steps, "checkpoint_every": checkpoint_every}


def submit(s: Stack, body: dict[str, Any], tmp: Path) -> str:
    path = tmp / f"{body['name']}.json"
    path.write_text(json.dumps(body))
    res = s.cli("submit", str(path), "--json")
    if res.returncode != 0:
        raise RuntimeError(f"asyncrl submit: {res.stdout}{res.stderr}")
    job_id = str(json.loads(res.stdout)["id"])
    log(f"submitted {body['name']} ({body['steps']} steps): job {job_id}")
    return job_id


def docker_kill_restarts(image: str) -> bool:
    """Whether this engine's restart policy restarts a container stopped by `docker kill`.
    (Moby marks a SIGKILL sent through its API as a manual stop: `unless-stopped` then leaves the
    container down. A process that dies of a SIGKILL from elsewhere, e.g. the OOM killer, is
    restarted.) Probed on a throw-away container of the project image."""
    name = f"asyncrl-ct-killprobe-{uuid.uuid4().hex[:6]}"
    subprocess.run(
        [
            "docker",
            "run",
            "-d",
            "--init",
            "--restart",
            "unless-stopped",
            "--name",
            name,
            image,
            "python",
            "-c",
            "import time; time.sleep(3600)",
        ],
        check=True,
        capture_output=True,
    )
    try:
        time.sleep(2)
        subprocess.run(["docker", "kill", name], check=True, capture_output=True)
        time.sleep(8)
        st = Stack.inspect(name)
        return bool(st["State"]["Running"]) or int(st["RestartCount"]) > 0
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def crash(container: str, use_docker_kill: bool) -> str:
    """SIGKILL a container's processes: `docker kill` when the restart policy honours it, else the
    same signal to its init process from the host (what the policy restarts: a crash)."""
    if use_docker_kill:
        subprocess.run(["docker", "kill", container], check=True, capture_output=True)
        return "docker kill"
    pid = int(Stack.inspect(container)["State"]["Pid"])
    os.kill(pid, 9)
    return f"SIGKILL to the container's init (host pid {pid})"


def wait_restarted(s: Stack, container: str, restarts_before: int, timeout: float) -> float:
    t0 = time.monotonic()

    def back():
        st = s.inspect(container)
        return st["State"]["Running"] and int(st["RestartCount"]) > restarts_before

    wait(f"{container} restarted by its restart policy", back, timeout, every=1.0)
    return time.monotonic() - t0


def machine() -> dict[str, Any]:
    mem = next(
        (int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")), 0
    )
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )

    def out(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()

    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "mem_gb": round(mem / 1e6, 1),
        "os": platform.platform(),
        "docker": out("docker", "version", "--format", "{{.Server.Version}}"),
        "compose": out("docker", "compose", "version", "--short"),
        "storage_driver": out("docker", "info", "--format", "{{.Driver}}"),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
    }


def image_size_gb(name: str) -> float | None:
    res = subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", name], capture_output=True, text=True)
    return round(int(res.stdout) / 1e9, 2) if res.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--project", required=True)
    p.add_argument("--env-file", required=True)
    p.add_argument("--api", required=True, help="the broker's published URL")
    p.add_argument("--out", type=Path, default=ROOT / "results/compose.json")
    p.add_argument("--build-s", type=float, required=True, help="`docker compose build` wall time")
    p.add_argument("--base-s", type=float, default=0.0, help="building the base image (0: cached or pulled)")
    p.add_argument("--standin-s", type=float, default=0.0, help="building the stand-ins (0: cached or pulled)")
    p.add_argument("--t-start", type=float, default=None, help="unix time the script started")
    p.add_argument("--steps", type=int, default=40, help="steps of the jobs this submits")
    args = p.parse_args(argv)
    s = Stack(args.project, args.env_file, args.api)
    tmp = ROOT / ".compose-test"
    tmp.mkdir(exist_ok=True)
    image = "asyncrl-cpu:latest"
    res: dict[str, Any] = {
        "demo_finished": False,
        "verify_ok": False,
        "scaled_generators": 0,
        "kill_lost": None,
        "kill_trained_twice": None,
        "restart_resumed": False,
        "image_gb": image_size_gb(image),
        "build_s": args.build_s,
        "up_to_finished_s": None,
        "machine": machine(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "images": {
            n: image_size_gb(n)
            for n in (
                os.environ.get("BASE_IMAGE", ""),
                os.environ.get("REDIS_IMAGE", ""),
                os.environ.get("POSTGRES_IMAGE", ""),
            )
            if n
        },
        "base_build_s": args.base_s,
        "standin_build_s": args.standin_s,
        "project": args.project,
        "scenarios": {},
    }
    sc = res["scenarios"]
    failed: list[str] = []

    def save() -> None:
        if args.t_start:
            res["script_wall_s"] = round(time.time() - args.t_start, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")

    try:
        # -- a. zero-setup up ----------------------------------------------------------------------
        log("a. docker compose up -d (no .env)")
        t0 = time.monotonic()
        s.compose("up", "-d")
        up_s = time.monotonic() - t0
        demo_id = wait("the demo job submitted by init", lambda: (s.get("/jobs") or [{}])[-1].get("id"), 1200)
        log(f"up returned in {up_s:.0f} s; demo job {demo_id}")
        demo = wait_done(s, demo_id, 1800)
        res["up_to_finished_s"] = round(time.monotonic() - t0, 1)
        res["demo_finished"] = demo["state"] == "finished" and demo["step"] == demo["spec"]["steps"]
        v = verify(s, demo_id)
        res["verify_ok"] = v["ok"]
        page = httpx.get(f"{s.api}/status", params={"job": demo_id}, timeout=30)
        data = httpx.get(f"{s.api}/status/data/{demo_id}", timeout=30)
        green = wait("every health check green", lambda: all_green(s), 300, every=5.0)
        sc["a_zero_setup"] = {
            "job": demo_id,
            "state": demo["state"],
            "steps": demo["step"],
            "up_returned_s": round(up_s, 1),
            "verify": v,
            "status_page": page.status_code,
            "status_page_html": "<html" in page.text.lower(),
            "status_data": data.status_code,
            "health": green,
            "init_log_tail": s.compose("logs", "--no-color", "init").strip().splitlines()[-3:],
        }
        if not (res["demo_finished"] and res["verify_ok"] and page.status_code == 200 and data.status_code == 200):
            failed.append("a")
        fleet_before = {svc: started(s, svc) for svc in JOB_SERVICES}
        save()
    except Exception as exc:  # noqa: BLE001 - recorded, then the script fails
        return finish(res, failed, args.out, save, s, exc)

    try:
        # -- b. scale the generators, a second job -----------------------------------------------------
        log("b. docker compose up -d --scale generator=2")
        s.compose("up", "-d", "--scale", "generator=2")
        gens = wait(
            "two generators in GET /fleet",
            lambda: (
                [f["id"] for f in s.get("/fleet")["services"] if f["role"] == "generator"]
                if len([f for f in s.get("/fleet")["services"] if f["role"] == "generator"]) >= 2
                else None
            ),
            600,
        )
        log(f"generators in the fleet: {gens}")
        fleet_after = {svc: started(s, svc) for svc in JOB_SERVICES}
        same = {
            svc: all(fleet_after[svc].get(cid) == st for cid, st in fleet_before[svc].items()) for svc in JOB_SERVICES
        }
        use_docker_kill = docker_kill_restarts(image)
        log(f"docker kill restarts a container with restart: unless-stopped: {use_docker_kill}")
        job_b = submit(s, spec("compose-scale-kill", args.steps + 20, 5), tmp)

        # -- c. kill the trainer, then a generator, mid-job --------------------------------------------
        j = wait_step(s, job_b, 8, 900)
        (trainer,) = s.containers("trainer")
        before = int(s.inspect(trainer["ID"])["RestartCount"])
        how = crash(trainer["ID"], use_docker_kill)
        log(f"c. killed the trainer ({trainer['Name']}) at step {j['step']}: {how}")
        trainer_back_s = wait_restarted(s, trainer["ID"], before, 120)
        j2 = wait_step(s, job_b, j["step"] + 4, 900)
        gen = s.containers("generator")[0]
        gbefore = int(s.inspect(gen["ID"])["RestartCount"])
        ghow = crash(gen["ID"], use_docker_kill)
        log(f"c. killed a generator ({gen['Name']}) at step {j2['step']}: {ghow}")
        gen_back_s = wait_restarted(s, gen["ID"], gbefore, 120)
        jb = wait_done(s, job_b, 1800)
        vb = verify(s, job_b)
        served = {g: st for g, st in jb["generators"].items()}
        per_gen: dict[str, int] = {}
        page_n, offset = 500, 0
        while True:
            sp = s.get(f"/jobs/{job_b}/samples", limit=page_n, offset=offset)
            for it in sp["items"]:
                per_gen[it["generator_id"]] = per_gen.get(it["generator_id"], 0) + 1
            offset += page_n
            if offset >= sp["total"]:
                break
        res["scaled_generators"] = len([g for g, n in per_gen.items() if n > 0])
        res["kill_lost"], res["kill_trained_twice"] = vb["lost"], vb["trained_twice"]
        sc["b_scale"] = {
            "job": job_b,
            "fleet_generators": gens,
            "samples_per_generator": per_gen,
            "job_generators": sorted(served),
            "same_containers_as_demo": same,
        }
        sc["c_kill"] = {
            "job": job_b,
            "state": jb["state"],
            "steps": jb["step"],
            "kill_method": how,
            "docker_kill_restarts": use_docker_kill,
            "trainer_killed_at_step": j["step"],
            "trainer_back_s": round(trainer_back_s, 1),
            "generator_killed_at_step": j2["step"],
            "generator_back_s": round(gen_back_s, 1),
            "verify": vb,
        }
        if res["scaled_generators"] < 2 or not all(same.values()):
            failed.append("b")
        if not (jb["state"] == "finished" and vb["ok"] and vb["lost"] == 0 and vb["trained_twice"] == 0):
            failed.append("c")
        save()
    except Exception as exc:  # noqa: BLE001 - recorded; d still runs
        failed.append(f"b/c error: {exc!r}")
        log(f"FAILED: {exc!r}")
        save()

    try:
        # -- d. down + up with a job running ----------------------------------------------------------
        job_c = submit(s, spec("compose-down-up", args.steps, 5), tmp)
        wait(
            "a checkpoint of the third job",
            lambda: [c for c in s.get(f"/jobs/{job_c}/checkpoints") if c["step"] >= 10],
            900,
        )
        jc = s.job(job_c)
        ckpts = s.get(f"/jobs/{job_c}/checkpoints")
        newest_before = max(c["step"] for c in ckpts)
        sentinel = uuid.uuid4().hex
        s.compose("exec", "-T", "redis", "redis-cli", "SET", "asyncrl-ct:sentinel", sentinel)
        jobs_before = {j["id"]: j["state"] for j in s.get("/jobs")}
        time.sleep(2)  # appendfsync everysec
        log(f"d. docker compose down at step {jc['step']} (newest checkpoint: step {newest_before})")
        t_down = time.monotonic()
        s.compose("down", "--timeout", "30")
        s.compose("up", "-d")
        wait("the API after up", s.answers, 600)
        up_again_s = time.monotonic() - t_down
        got = s.compose("exec", "-T", "redis", "redis-cli", "GET", "asyncrl-ct:sentinel").strip()
        jobs_after = {j["id"]: j["state"] for j in s.get("/jobs")}
        ledger_ok = set(jobs_before) <= set(jobs_after) and all(
            jobs_after[k] == st for k, st in jobs_before.items() if st in TERMINAL
        )

        def resumed_line():
            m = re.search(r"resumed from (\S+) at step (\d+)", s.compose("logs", "--no-color", "trainer"))
            return m

        m = wait("the trainer's `resumed from` line", resumed_line, 900)
        resumed_step = int(m.group(2))
        log(f"d. trainer resumed from {m.group(1)} at step {resumed_step}")
        jd = wait_done(s, job_c, 1800)
        vc = verify(s, job_c)
        res["restart_resumed"] = (
            resumed_step >= newest_before > 0
            and jd["state"] == "finished"
            and vc["ok"]
            and got == sentinel
            and ledger_ok
        )
        sc["d_down_up"] = {
            "job": job_c,
            "down_at_step": jc["step"],
            "newest_checkpoint_before": newest_before,
            "resumed_from": m.group(1),
            "resumed_at_step": resumed_step,
            "down_to_api_s": round(up_again_s, 1),
            "redis_sentinel_kept": got == sentinel,
            "ledger_jobs_kept": ledger_ok,
            "jobs": jobs_after,
            "state": jd["state"],
            "steps": jd["step"],
            "verify": vc,
        }
        if not res["restart_resumed"]:
            failed.append("d")
    except Exception as exc:  # noqa: BLE001 - recorded, then the script fails
        return finish(res, failed, args.out, save, s, exc)
    return finish(res, failed, args.out, save, s, None)


def finish(res: dict[str, Any], failed: list[str], out: Path, save, s: Stack, exc: Exception | None) -> int:
    """Record a failure (with the services' state and log tails), write the results, log the figures."""
    if exc is not None:
        failed.append(f"error: {exc!r}")
        log(f"FAILED: {exc!r}")
    if failed:
        try:
            res["ps"] = health(s)
            for svc in ("init", "trainer", "generator", "broker"):
                tail = s.compose("logs", "--no-color", "--tail", "40", svc, check=False)
                res.setdefault("log_tails", {})[svc] = tail.splitlines()[-40:]
        except Exception as e2:  # noqa: BLE001
            res["ps"] = repr(e2)
    res["failed"] = failed
    save()
    log(
        f"results -> {out}: "
        + json.dumps(
            {
                k: res[k]
                for k in (
                    "demo_finished",
                    "verify_ok",
                    "scaled_generators",
                    "kill_lost",
                    "kill_trained_twice",
                    "restart_resumed",
                    "image_gb",
                    "build_s",
                    "up_to_finished_s",
                )
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
