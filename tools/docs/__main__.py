"""Regenerates every generated block in docs/ and README.md, or checks them.

    python -m tools.docs               # write every block
    python -m tools.docs --check       # name the blocks that are out of date (exit 1)
    python -m tools.docs --notebooks   # also re-execute and save the notebooks (minutes)

The blocks: the measured figures (tools/docs/figures.py, from tools/results/), docs/idioms.md's
idiom table (tools/docs/idiom_table.py), docs/corpus.md's table of the Keras examples
(tools/docs/corpus_table.py, from tools/results/corpus.json), the check's verdicts on it
(tools/docs/corpus_checks.py, from tools/results/corpus_checks.json) and docs/fixes.md's fix table (tools/fix_table.py,
run as a script), and the Reference pages (tools/docs/reference.py). tools/fix_fingerprints.py is not a generator of pages: it records which
TensorFlow/Keras pair the fixes were verified against (the compat sessions run it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from tools.docs import corpus_checks, corpus_table, figures, idiom_table, reference

REPO = idiom_table.REPO
FIX_TABLE = REPO / "tools" / "fix_table.py"
FIX_PAGE = REPO / "docs" / "fixes.md"


def _fix_table(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(FIX_TABLE), *args], cwd=REPO, capture_output=True, text=True
    )


def stale() -> list[str]:
    """The generated blocks whose page does not hold them as generated now."""
    expected = [(name, page, block) for name, (page, block) in figures.blocks().items()]
    expected.append(("idiom table", REPO / "docs" / "idioms.md", idiom_table.markdown()))
    expected.append(("corpus table", corpus_table.PAGE, corpus_table.markdown()))
    expected.append(("corpus checks", corpus_table.PAGE, corpus_checks.markdown()))
    table = _fix_table()
    if table.returncode != 0:
        raise RuntimeError(f"tools/fix_table.py failed:\n{table.stderr[-3000:]}")
    expected.append(("fix table", FIX_PAGE, table.stdout.rstrip("\n")))
    stale = [
        f"{name} ({page.name})" for name, page, block in expected if block not in page.read_text()
    ]
    return stale + [
        f"reference ({path.name})"
        for path, text in reference.pages().items()
        if not path.exists() or path.read_text() != text
    ]


def write() -> int:
    """Writes every block; 0, or 1 when a page lacks a block's markers."""
    status = figures.main(["--write"]) | idiom_table.main(["--write"])
    status |= corpus_table.main(["--write"])
    status |= corpus_checks.main(["--write"])
    status |= reference.main(["--write"])
    fix = _fix_table("--write")
    sys.stderr.write(fix.stderr)
    return status | (fix.returncode != 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    parser.add_argument("--notebooks", action="store_true", help="re-execute the notebooks too")
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale()
        for name in out_of_date:
            print(f"out of date: {name}; run python -m tools.docs")
        return 1 if out_of_date else 0
    status = write()
    if args.notebooks:
        from tools.docs import notebooks

        status |= notebooks.main([])
    return status


if __name__ == "__main__":
    sys.exit(main())
