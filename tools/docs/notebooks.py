"""Re-executes the walkthrough notebooks and stores them with their outputs.

Each notebook runs top to bottom on a real kernel (nbclient) with its own parameters
(or ``--param NAME=VALUE`` overrides, injected into the cell tagged ``parameters`` the way
papermill does), in a scratch folder so its files stay out of the repository. The stored
outputs are made readable: a progress line keeps only its final state (no ``\\r``), colour
codes are removed, and the known-harmless start-up lines (``tfdist.core.quiet``) are dropped.
The notebook's metadata and its last cell record the machine, the versions, the date and
the parameters that produced the outputs.

    python -m tools.docs.notebooks                      # all four, their own parameters
    python -m tools.docs.notebooks --only 01_mirrored_mnist --param EPOCHS=2
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat

from tfdist.core import quiet

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
STAMP_KEY = "tfdist_run"
STAMP_HEADING = "## How these outputs were produced"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# TensorFlow's own INFO log lines about its collectives and device lists: one per traced
# function, they repeat inside the epoch lines and say nothing the cells do not print.
TF_CHATTER = re.compile(r"^INFO:tensorflow:(Collective all_reduce|Using MirroredStrategy)")


def machine() -> dict:
    """CPU, cores, GPUs, versions and date (the benchmarks' stamp), GPUs as one string."""
    from tools.bench import harness

    stamp = harness.machine()
    stamp["gpus"] = ", ".join(stamp["gpus"]) or "none"
    return stamp


def clean_text(text: str) -> str:
    """Final state of each line, no colour codes, no harmless start-up lines.

    Example:
        >>> clean_text("1/9 \\x1b[32m==\\x1b[0m\\r9/9 done\\nI0000 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.\\n")
        '9/9 done\\n'
    """
    lines = []
    for line in ANSI.sub("", text).split("\n"):
        line = line.rsplit("\r", 1)[-1].replace("\x08", "")
        if not quiet.is_harmless(line) and not TF_CHATTER.match(line):
            lines.append(line)
    return "\n".join(lines)


def clean_outputs(nb) -> None:
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.outputs:
            if out.output_type == "stream":
                out.text = clean_text(out.text)
                if not out.text.strip():
                    continue
            kept.append(out)
        cell.outputs = kept


def _inject(nb, overrides: dict) -> None:
    if not overrides:
        return
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source += "\n# injected by tools/docs/notebooks.py\n" + "\n".join(
        f"{k} = {v!r}" for k, v in overrides.items()
    )


def _stamp(nb, stamp: dict) -> None:
    nb.metadata[STAMP_KEY] = stamp
    text = (
        f"{STAMP_HEADING}\n\n"
        f"Run with `python -m tools.docs.notebooks` on {stamp['date']}: {stamp['cpu']}, "
        f"{stamp['cores']} cores, GPUs: {stamp['gpus']}; Python {stamp['python']}, TensorFlow "
        f"{stamp['tensorflow']}, Keras {stamp['keras']}, jax {stamp['jax']}, tfdist "
        f"{stamp['tfdist']}. Parameters: {stamp['parameters'] or 'the defaults above'}. "
        f"The whole notebook took {stamp['wall_s']:.0f} s."
    )
    if nb.cells and nb.cells[-1].cell_type == "markdown" and STAMP_HEADING in nb.cells[-1].source:
        nb.cells[-1].source = text
    else:
        nb.cells.append(nbformat.v4.new_markdown_cell(text))


def run(path: Path, overrides: dict, timeout: float) -> dict:
    """Executes ``path`` in a scratch folder and saves it with its outputs."""
    nb = nbformat.read(path, as_version=4)
    stored = nbformat.read(path, as_version=4)
    _inject(nb, overrides)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{path.stem}-") as scratch:
        nbclient.NotebookClient(
            nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": scratch}}
        ).execute()
    wall = time.perf_counter() - start
    # Keep the stored sources (the injected overrides are recorded in the stamp instead).
    for ran, kept in zip(nb.cells, stored.cells, strict=False):
        ran.source = kept.source
    clean_outputs(nb)
    stamp = {**machine(), "parameters": overrides, "wall_s": round(wall, 1)}
    _stamp(nb, stamp)
    nbformat.write(nb, path)
    return stamp


def _param(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--param takes NAME=VALUE. Received: {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value  # a bare string, e.g. TRAIN_SPLIT=train[:5%]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="e.g. 01_mirrored_mnist")
    parser.add_argument("--param", action="append", type=_param, default=[], metavar="K=V")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per cell")
    args = parser.parse_args(argv)
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.only:
        unknown = sorted(set(args.only) - {p.stem for p in paths})
        if unknown:
            parser.error(
                f"--only: unknown notebook(s) {unknown}; choose from {[p.stem for p in paths]}"
            )
        paths = [p for p in paths if p.stem in args.only]
    for path in paths:
        print(f"run_notebooks: {path.name} ...", file=sys.stderr, flush=True)
        stamp = run(path, dict(args.param), args.timeout)
        print(f"run_notebooks: {path.name} done in {stamp['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
