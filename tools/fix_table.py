"""The docs' list of fixes, generated from the ``Fix`` records (``tfdist.compat.FIXES``).

    python tools/fix_table.py            # print the table
    python tools/fix_table.py --write    # replace it in docs/fixes.md

tests/core/test_fix_guards.py checks the page holds exactly this table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import generated_block

from tfdist import compat

PAGE = Path(__file__).resolve().parents[1] / "docs" / "fixes.md"
BEGIN, END = "<!-- fix table: begin -->", "<!-- fix table: end -->"


def _backend(fix) -> str:
    """Which Keras backend the fix is for, from its guard's closure (no Keras import)."""
    for cell in fix.applies.__closure__ or ():
        if cell.cell_contents in ("tensorflow", "jax"):
            return cell.cell_contents
    return "tensorflow"  # on_tensorflow_backend(): TensorFlow's runtime


def markdown() -> str:
    rows = [
        BEGIN,
        "| fix | backend | what breaks upstream without it | patches |",
        "|---|---|---|---|",
    ]
    for fix in compat.FIXES:
        patched = fix.targets[0].entry.split(":", 1)[1] if fix.targets else "-"
        summary = fix.summary.replace("|", "/")
        rows.append(f"| `{fix.name}` | {_backend(fix)} | {summary} | `{patched}` |")
    rows.append(END)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the table in {PAGE}")
    args = parser.parse_args(argv)
    table = markdown()
    if not args.write:
        print(table)
        return 0
    return generated_block.replace(PAGE, BEGIN, END, table, "fix_table")


if __name__ == "__main__":
    sys.exit(main())
