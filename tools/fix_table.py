"""The docs' list of fixes, generated from the ``Fix`` records (``tfdist.compat.FIXES``).

    python tools/fix_table.py            # print the table
    python tools/fix_table.py --write    # replace it in docs/fixes.md

tests/core/test_fix_guards.py checks the page holds exactly this table, and
tests/compat/test_fix_docs.py that every fix says where it acts and that its no-harm checks
exist. A no-harm check is shown by its file's name and test (``test_no_harm.py::test_f``,
no ``tests/`` path: the docs' citation rule is for prose) or, for a case of the no-harm
matrix, by the case's name.
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
    """The Keras backends the fix is for, from its guard (no Keras import): the backend
    its ``on_keras_backend`` closure holds, or the names its guard's code compares with."""
    applies = fix.applies
    found = [cell.cell_contents for cell in applies.__closure__ or ()]
    code = getattr(applies, "__code__", None)
    found += list(code.co_consts) if code is not None else []
    backends = [b for b in ("tensorflow", "jax") if b in found]
    return ", ".join(backends) or "tensorflow"  # on_tensorflow_backend(): TensorFlow's runtime


def _check_name(check: str) -> str:
    """``tests/compat/test_x.py::test_f[p]`` -> ``test_x.py::test_f[p]``; a case as is."""
    path, sep, test = check.partition("::")
    if not sep:
        return f"case `{check}`"
    return f"`{path.rsplit('/', 1)[-1]}::{test}`"


def _no_harm(fix) -> str:
    return ", ".join(_check_name(check) for check in fix.no_harm) or "none yet"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "/")


def markdown() -> str:
    rows = [
        BEGIN,
        "| Fix | Backend | What breaks upstream without it | Patches | Acts only where "
        "| No-harm checks |",
        "|---|---|---|---|---|---|",
    ]
    for fix in compat.FIXES:
        if not fix.acts_where.strip():
            raise ValueError(f"fix {fix.name} does not say where it acts (acts_where)")
        patched = fix.targets[0].entry.split(":", 1)[1] if fix.targets else "-"
        rows.append(
            f"| `{fix.name}` | {_backend(fix)} | {_cell(fix.summary)} | `{patched}` "
            f"| {_cell(fix.acts_where)} | {_cell(_no_harm(fix))} |"
        )
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
