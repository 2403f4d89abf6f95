"""Static checks over every module of the system (ast, not grep: comments and docstrings don't count).

1. No pickle across processes: no import of pickle, cPickle, _pickle, cloudpickle, dill, joblib,
   marshal, shelve, copyreg or multiprocessing / torch.multiprocessing (their queues, pipes and
   pools pickle implicitly), no ProcessPoolExecutor, no `torch.load` without `weights_only=True`,
   no `numpy.load(allow_pickle=True)`, no `pandas.read_pickle`, and no "pickle" serializer named
   anywhere (Celery, kombu).
2. SQL only through bound parameters: nothing that executes SQL (`execute`, `executemany`,
   `executescript`, `exec_driver_sql`, `text`) gets SQL built at run time (an f-string,
   `%`-formatting, `+` concatenation, `.format`, `.join`); `text()` and `exec_driver_sql()` take
   only literal strings.

An exception must be listed in ALLOWED with the reason it is safe; an entry that no longer matches
anything fails too, so the list cannot go stale.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "broker", "generator_svc", "reward_svc", "trainer_svc", "asyncrl", "bench")

PICKLING_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "cloudpickle",
    "dill",
    "joblib",
    "marshal",
    "shelve",
    "copyreg",
    "multiprocessing",
    "torch.multiprocessing",
}
SQL_CALLS = {"execute", "executemany", "executescript", "exec_driver_sql", "text"}
LITERAL_ONLY = {"exec_driver_sql", "text"}

# (path, enclosing function, rule) -> why it is safe. Keyed by function, not line, so edits
# elsewhere in the file do not break it.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("bench/transfer.py", "<module>", "import multiprocessing"): (
        "the transfer benchmark drives a receiver process it spawned itself over an anonymous pipe "
        "(mp.Pipe: pickled tuples of strings and floats); nothing crosses a network, Redis or a "
        "shared filesystem, and no service imports the benchmark"
    ),
    ("broker/ledger/engine.py", "_configure_sqlite._on_connect", "sql built at run time: execute"): (
        "SQLite's PRAGMA statements take no bound parameters; the only value interpolated is the "
        "module constant _SQLITE_BUSY_TIMEOUT_MS (an int)"
    ),
    ("bench/capacity.py", "fresh_database", "sql built at run time: execute"): (
        "CREATE / DROP DATABASE take no bound parameters; the statement is composed with psycopg.sql "
        "(SQL + Identifier, which quotes), and the name is the bench's own capacity_<uuid hex>"
    ),
}


@dataclass(frozen=True)
class Hit:
    path: str
    line: int
    func: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} (in {self.func}): {self.rule}"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _literal_str(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return True
    if isinstance(node, ast.IfExp):  # "BEGIN IMMEDIATE" if write else "BEGIN"
        return _literal_str(node.body) and _literal_str(node.orelse)
    return False


def _built_at_run_time(node: ast.AST) -> bool:
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.Add)):
        return (
            any(
                isinstance(s, (ast.Constant, ast.JoinedStr)) and not isinstance(getattr(s, "value", ""), (int, float))
                for s in (node.left, node.right)
            )
            or _built_at_run_time(node.left)
            or _built_at_run_time(node.right)
        )
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("format", "join")


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str):
        self.path = path
        self.hits: list[Hit] = []
        self.stack: list[str] = []
        self.aliases: dict[str, str] = {}  # local name -> module or module.attr it stands for
        self.docstrings: set[int] = set()

    def hit(self, node: ast.AST, rule: str) -> None:
        self.hits.append(Hit(self.path, getattr(node, "lineno", 0), ".".join(self.stack) or "<module>", rule))

    def _scope(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            self.docstrings.add(id(node.body[0].value))
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_Module(self, node: ast.Module) -> None:
        if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            self.docstrings.add(id(node.body[0].value))
        self.generic_visit(node)

    def _module(self, name: str, node: ast.AST) -> None:
        for bad in PICKLING_MODULES:
            if name == bad or name.startswith(bad + "."):
                self.hit(node, f"import {bad}")

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._module(a.name, node)
            self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        before = len(self.hits)
        self._module(mod, node)
        for a in node.names:
            if len(self.hits) == before:  # `from torch import multiprocessing`
                self._module(f"{mod}.{a.name}", node)
            self.aliases[a.asname or a.name] = f"{mod}.{a.name}"

    def _resolve(self, func: ast.AST) -> str:
        name = _dotted(func)
        head, _, rest = name.partition(".")
        if head in self.aliases:
            name = self.aliases[head] + ("." + rest if rest else "")
        return name

    def visit_Constant(self, node: ast.Constant) -> None:
        if id(node) not in self.docstrings and node.value in ("pickle", "application/x-python-serialize"):
            self.hit(node, f"names the {node.value!r} serializer")

    def visit_Call(self, node: ast.Call) -> None:
        full = self._resolve(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        if full in ("torch.load", "torch.serialization.load") and not _is_true(kw.get("weights_only")):
            self.hit(node, "torch.load without weights_only=True")
        if full in ("numpy.load", "np.load") and _is_true(kw.get("allow_pickle")):
            self.hit(node, "numpy.load(allow_pickle=True)")
        if full.endswith("read_pickle") or full.endswith("ProcessPoolExecutor"):
            self.hit(node, full)
        attr = full.rsplit(".", 1)[-1]
        is_sa_text = attr == "text" and (
            full == "sqlalchemy.text" or full.startswith("sqlalchemy.") or full == "sa.text"
        )
        if attr in SQL_CALLS and (attr != "text" or is_sa_text) and node.args:
            sql = node.args[0]
            if _built_at_run_time(sql):
                self.hit(node, f"sql built at run time: {attr}")
            elif attr in LITERAL_ONLY and not _literal_str(sql):
                self.hit(node, f"{attr}() with a non-literal argument")
        self.generic_visit(node)


def scan(path: Path) -> list[Hit]:
    rel = path.relative_to(ROOT).as_posix()
    s = _Scanner(rel)
    s.visit(ast.parse(path.read_text(), filename=rel))
    return s.hits


def modules() -> list[Path]:
    found = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert len(found) > 30  # the scan really sees the code base
    return found


def test_no_pickle_and_only_bound_sql_parameters() -> None:
    hits = [h for p in modules() for h in scan(p)]
    used = {(h.path, h.func, h.rule) for h in hits}
    bad = [str(h) for h in hits if (h.path, h.func, h.rule) not in ALLOWED]
    assert not bad, "pickle or SQL built from strings (allow one only with a reason in ALLOWED):\n" + "\n".join(bad)
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries that match nothing any more; remove them: {stale}"


def test_the_scanner_finds_what_it_should(tmp_path) -> None:
    src = """
