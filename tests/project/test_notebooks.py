"""Every walkthrough notebook runs top to bottom on a real kernel, with small parameters.

Every notebook runs twice (``RERUN``): the second run goes into the same working folder, as
a reader who reruns a notebook does (01 resumes from its checkpoints with nothing left to
train). Each has one cell tagged ``parameters`` whose values the test overrides (fewer
epochs, a slice of MNIST), the way papermill would. The notebooks are stored WITH the outputs of a full run
(``python -m tools.docs.notebooks``), so a reader on the web sees them; the test checks
they are there and readable, not that a rerun reproduces them byte for byte.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tfdist.core import quiet

from conftest import REPO, child_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))

# Small values that keep each notebook to a minute or two on 2 CPU cores.
OVERRIDES = {
    "01_mirrored_mnist": {"EPOCHS": 2, "TRAIN_SPLIT": "train[:5%]"},
    "02_restart_from_checkpoint": {"EPOCHS": 2, "TRAIN_SPLIT": "train[:10%]", "SAVE_FREQ": 5},
    "03_multi_worker_mnist": {"EPOCHS": 1, "TRAIN_SPLIT": "train[:5%]"},
    "04_jax_data_and_model_parallel": {"TRAIN_SPLIT": "train[:5%]", "TIMED_STEPS": 5},
}


ANSI_OR_REDRAW = re.compile(r"\x1b\[|\r|\x08")
# Each notebook runs twice into the same folder: a reader reruns it over what the first run
# left (01 then resumes from its checkpoints; 02 empties its folder first; 03 and 04
# overwrite their outputs), and a rerun must work as well as the first.
RERUN = {
    "01_mirrored_mnist",
    "02_restart_from_checkpoint",
    "03_multi_worker_mnist",
    "04_jax_data_and_model_parallel",
}
# Notebooks whose outputs must include a figure (curves, digits, confusion matrix).
WITH_FIGURES = {"01_mirrored_mnist", "03_multi_worker_mnist"}
# What tools/docs/notebooks.py records about the run that produced the stored outputs.
STAMP_FIELDS = {"date", "cpu", "cores", "python", "tensorflow", "keras", "jax", "tfdist", "wall_s"}


def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    return "".join(str(v) for k, v in output.get("data", {}).items() if k.startswith("text/"))


def test_every_notebook_is_stored_with_readable_outputs_and_has_parameters():
    assert {p.stem for p in NOTEBOOKS} == set(OVERRIDES)
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        counts = [c.execution_count for c in code]
        # One top-to-bottom run of a fresh kernel numbers the cells 1, 2, 3, ...
        assert counts == list(range(1, len(code) + 1)), f"{path.name}: not run in order"
        assert any(c.outputs for c in code), f"{path.name}: stored without outputs"
        outputs = [o for c in code for o in c.outputs]
        assert not any(o.output_type == "error" for o in outputs), path.name
        assert not [o for o in outputs if ANSI_OR_REDRAW.search(_text(o))], path.name
        banners = [
            line for o in outputs for line in _text(o).splitlines() if quiet.is_harmless(line)
        ]
        assert not banners, f"{path.name}: start-up banners in the stored outputs: {banners[:3]}"
        if path.stem in WITH_FIGURES:
            assert any("image/png" in o.get("data", {}) for o in outputs), path.name
        stamp = nb.metadata.get("tfdist_run")
        assert stamp and STAMP_FIELDS <= set(stamp), f"{path.name}: no machine/versions stamp"
        assert stamp["date"] in nb.cells[-1].source, f"{path.name}: no stamp in the last cell"
        assert path.stat().st_size < 400_000, f"{path.name}: outputs too large (small PNGs)"
        tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: exactly one cell must be tagged 'parameters'"
        for name in OVERRIDES[path.stem]:
            assert f"{name} =" in tagged[0].source, f"{path.name} has no parameter {name}"


def _execute(path: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # run from a clean slate, as a reader's "Restart & Run All"
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    overrides = dict(OVERRIDES[path.stem], WORKDIR=str(tmp_path / "work"))
    cell.source += "\n# injected by the test\n" + "\n".join(
        f"{k} = {v!r}" for k, v in overrides.items()
    )
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    # The notebooks assert their own results (equal predictions, exit codes, agreeing
    # workers); check here that every code cell actually ran.
    assert all(c.execution_count for c in nb.cells if c.cell_type == "code")


@pytest.mark.slow
@pytest.mark.mnist
@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=[pytest.mark.jax] if "jax" in p.stem else []) for p in NOTEBOOKS],
    ids=[p.stem for p in NOTEBOOKS],
)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    # The kernel inherits this environment: quiet TensorFlow, no cluster from the shell.
    env = child_env()
    for key in list(os.environ):
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _execute(path, tmp_path)
    if path.stem in RERUN:
        _execute(path, tmp_path)  # a rerun into the same folder must work as well
