"""How long the front page and the manual's sentences are.

Prints README.md's lines and words, then, for each page under docs/, its lines, the
sentences of its prose and their mean length in words. Prose leaves out fenced code
blocks, HTML comments, headings and table rows; a sentence ends at ``.``, ``!`` or ``?``
followed by a space (not after an abbreviation such as "e.g."), or at the end of a
paragraph or list item. A sentence may start in lower case: a command or a name in
backquotes often starts one.

    python tools/doc_stats.py            # README.md and docs/**/*.md of this checkout
    python tools/doc_stats.py ROOT       # of another checkout
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMENT = re.compile(r"<!--.*?-->", re.S)
SENTENCE_END = re.compile(r"(?<=[.!?])[)\"']?\s+(?=\S)")
# Ends of words that end in a full stop without ending a sentence.
ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.")
LIST_ITEM = re.compile(r"\s*(?:[-*+]|\d+\.)\s+")


def prose_blocks(text: str) -> list[str]:
    """The paragraphs and list items of ``text``, without code, comments, headings, tables."""
    text = COMMENT.sub("", text)
    blocks: list[list[str]] = [[]]
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            blocks.append([])
            continue
        stripped = line.strip()
        if fenced or not stripped or stripped.startswith(("#", "|", ":::")):
            blocks.append([])
            continue
        if LIST_ITEM.match(line):
            blocks.append([])
            stripped = LIST_ITEM.sub("", line, count=1)
        blocks[-1].append(stripped)
    return [" ".join(b) for b in blocks if b]


def sentences(text: str) -> list[str]:
    """The sentences of ``text``'s prose.

    Example:
        >>> sentences("See e.g. this. `tfdist check` runs it. Ends here")
        ['See e.g. this.', '`tfdist check` runs it.', 'Ends here']
    """
    found: list[str] = []
    for block in prose_blocks(text):
        block_sentences: list[str] = []
        for piece in SENTENCE_END.split(block):
            if block_sentences and block_sentences[-1].endswith(ABBREVIATIONS):
                block_sentences[-1] = f"{block_sentences[-1]} {piece}"
            elif piece.split():
                block_sentences.append(piece)
        found += block_sentences
    return found


def page_stats(path: Path) -> tuple[int, int, float]:
    """(lines, sentences, mean words per sentence) of the page at ``path``."""
    text = path.read_text()
    found = sentences(text)
    words = sum(len(s.split()) for s in found)
    return len(text.splitlines()), len(found), words / len(found) if found else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=REPO, help="a checkout")
    root = parser.parse_args(argv).root
    readme = (root / "README.md").read_text()
    print(f"README.md: {len(readme.splitlines())} lines, {len(readme.split())} words")
    pages = sorted((root / "docs").rglob("*.md"))
    print(f"{'page':<32} {'lines':>6} {'sentences':>10} {'words/sentence':>15}")
    for page in pages:
        lines, count, mean = page_stats(page)
        print(f"{page.relative_to(root).as_posix():<32} {lines:>6} {count:>10} {mean:>15.1f}")
    total = [page_stats(p) for p in pages]
    print(f"docs/: {len(pages)} pages, {sum(t[0] for t in total)} lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
