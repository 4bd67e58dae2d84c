"""docs/idioms.md's idiom table, generated from the idiom matrix's own lists.

``tests/scripts/idioms_job.py`` lists the idioms (``IDIOMS``); ``EXPECTED`` below lists
the cells that cannot equal one device, with why; ``tests/e2e/test_idioms.py`` checks every
cell against one device and checks that docs/idioms.md holds exactly this table.

    python -m tools.docs.idiom_table            # print the table
    python -m tools.docs.idiom_table --write    # replace it in docs/idioms.md
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from tools import generated_block

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "scripts" / "idioms_job.py"
BEGIN, END = "<!-- idiom table: begin -->", "<!-- idiom table: end -->"

# Largest difference from one device that counts as equal, per idiom.
TOLERANCE = {
    "default": 1e-5,
    # float16 has 10 mantissa bits: the batch split changes the rounding of its sums
    # (measured: 1.3e-4 on JAX after 8 steps).
    "mixed_float16": 3e-4,
    "mixed_float16_settled": 3e-4,
    # bfloat16 has 8: the same, four times coarser.
    "mixed_bfloat16": 2e-3,
}

# (idiom, backend or "*", topology or "*") -> ("differs", why) or ("error", why, message)
EXPECTED = {
    ("dropout_seeded", "tensorflow", "*"): (
        "differs",
        "each replica draws its own dropout mask for its part of the batch",
    ),
    ("mixed_float16", "tensorflow", "*"): (
        "differs",
        "the first steps' float16 overflow skips depend on the per-replica batch (the "
        "default loss scale 32768 overflows a full batch, not a half); equal within 3e-4 "
        "once the scale fits (mixed_float16_settled)",
    ),
    ("batch_norm", "tensorflow", "*"): (
        "differs",
        "each replica normalises with its own part of the batch: use "
        "synchronized=True or tfdist.scope(sync_batchnorm=True) (tfdist warns)",
    ),
    ("batch_norm_synchronized", "jax", "*"): (
        "error",
        "Keras on JAX refuses synchronized=True (on one device too); its statistics are "
        "already global: use BatchNormalization()",
        "only supported with the TensorFlow backend",
    ),
}


def idioms() -> list[str]:
    """The idiom names, read from the job's ``IDIOMS`` without importing Keras."""
    for node in ast.parse(JOB.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if getattr(target, "id", "") == "IDIOMS":
                return [key.value for key in node.value.keys]
    raise RuntimeError(f"{JOB} defines no IDIOMS")


def _descriptions() -> dict[str, tuple[str, str]]:
    for node in ast.parse(JOB.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "IDIOMS":
            return {
                key.value: (value.elts[0].value, value.elts[1].value)
                for key, value in zip(node.value.keys, node.value.values, strict=True)
            }
    raise RuntimeError(f"{JOB} defines no IDIOMS")


def expected(idiom: str, backend: str, topology: str):
    """The expectation for one cell, or None (equal to one device)."""
    for key in ((idiom, backend, topology), (idiom, backend, "*"), (idiom, "*", topology)):
        if key in EXPECTED:
            return EXPECTED[key]
    return EXPECTED.get((idiom, "*", "*"))


def _cell(idiom: str, backend: str) -> str:
    states = {expected(idiom, backend, t) for t in ("2 devices", "2 workers")}
    if states == {None}:
        tolerance = TOLERANCE.get(idiom, TOLERANCE["default"])
        return f"equal, within {tolerance:g}"
    return "; ".join(f"{'differs' if s[0] == 'differs' else 'error'}: {s[1]}" for s in states if s)


def markdown() -> str:
    rows = [
        BEGIN,
        "| group | idiom | TensorFlow: 2 devices, 2 workers | JAX: 2 devices, 2 processes |",
        "|---|---|---|---|",
    ]
    for name, (group, text) in _descriptions().items():
        rows.append(f"| {group} | `{text}` | {_cell(name, 'tensorflow')} | {_cell(name, 'jax')} |")
    rows.append(END)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/idioms.md")
    args = parser.parse_args(argv)
    table = markdown()
    if not args.write:
        print(table)
        return 0
    return generated_block.replace(REPO / "docs" / "idioms.md", BEGIN, END, table, "idiom_table")


if __name__ == "__main__":
    sys.exit(main())
