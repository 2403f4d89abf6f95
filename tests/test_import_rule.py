"""The layering: shared <- broker <- {generator_svc, reward_svc, trainer_svc} <- asyncrl <- bench;
vllm in one module.

The tools layer (the CLI, demo and launcher in `asyncrl`; above it the benchmarks and peers in
`bench`) starts services and may import anything below it; nothing below imports it. Services started as processes count
too: a `-m module` argument in a lower layer must name a module that layer may import.

Static (ast over every module, imports inside functions included) plus one dynamic check that the
light packages import without torch or vllm.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("generator_svc", "reward_svc", "trainer_svc")
TOOLS = ("asyncrl", "bench")
PACKAGES = ("shared", "broker", *SERVICES, *TOOLS)
VLLM_HOME = "generator_svc/engine.py"

# What each package may not import (top-level module names).
FORBIDDEN = {
    "shared": {"broker", *SERVICES, *TOOLS},
    "broker": {*SERVICES, *TOOLS},
    **{svc: {*SERVICES, *TOOLS} - {svc} for svc in SERVICES},
    "asyncrl": {"bench"},  # the benchmarks use the CLI's demo runner, not the other way round
    "bench": set(),
}
# Processes a lower layer starts against the rule, each with its reason.
STARTED_ACROSS = {
    # The admin worker (Celery) evaluates a checkpoint in a child process so the worker never loads
    # torch or vLLM itself; it is the one broker task that runs a service's code.
    ("broker/admin.py", "generator_svc.evaluate"),
    # `asyncrl bench ...` is an alias: it execs `python -m bench ...`.
    ("asyncrl/cli.py", "bench"),
}
LIGHT_MODULES = (
    "shared.schema",
    "shared.jobspec",
    "shared.settings",
    "shared.transport",
    "shared.ids",
    "shared.tasks",
    "shared.rewards",
    "shared.datasets",
    "shared.prompts",
    "shared.evalmetrics",
    "shared.environments",
    "broker.streams",
    "broker.ledger",
    "broker.api",
    "broker.runtime",
    "broker.service",
    "asyncrl.demo",
    "asyncrl.cli",
)


def module_name(path: Path, root: Path = REPO) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_modules(path: Path, root: Path = REPO) -> set[str]:
    """Absolute names of every module `path` imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            found.add(prefix)
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


def python_files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def test_every_package_is_scanned() -> None:
    for package in PACKAGES:
        assert (REPO / package / "__init__.py").exists(), package
        assert python_files(package)


def test_import_parser_sees_every_form(tmp_path: Path) -> None:
    """Guards the checker itself: plain, from, relative and function-local imports all count."""
    (tmp_path / "shared").mkdir()
    probe = tmp_path / "shared" / "probe.py"
    probe.write_text(
        "import broker.streams\n"
        "from reward_svc import rewards\n"
        "from .schema import encode\n"
        "from . import jobspec\n"
        "def f():\n    import vllm\n"
        "if True:\n    from trainer_svc.train import main\n"
    )
    found = imported_modules(probe, tmp_path)
    assert {
        "broker.streams",
        "reward_svc",
        "shared.schema",
        "shared.jobspec",
        "vllm",
        "trainer_svc.train",
    } <= found


@pytest.mark.parametrize("package", PACKAGES)
def test_layering(package: str) -> None:
    violations = []
    for path in python_files(package):
        for name in sorted(imported_modules(path)):
            if name.split(".")[0] in FORBIDDEN[package]:
                violations.append(f"{path.relative_to(REPO)} imports {name}")
    assert not violations, "layering is shared <- broker <- services <- tools:\n" + "\n".join(violations)


def started_modules(path: Path) -> set[str]:
    """Modules `path` starts as processes: the string after a literal "-m" in a list or tuple."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.List, ast.Tuple)):
            items = node.elts
            for a, b in zip(items, items[1:], strict=False):
                if (isinstance(a, ast.Constant) and a.value == "-m"
                        and isinstance(b, ast.Constant) and isinstance(b.value, str)):
                    found.add(b.value)
    return found


def test_started_modules_parser(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('cmd = [sys.executable, "-m", "trainer_svc.train", "--x"]\nother = ("-m", "bench.suite")\n')
    assert started_modules(probe) == {"trainer_svc.train", "bench.suite"}


@pytest.mark.parametrize("package", PACKAGES)
def test_processes_started_follow_the_layering(package: str) -> None:
    violations = []
    for path in python_files(package):
        rel = str(path.relative_to(REPO))
        for name in sorted(started_modules(path)):
            if name.split(".")[0] in FORBIDDEN[package] and (rel, name) not in STARTED_ACROSS:
                violations.append(f"{rel} starts {name}")
    assert not violations, "a lower layer starts a higher one's module:\n" + "\n".join(violations)


def test_every_exception_is_still_needed() -> None:
    for rel, name in STARTED_ACROSS:
        assert name in started_modules(REPO / rel), f"{rel} no longer starts {name}: drop the exception"


def test_vllm_is_imported_in_one_module_only() -> None:
    importers = {
        str(path.relative_to(REPO))
        for package in PACKAGES
        for path in python_files(package)
        if any(name == "vllm" or name.startswith("vllm.") for name in imported_modules(path))
    }
    assert importers == {VLLM_HOME}


def test_light_packages_import_without_torch_or_vllm() -> None:
    code = (
        "import sys\n"
        f"import {', '.join(LIGHT_MODULES)}\n"
        "heavy = sorted(m for m in ('torch', 'vllm') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"heavy modules imported: {proc.stdout.strip()}"
