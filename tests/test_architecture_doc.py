"""ARCHITECTURE.md is the document code may point to: every path it names exists, and no module
cites a file that is not in the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "broker", "generator_svc", "reward_svc", "trainer_svc", "asyncrl", "bench")


def named_paths(text: str) -> set[str]:
    """Backticked repository paths: `pkg/module.py`, `pkg/folder/`."""
    return {m for m in re.findall(r"`([\w./-]+)`", text) if "/" in m and not m.startswith(("{", "http"))}


def test_named_paths_parser() -> None:
    assert named_paths("see `broker/ledger/` and `shared/ids.py`, not `k` or `{job}:dead`") == {
        "broker/ledger/",
        "shared/ids.py",
    }


def test_every_path_in_the_architecture_exists() -> None:
    names = named_paths((REPO / "ARCHITECTURE.md").read_text())
    assert len(names) > 30
    missing = sorted(n for n in names if not (REPO / n).exists())
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {missing}"


def test_no_module_cites_a_file_outside_the_repository() -> None:
    outside = re.compile(r"DESIGN\.md|STYLE\.md|\bSTYLE \d|shared/notes/|shared/reference/")
    found = [
        f"{p.relative_to(REPO)}:{i}"
        for pkg in PACKAGES
        for p in sorted((REPO / pkg).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert not found, f"cite ARCHITECTURE.md (or nothing) instead: {found}"
