"""Static checks of the deployment files (no Docker engine runs on these machines).

Every compose service's command exists in the package, every environment variable it sets is a
real setting, ports match the settings, health checks hit real endpoints, Dockerfiles copy real
paths, and every example job spec validates.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import AliasChoices

from shared.jobspec import JobSpec
from shared.settings import (
    BrokerSettings,
    CommonSettings,
    GeneratorSettings,
    RewardSettings,
    TrainerSettings,
)

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"broker": BrokerSettings, "generator_svc": GeneratorSettings, "reward_svc": RewardSettings,
            "trainer_svc": TrainerSettings}


def env_names(cls) -> set[str]:
    prefix = cls.model_config.get("env_prefix", "")
    names = set()
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {a for a in alias.choices if isinstance(a, str) and a.isupper()}
        else:
            names.add(f"{prefix}{name}".upper())
    return names


def compose(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


def test_every_compose_service_command_and_env_is_real():
    services = compose("docker-compose.yml")["services"]
    ours = {name: s for name, s in services.items() if "build" in s}
    assert set(ours) == {"broker", "trainer", "generator", "reward"}
    for name, svc in ours.items():
        cmd = svc["command"]
        assert cmd[:2] == ["python", "-m"], cmd
        pkg = cmd[2]
        assert (ROOT / pkg / "__main__.py").exists(), f"{name}: no package {pkg}"
        known = env_names(SETTINGS[pkg]) | env_names(CommonSettings)
        unknown = set(svc.get("environment", {})) - known
        assert not unknown, f"{name}: {unknown} are not settings of {SETTINGS[pkg].__name__}"
        for cond in svc["depends_on"].values():
            assert cond["condition"] == "service_healthy"
    # required settings fail loudly when unset
    text = (ROOT / "docker-compose.yml").read_text()
    assert "${POSTGRES_PASSWORD:?" in text and "${MODEL_DIR:?" in text


def test_compose_ports_and_health_checks_match_the_code():
    services = compose("docker-compose.yml")["services"]
    broker = services["broker"]
    host, container = broker["ports"][0].split(":")
    assert int(container) == int(broker["environment"]["BROKER_PORT"]) == BrokerSettings.model_fields["port"].default
    health = " ".join(broker["healthcheck"]["test"])
    path = re.search(r"127\.0\.0\.1:(\d+)(/\w+)", health)
    assert path and int(path.group(1)) == int(container)
    from broker.api import create_app

    routes = {r.path for r in create_app(BrokerSettings(redis_url="redis://127.0.0.1:6379/0"),
                                         ledger=_memory_ledger()).routes}
    assert path.group(2) in routes
    trainer = services["trainer"]
    assert trainer["expose"] == [trainer["environment"]["TRAINER_BIND_PORT"]]
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "--appendfsync everysec" in redis_cmd and "noeviction" in redis_cmd


def _memory_ledger():
    from broker.ledger import Ledger

    return Ledger("sqlite://")


def test_gpu_overlay_sets_only_real_settings():
    services = compose("deploy/compose.gpu.yml")["services"]
    for name, svc in services.items():
        pkg = {"trainer": "trainer_svc", "generator": "generator_svc"}[name]
        unknown = set(svc.get("environment", {})) - env_names(SETTINGS[pkg])
        assert not unknown, f"{name}: {unknown}"
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


@pytest.mark.parametrize("dockerfile", ["deploy/Dockerfile.cpu", "deploy/Dockerfile.cuda"])
def test_dockerfiles_copy_real_paths_and_install_deps_before_source(dockerfile):
    lines = (ROOT / dockerfile).read_text().splitlines()
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY")]
    for srcs in copies:
        for src in srcs:
            assert (ROOT / src).exists(), f"{dockerfile}: COPY {src} does not exist"
    first_source_copy = next(i for i, line in enumerate(lines) if line.startswith("COPY shared"))
    install = next(i for i, line in enumerate(lines) if "pip install \".[" in line)
    assert install < first_source_copy, "dependencies must be installed in a layer before the source"


def test_env_example_names_real_settings():
    known = set().union(*(env_names(c) for c in SETTINGS.values()))
    for line in (ROOT / "deploy/env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            assert line.split("=")[0] in known, line


@pytest.mark.parametrize("path", sorted((ROOT / "deploy/jobs").glob("*.json")), ids=lambda p: p.name)
def test_example_job_specs_validate(path):
    JobSpec.model_validate(json.loads(path.read_text()))
