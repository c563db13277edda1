"""The size bars of ``ivr/`` (issue 23): no function over 60 lines, no module over 500, no class
over 25 methods.

A ratchet: ``scripts/size_bars_known.txt`` lists the violators that predate the bars. A new
violator fails; so does a listed one that no longer violates (delete its line: the list only
shrinks, so a part once brought under the bar cannot slip back). A listed one that grew is
reported, not failed, so that merging work on it stays easy.

    .venv/bin/python scripts/size_bars.py            # report, exit 1 on a new or stale entry
    .venv/bin/python scripts/size_bars.py --write    # rewrite the list from today's violators
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ivr"
KNOWN = ROOT / "scripts" / "size_bars_known.txt"
BARS = {"module": 500, "function": 60, "class": 25}
UNITS = {"module": "lines", "function": "lines", "class": "methods"}


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    """``module``, ``function`` or ``class``."""
    name: str
    """``ivr/x.py``, ``ivr/x.py:Class.method`` or ``ivr/x.py:Class``."""
    size: int

    def line(self) -> str:
        return f"{self.kind} {self.name} {self.size}"


def measure(path: Path, root: Path = ROOT) -> list[Violation]:
    """What of the module at ``path`` is over a bar, named relative to ``root``."""
    rel = path.relative_to(root).as_posix()
    text = path.read_text(encoding="utf-8")
    found = []
    if (lines := len(text.splitlines())) > BARS["module"]:
        found.append(Violation("module", rel, lines))
    found += _walk(ast.parse(text, filename=rel).body, rel, "")
    return found


def _walk(body: list[ast.stmt], rel: str, prefix: str) -> list[Violation]:
    found = []
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            span = (node.end_lineno or node.lineno) - node.lineno + 1
            if span > BARS["function"]:
                found.append(Violation("function", f"{rel}:{name}", span))
            found += _walk(node.body, rel, name + ".")
        elif isinstance(node, ast.ClassDef):
            name = prefix + node.name
            methods = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body)
            if methods > BARS["class"]:
                found.append(Violation("class", f"{rel}:{name}", methods))
            found += _walk(node.body, rel, name + ".")
        else:  # functions defined under if/try/with blocks
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.AST):
                    found += _walk(inner, rel, prefix)
    return found


def read_known(path: Path = KNOWN) -> dict[tuple[str, str], int]:
    known = {}
    if path.exists():
        for raw in path.read_text(encoding="utf-8").splitlines():
            line = raw.split("#", 1)[0].strip()
            if line:
                kind, name, size = line.split()
                known[(kind, name)] = int(size)
    return known


def compare(
    found: list[Violation], known: dict[tuple[str, str], int]
) -> tuple[list[Violation], list[tuple[str, str]]]:
    """(violators not in the list, listed ones no longer over their bar)."""
    new = [v for v in found if (v.kind, v.name) not in known]
    present = {(v.kind, v.name) for v in found}
    return new, [key for key in known if key not in present]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the list of known ones")
    args = parser.parse_args(argv)
    found = sorted(
        (v for path in sorted(PACKAGE.rglob("*.py")) for v in measure(path)),
        key=lambda v: (v.kind, v.name),
    )
    if args.write:
        header = "# Violators of the size bars that predate them (scripts/size_bars.py).\n"
        KNOWN.write_text(header + "".join(v.line() + "\n" for v in found), encoding="utf-8")
        print(f"size bars: {len(found)} known violators written to {KNOWN.relative_to(ROOT)}")
        return 0
    known = read_known()
    new, stale = compare(found, known)
    for v in found:
        bar = f"{BARS[v.kind]} {UNITS[v.kind]}"
        was = known.get((v.kind, v.name))
        if was is None:
            note = "NEW: bring it under the bar"
        elif v.size > was:
            note = f"known, grew from {was}"
        else:
            note = "known"
        print(f"size bars: {v.kind} {v.name}: {v.size} {UNITS[v.kind]} (bar {bar}; {note})")
    for kind, name in stale:
        print(f"size bars: {kind} {name} is under its bar now: delete its line in {KNOWN.name}")
    print(f"size bars: {len(found)} over ({len(found) - len(new)} known, {len(new)} new)")
    return 1 if new or stale else 0


if __name__ == "__main__":
    sys.exit(main())
