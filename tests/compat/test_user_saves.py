"""A script's own ``model.save`` / ``save_weights`` on every worker (the last line of most
Keras guides, run by every worker of a multi-worker script).

``tests/scripts/user_saves_job.py`` saves and loads 20 times on every worker, with no
barrier between a save and its load, then saves in every other way scripts do: the chief
alone inside ``fit`` (a rank-guarded callback) and after it, the chief alone then every
worker, ``keras.saving.save_model``, ``model.export`` by every worker, the TensorFlow
tutorial's per-worker paths. The fix ``keras_user_saves_chief_writes`` must make every
load read the weights just saved, on every worker, on both backends, and no save may
wait for a worker that does not save (the job would hang in ``fit``); upstream tears the
file saved by every worker. A chief killed -9 inside a save leaves the previous file whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SCRIPTS, launch_cli, run_python

JOB = SCRIPTS / "user_saves_job.py"


def _results(proc) -> dict:
    results = {}
    for line in proc.stdout.splitlines():
        if "SAVES " in line:
            result = json.loads(line[line.index("SAVES ") + len("SAVES ") :])
            results[result["worker"]] = result
    return results


def _run(tmp_path, backend: str, *args: str, **env):
    return launch_cli(
        "-n", "2", str(JOB), str(tmp_path), *args, timeout=600, KERAS_BACKEND=backend, **env
    )


def check_saves(results: dict, directory: Path, backend: str) -> None:
    """Both workers reported, their model trained on both (``trained_on``: a model built
    outside ``tfdist.scope()`` trains on its worker alone), every load read the weights
    just saved, and ``directory`` holds the saved files only."""
    assert sorted(results) == [0, 1] and all(r["workers"] == 2 for r in results.values())
    for worker, result in results.items():
        ran_on = result["trained_on"]
        assert ran_on == [{"replicas": 2, "workers": 2}], (worker, "trained_on", ran_on)
        assert result["failures"] == [], (worker, result["failures"][:5])
        assert result["worst"] == 0.0
    # the workers' own paths were removed by them; nothing else but the saved files
    expected = ["callback.keras", "chief.keras", "counts.weights.h5", "function.keras"]
    expected += ["model.keras", "tutorial.keras", "w.weights.h5"]
    expected += ["export"] if backend == "tensorflow" else []
    assert sorted(p.name for p in directory.iterdir()) == sorted(expected)


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_twenty_saves_and_loads_on_every_worker(tmp_path, backend):
    proc = _run(tmp_path, backend, "20")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    check_saves(_results(proc), tmp_path, backend)


@pytest.mark.multiworker
@pytest.mark.upstream_failure("keras_user_saves_chief_writes")
def test_upstream_tears_the_file_saved_by_every_worker(tmp_path):
    proc = _run(tmp_path, "tensorflow", "20", TFDIST_COMPAT_EXCLUDE="keras_user_saves_chief_writes")
    results = _results(proc)
    failures = [f for result in results.values() for f in result["failures"]]
    assert failures, "upstream now saves safely from every worker"


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_chief_killed_inside_a_save_leaves_the_previous_file(tmp_path):
    proc = _run(tmp_path, "tensorflow", "0", "kill")
    assert proc.returncode != 0, "the chief was to be killed inside its save"
    code = f"""
        import sys
        sys.path.insert(0, {str(SCRIPTS)!r})
        import equivalence, keras, numpy as np
        model = keras.models.load_model({str(tmp_path / "model.keras")!r})
        saved = np.load({str(tmp_path / "saved-0.npz")!r})
        equivalence.assert_close([saved[k] for k in saved.files], model.get_weights(), 0.0)
        print("the previous file, whole")
    """
    assert "the previous file, whole" in run_python(code).stdout
