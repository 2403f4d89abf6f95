"""The layering: shared <- broker <- {generator_svc, reward_svc, trainer_svc} <- asyncrl <- bench;
vllm in one module.

The tools layer (the CLI, demo and launcher in `asyncrl`; above it the benchmarks and peers in
`bench`) starts services and may import anything below it; nothing below imports it. Services started as processes count
too: a `-m module` argument in a lower layer must name a module that layer may import.

Static (ast over every module, imports inside functions included) plus one dynamic check that the
light packages import without torch or vllm. The tools are held to two more rules: no import cycle
among the modules of `asyncrl` and `bench` (a module shared by two goes where both can import it),
and no module of a package or a deploy script imports another module's private name
(`from m import _x`: a name that others need is public in the module that owns it).
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
ACYCLIC = TOOLS  # packages whose modules import one another without a cycle
PRIVATE_SCANNED = (*PACKAGES, "deploy")  # where no module imports another's private name (tests excluded)

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


def import_source(node: ast.ImportFrom, path: Path, root: Path = REPO) -> str:
    """The absolute name of the module a `from ... import` in `path` imports from."""
    if not node.level:
        return node.module or ""
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imported_modules(path: Path, root: Path = REPO) -> set[str]:
    """Absolute names of every module `path` imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            prefix = import_source(node, path, root)
            found.add(prefix)
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


def import_graph(paths: list[Path], root: Path = REPO) -> dict[str, set[str]]:
    """Each module of `paths` -> the modules of `paths` it imports. Every import counts, a function's
    too: a cycle through one is the same tangle, only deferred to the first call."""
    modules = {module_name(p, root): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        for imported in imported_modules(path, root):
            parts = imported.split(".")  # `from pkg.mod import f` names pkg.mod.f: its module is pkg.mod
            owner = next(
                (".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules), None
            )
            if owner is not None and owner != name:
                graph[name].add(owner)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of `graph` that reach one another, one sorted list per cycle (Tarjan's strongly
    connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def private_imports(path: Path, root: Path = REPO) -> list[str]:
    """Each `from m import _x` in `path` with m another module, as `path:line from m import _x`."""
    me = module_name(path, root)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            source = import_source(node, path, root)
            found += [
                f"{path.relative_to(root)}:{node.lineno} from {source} import {alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__") and source != me
            ]
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


def test_cycle_and_private_name_finders(tmp_path: Path) -> None:
    """Guards the two tools checks themselves: a cycle through a function's import, a package's
    `from . import`, and private names imported by plain and relative imports."""
    (tmp_path / "bench").mkdir()
    files = {
        "__init__.py": "",
        "a.py": "from bench.b import run\n",
        "b.py": "def run():\n    from bench import c\n",  # a -> b -> c -> a, through a function's import
        "c.py": "from .a import _helper, __doc__\n",
        "d.py": "from bench.e import _x as y\nfrom bench.d import _own\n",  # d <-> e; d's own name is its own
        "e.py": "import bench.d\n",
        "f.py": "import bench.a\n",  # imports a cycle's module, is in none
    }
    for name, text in files.items():
        (tmp_path / "bench" / name).write_text(text)
    paths = sorted((tmp_path / "bench").glob("*.py"))
    graph = import_graph(paths, tmp_path)
    assert (
        graph["bench.a"] == {"bench.b"} and graph["bench.b"] == {"bench", "bench.c"} and graph["bench.d"] == {"bench.e"}
    )
    assert import_cycles(graph) == [["bench.a", "bench.b", "bench.c"], ["bench.d", "bench.e"]]
    assert import_cycles({"x": {"y"}, "y": set()}) == []
    found = [f for p in paths for f in private_imports(p, tmp_path)]
    assert found == ["bench/c.py:1 from bench.a import _helper", "bench/d.py:1 from bench.e import _x"]


@pytest.mark.parametrize("package", ACYCLIC)
def test_no_import_cycle_in_the_tools(package: str) -> None:
    graph = import_graph(python_files(package))
    assert not import_cycles(graph), (
        f"modules of {package} import one another in a cycle (move what they share to a module both "
        f"import): {import_cycles(graph)}"
    )


def test_no_private_name_is_imported_from_another_module() -> None:
    found = [f for where in PRIVATE_SCANNED for path in python_files(where) for f in private_imports(path)]
    assert not found, (
        "a private name imported from another module (make it public where it is defined, "
        "or move it):\n" + "\n".join(found)
    )


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
                if (
                    isinstance(a, ast.Constant)
                    and a.value == "-m"
                    and isinstance(b, ast.Constant)
                    and isinstance(b.value, str)
                ):
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
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"heavy modules imported: {proc.stdout.strip()}"
