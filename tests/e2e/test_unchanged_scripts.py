"""A script as the Keras examples write it (no tfdist, no strategy) runs distributed unchanged.

tests/scripts/keras_example_convnet.py is run as a user runs it, in fresh interpreters with
every import a user's process makes: ``python script.py`` (the reference, one device),
``TFDIST_CPU_DEVICES=2 python -m tfdist.bootstrap script.py`` and ``tfdist launch -n 2
script.py``. ``--unscoped-models local`` keeps upstream's one replica per process; a
strategy the script opens itself after an unscoped model still works; a model built after
``keras.backend.clear_session()`` still trains on the job. That unchanged scripts train on
every replica of the job and end as one device does, on both backends, is
tests/e2e/test_corpus.py's (thirteen of the Keras examples' shapes, the same topologies).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfdist.core import config

from conftest import REPO, SCRIPTS, cold_env, equivalence

SCRIPT = str(SCRIPTS / "keras_example_convnet.py")
ANNOUNCED = "tfdist: models this script builds outside any scope train on the job's"
STEPPED_ASIDE = "tfdist: this script opens a tf.distribute strategy of its own"


def test_the_knob_is_job_by_default_and_refuses_other_values_naming_them():
    assert config.unscoped_models(environ={}) == "job"
    assert config.unscoped_models(environ={"TFDIST_UNSCOPED_MODELS": "LOCAL"}) == "local"
    assert config.unscoped_models("local", environ={"TFDIST_UNSCOPED_MODELS": "job"}) == "local"
    with pytest.raises(config.ConfigError, match=r"TFDIST_UNSCOPED_MODELS='each'"):
        config.unscoped_models(environ={"TFDIST_UNSCOPED_MODELS": "each"})
    with pytest.raises(config.ConfigError, match=r"Received: 'all'"):
        config.unscoped_models("all")


def _run(argv: list[str], out: Path, backend: str, **extra: str) -> tuple[list[dict], str]:
    """Runs ``argv`` + ``[SCRIPT, OUT]`` cold; every process's record and the stderr."""
    proc = subprocess.run(
        [sys.executable, *argv, SCRIPT, str(out), *extra.pop("script_args", ())],
        cwd=REPO,
        env=cold_env(backend, **extra),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    found = [dict(np.load(path)) for path in sorted(out.parent.glob(f"{out.name}-*.npz"))]
    assert found, proc.stderr[-3000:]
    return found, proc.stderr


@pytest.mark.slow
def test_local_keeps_one_replica_per_process_as_upstream(tmp_path):
    (reference,), _ = _run([], tmp_path / "one", "tensorflow")
    # The flag wins over the environment's job.
    argv = ["-m", "tfdist", "launch", "-n", "2", "--unscoped-models", "local"]
    workers, err = _run(argv, tmp_path / "local", "tensorflow")
    assert [int(r["replicas"]) for r in workers] == [1, 1]  # each worker its own copy
    assert ANNOUNCED not in err
    for run in workers:  # all the data each: one device's model, twice
        equivalence.assert_close(reference["weights"], run["weights"], 1e-5, "weights")


@pytest.mark.slow
def test_a_strategy_the_script_opens_after_an_unscoped_model_takes_over(tmp_path):
    mine = {"script_args": ["--own-strategy"]}
    (reference,), _ = _run([], tmp_path / "one", "tensorflow", **mine)
    (run,), err = _run(
        ["-m", "tfdist.bootstrap"],
        tmp_path / "devices",
        "tensorflow",
        TFDIST_CPU_DEVICES="2",
        **mine,
    )
    assert (int(run["replicas"]), int(run["own_replicas"])) == (2, 2)
    assert STEPPED_ASIDE in err
    equivalence.assert_close(reference["weights"], run["weights"], 1e-5, "unscoped")
    equivalence.assert_close(reference["own_weights"], run["own_weights"], 1e-5, "own")


CLEARS = """
import keras
from record import replicas

def trained():
    model = keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(keras.ops.ones((8, 3)), keras.ops.ones((8, 1)), batch_size=4, verbose=0)
    return replicas(model)

first = trained()
keras.backend.clear_session()
print("REPLICAS", first, trained())
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_a_model_built_after_clear_session_still_trains_on_the_job(backend, tmp_path):
    """``keras.backend.clear_session()`` resets TensorFlow's default graph (which holds the
    process default strategy) and Keras's global state (the JAX distribution): the next
    unscoped model trains on the job again, not on one replica."""
    script = tmp_path / "clears.py"
    script.write_text(CLEARS)
    proc = subprocess.run(
        [sys.executable, "-m", "tfdist.bootstrap", str(script)],
        cwd=REPO,
        env=cold_env(backend, path=(REPO / "tests" / "corpus",), TFDIST_CPU_DEVICES="2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REPLICAS 2 2" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_a_loop_without_strategy_run_is_told_why_it_fails_and_runs_with_local(tmp_path):
    """The Keras guide's GradientTape loop (tests/corpus/custom_loop.py) never calls
    strategy.run: on the job's strategy TensorFlow refuses its step; the line before the
    traceback says why and what to do, and --unscoped-models local runs it as upstream."""
    script = str(REPO / "tests" / "corpus" / "custom_loop.py")

    def run(**env: str) -> subprocess.CompletedProcess:
        environment = cold_env("tensorflow", TFDIST_CPU_DEVICES="2")
        return subprocess.run(
            [sys.executable, "-m", "tfdist.bootstrap", script],
            cwd=tmp_path,
            env={**environment, **env},
            capture_output=True,
            text=True,
            timeout=400,
        )

    refused = run()
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert "tfdist: this script steps a model outside the strategy's replicas" in refused.stderr
    assert "is not available outside the replica context" in refused.stderr  # upstream's
    local = run(TFDIST_UNSCOPED_MODELS="local")
    assert local.returncode == 0, local.stderr[-3000:]
