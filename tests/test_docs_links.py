"""Relative links in the README and docs/ point at files and headings that exist.

Every ``[text](path)`` and ``[text](path#anchor)`` outside code in ``README.md`` and
``docs/*.md`` is checked: the target must exist relative to the linking file, and an
anchor into a Markdown file must be the GitHub slug of one of its headings (lowercase,
spaces to hyphens, punctuation other than hyphens and underscores removed, ``-1``,
``-2``... for repeats). Links with a scheme (``https:``, ``mailto:``...) are skipped.
The README and docs name the design documents only through links into docs/.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(?:.+?)\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*)(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_BARE_DESIGN_DOC = re.compile(r"(?<![\w/.-])(?:MORI|ENGINES|COSTMODEL|ARCHITECTURE)\.md\b")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced and indented code blocks."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    prev_blank, prev_code = True, False
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        blank = not line.strip()
        code = not blank and line.startswith(("    ", "\t")) and (prev_blank or prev_code)
        if not code:
            out.append((n, line))
        if not blank:
            prev_code = code
        prev_blank = blank
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of every heading (ATX and setext) of a Markdown file."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    prev: str | None = None
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        heading = None
        m = _ATX.match(line)
        if m:
            heading = m.group(2) or ""
        elif (_SETEXT.match(line) and prev is not None and prev.strip()
              and not _ATX.match(prev) and not prev.lstrip().startswith(("|", "-", "*", ">"))):
            heading = prev.strip()
        prev = line
        if heading is None:
            continue
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link or image outside code."""
    found: list[tuple[int, str]] = []
    for n, line in prose_lines(path.read_text(encoding="utf-8")):
        line = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
        for m in _LINK.finditer(line):
            found.append((n, m.group(1).strip("<>")))
    return found


def test_slug_follows_github() -> None:
    assert slug("MORI — idleness-ranked KV-cache tiering") == "mori--idleness-ranked-kv-cache-tiering"
    assert slug("Traces: `mori trace import | stats | synth`") == \
        "traces-mori-trace-import--stats--synth"
    assert slug("The paper's evaluation") == "the-papers-evaluation"
    assert slug("5. Sizing the policy's GPU tier") == "5-sizing-the-policys-gpu-tier"


def test_links_are_found_outside_code() -> None:
    text = ("[a](x.md) `[b](y.md)`\n\n    [c](z.md)\n\n```\n[d](w.md)\n```\n"
            "[e](https://example.com) [f](v.md#h \"title\")\n")
    lines = prose_lines(text)
    found = [m.group(1) for _, line in lines
             for m in _LINK.finditer(_CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line))]
    assert found == ["x.md", "https://example.com", "v.md#h"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken: list[str] = []
    for n, target in links(doc):
        if not target or _SCHEME.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / unquote(path_part)).resolve() if path_part else doc
        where = f"{doc.relative_to(ROOT)}:{n}: {target}"
        if not dest.exists():
            broken.append(f"{where}: no such file")
        elif (anchor and dest.suffix == ".md" and dest.is_file()
              and unquote(anchor).lower() not in anchors(dest)):
            broken.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_docs_exist() -> None:
    for name in ("system.md", "engines.md", "costmodel.md", "architecture.md"):
        assert (ROOT / "docs" / name).is_file(), f"docs/{name} is missing"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_design_docs_named_only_as_docs_links(doc: Path) -> None:
    """``MORI.md``, ``ENGINES.md``, ``COSTMODEL.md`` and ``ARCHITECTURE.md`` are not in
    the repository: their content is in docs/, and the README and docs link there."""
    stray = []
    for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        outside_links = _LINK.sub(
            lambda m: " " if _in_docs(doc, m.group(1)) else m.group(0), line)
        for m in _BARE_DESIGN_DOC.finditer(outside_links):
            stray.append(f"{doc.relative_to(ROOT)}:{n}: {m.group(0)}")
    assert not stray, ("design documents cited that are not in the repository; "
                       "link the docs/ page instead:\n" + "\n".join(stray))


def _in_docs(doc: Path, target: str) -> bool:
    """Whether a link's target is a file under docs/."""
    path_part = target.strip("<>").partition("#")[0]
    if not path_part or _SCHEME.match(path_part):
        return False
    return (doc.parent / path_part).resolve().parent == (ROOT / "docs").resolve()
