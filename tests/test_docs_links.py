"""The documentation holds together: every relative link in README.md, docs/*.md and benchmarks/RESULTS.md
names a file that exists (beside the page that links to it), and the README stays short enough to read in
five minutes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 320

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)  # fenced code blocks
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)  # inline code: `x`, ``x ` y``
# [text](target) and ![alt](target); the target may carry a title ("...") and may be written <in brackets>
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ftp: ...


def pages() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]
    return [page for page in found if page.exists()]


def links(text: str) -> list[str]:
    """Every link target in markdown `text`, code blocks and code spans left out."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return [match.group(1).strip("<>") for match in LINK.finditer(text)]


def relative(target: str) -> str | None:
    """The file part of a relative link ('' for a link to an anchor of the same page); None for an absolute URL."""
    if SCHEME.match(target) or target.startswith("//"):
        return None
    return target.split("#", 1)[0].split("?", 1)[0]


def test_link_parser_reads_what_markdown_reads():
    text = ("See [the CLI](docs/cli.md), [a part](docs/cli.md#exit-codes), [here](#top), ![img](a.svg \"t\"),\n"
            "[web](https://example.com/x), [mail](mailto:a@b.c), `[not](a link.md)`\n```\n[nor](this.md)\n```\n")
    assert links(text) == ["docs/cli.md", "docs/cli.md#exit-codes", "#top", "a.svg", "https://example.com/x",
                           "mailto:a@b.c"]
    assert [relative(t) for t in links(text)] == ["docs/cli.md", "docs/cli.md", "", "a.svg", None, None]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    missing = []
    for target in links(page.read_text(encoding="utf-8")):
        path = relative(target)
        if path is None or path == "":  # an absolute URL, or an anchor on this page
            continue
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def anchors(text: str) -> set[str]:
    """The anchors GitHub makes for a page: each heading's slug (lower case, punctuation but hyphens dropped,
    spaces made hyphens; a repeated slug gets -1, -2...) and every explicit `<a id=...>` / `name=...`."""
    found: set[str] = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_anchor_slugs_follow_github():
    text = "# Trust: the referee\n## A call's own cost\n### 2026-12-03: ninth run\n## Usage\n## Usage\n"
    assert anchors(text) == {"trust-the-referee", "a-calls-own-cost", "2026-12-03-ninth-run", "usage", "usage-1"}


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_anchors_resolve(page: Path):
    """A link to a heading of a markdown page names a heading that page has."""
    missing = []
    for target in links(page.read_text(encoding="utf-8")):
        path = relative(target)
        if path is None or "#" not in target:
            continue
        linked = (page.parent / path) if path else page
        if linked.suffix != ".md" or not linked.is_file():
            continue
        if target.split("#", 1)[1] not in anchors(linked.read_text(encoding="utf-8")):
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to headings that do not exist: {missing}"


def test_docs_pages_exist():
    assert (ROOT / "README.md").exists()
    assert list((ROOT / "docs").glob("*.md")), "no docs pages"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}: move detail to docs/"
