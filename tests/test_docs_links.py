"""The documents a reader follows: every relative link in README.md, ARCHITECTURE.md, docs/*.md and
deploy/README.md (a pointer to docs/deployment.md) points to a file that exists (and a `#anchor` to
a heading of that page), the README stays a doorway (it starts with the two commands, ~150 lines,
~10k characters), and every results/*.md is linked from docs/."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "deploy/README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans: a `[x](y)` there is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Every link target (inline links and images) in markdown prose."""
    return LINK.findall(prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", FENCE.sub("", text), re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken(page: Path) -> list[str]:
    """The links of one page that do not resolve, as `target (why)`."""
    out = []
    for target in links(page.read_text()):
        if SCHEME.match(target) or target.startswith("//"):
            continue  # http(s), mailto: not this test's business
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if REPO not in (dest, *dest.parents):
            out.append(f"{target} (outside the repository)")
        elif not dest.exists():
            out.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            out.append(f"{target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    return out


def test_parsers() -> None:
    text = (
        'See [a](docs/a.md#x-y), ![img](p.png "t"), `[not](code.md)`, [web](https://x.org).\n```\n[nor](this.md)\n```\n'
    )
    assert links(text) == ["docs/a.md#x-y", "p.png", "https://x.org"]
    assert slug("Weights: relay fan-out") == "weights-relay-fan-out"
    assert slug("`asyncrl run` and the `--keep` flag") == "asyncrl-run-and-the---keep-flag"
    assert slug("Staleness: admission by version") == "staleness-admission-by-version"
    assert anchors("# A\n## B\n```\n# not\n```\n## B\n") == {"a", "b", "b-1"}


def test_every_relative_link_resolves() -> None:
    assert len(DOCS) >= 8, [p.name for p in DOCS]
    bad = {str(p.relative_to(REPO)): b for p in DOCS if (b := broken(p))}
    assert not bad, f"links that do not resolve: {bad}"


def test_readme_is_a_doorway() -> None:
    text = (REPO / "README.md").read_text()
    first_block = FENCE.search(text)
    assert first_block and first_block.start() < 200, "the README starts with its two commands"
    assert re.search(r"^\./scripts/demo\.sh\b", first_block.group(0), re.M)
    assert re.search(r"^\./scripts/test\.sh\b", first_block.group(0), re.M)
    assert len(text.splitlines()) <= 160, "move detail into docs/: a README is a doorway, not the house"
    assert len(text) <= 10_500, "move detail into docs/: a README is a doorway, not the house"
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(text) if not SCHEME.match(t)}
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"the README's index of docs/ leaves out {missing}"


def test_every_results_page_is_linked_from_docs() -> None:
    linked = {
        (p.parent / t.partition("#")[0]).resolve() for p in DOCS for t in links(p.read_text()) if not SCHEME.match(t)
    }
    pages = sorted((REPO / "results").rglob("*.md"))
    assert pages
    missing = [str(p.relative_to(REPO)) for p in pages if p.resolve() not in linked]
    assert not missing, f"results pages no document links: {missing}"