import pickle
import cloudpickle as cp
from dill import loads
import multiprocessing.pool
import torch
from sqlalchemy import text
import numpy as np

def f(conn, user, cur):
    torch.load("x.pt")
    torch.load("x.pt", weights_only=False)
    torch.load("x.pt", weights_only=True)          # fine
    np.load("a.npy", allow_pickle=True)
    conn.execute(text(f"SELECT * FROM t WHERE name = '{user}'"))
    conn.execute(text("SELECT * FROM t WHERE name = :n"), {"n": user})  # fine: literal + bound
    conn.exec_driver_sql("DELETE FROM t WHERE id = " + user)
    cur.execute("SELECT %s" % user)
    cur.execute("SELECT {}".format(user))
    conn.execute(text(user))
    app = dict(task_serializer="pickle")
"""
    p = tmp_path / "bad.py"
    p.write_text(src)
    s = _Scanner("bad.py")
    s.visit(ast.parse(src))
    rules = sorted(h.rule for h in s.hits)
    assert rules == sorted(
        [
            "import pickle",
            "import cloudpickle",
            "import dill",
            "import multiprocessing",
            "torch.load without weights_only=True",
            "torch.load without weights_only=True",
            "numpy.load(allow_pickle=True)",
            "sql built at run time: text",
            "sql built at run time: exec_driver_sql",
            "sql built at run time: execute",
            "sql built at run time: execute",
            "text() with a non-literal argument",
            "names the 'pickle' serializer",
        ]
    ), rules
