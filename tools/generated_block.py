"""Writes a generated block between its two marker comments in a document.

Used by tools/docs/ (the figures, docs/idioms.md's idiom table) and tools/fix_table.py (docs/fixes.md).
"""

from __future__ import annotations

import sys
from pathlib import Path


def replace(path: Path, begin: str, end: str, block: str, tool: str) -> int:
    """Replaces ``begin ... end`` in ``path`` by ``block`` (which holds both markers).

    Returns 0, or 1 after saying so when ``path`` has no ``begin`` marker.
    """
    text = path.read_text()
    if begin not in text:
        print(f"{tool}: {path.name} has no {begin!r} marker", file=sys.stderr)
        return 1
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(head + block + tail)
    return 0
