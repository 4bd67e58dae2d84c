"""Models with their own train_step and no call() (the Keras examples' VAE and GAN shapes).

tests/scripts/own_train_step_job.py, unchanged (no tfdist, no strategy), run cold as a
user runs it: ``python`` (one device), ``TFDIST_CPU_DEVICES=2 python -m tfdist.bootstrap``
and ``tfdist launch -n 2``. Both models must train on 2 replicas and end within 1e-5 of one
device, the autoencoder's logged loss too. Without ``keras_tf_fit_builds_models_without_call``
fit fails as upstream's MirroredStrategy does; without
``keras_tf_custom_train_step_averages_gradients`` the autoencoder (a plain ``ops.mean``
loss) takes N times one device's steps while the GAN (a Keras loss object) stays equal.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfdist.compat import custom_train_step

from conftest import REPO, SCRIPTS, child_env, equivalence

JOB = str(SCRIPTS / "own_train_step_job.py")


def _run(argv: list[str], out: Path, check: bool = True, **env: str):
    """``python *argv JOB OUT`` in a fresh interpreter with a user's environment."""
    environment = child_env(TFDIST_LAUNCH_PYTHON=None, TFDIST_UNSCOPED_MODELS="job", **env)
    environment.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, *argv, JOB, str(out)],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=400,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    found = [dict(np.load(p)) for p in sorted(out.parent.glob(f"{out.name}-*.npz"))]
    return proc, found


def test_only_models_with_their_own_train_step_and_no_call_are_told_apart():
    import keras
    import tensorflow as tf

    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert not custom_train_step._has_no_call(plain)
    assert not custom_train_step._has_own_train_step(plain)

    class OwnStep(keras.Model):
        def train_step(self, data):
            return {}

    assert custom_train_step._has_no_call(OwnStep())
    assert custom_train_step._has_own_train_step(OwnStep())
    dense = custom_train_step._divided(tf.constant([2.0, 4.0]), 2)
    np.testing.assert_allclose(dense.numpy(), [1.0, 2.0])
    rows = tf.IndexedSlices(tf.constant([[4.0]]), tf.constant([3]), tf.constant([5, 1]))
    sliced = custom_train_step._divided(rows, 4)
    assert isinstance(sliced, tf.IndexedSlices) and sliced.values.numpy().tolist() == [[1.0]]
    assert custom_train_step._divided(None, 2) is None


@pytest.mark.slow
def test_examples_own_train_steps_equal_one_device(tmp_path):
    _, (one,) = _run([], tmp_path / "one")
    _, devices = _run(["-m", "tfdist.bootstrap"], tmp_path / "devices", TFDIST_CPU_DEVICES="2")
    _, workers = _run(["-m", "tfdist", "launch", "-n", "2"], tmp_path / "workers")
    assert len(devices) == 1 and len(workers) == 2
    for run in (*devices, *workers):
        assert (int(run["ae_replicas"]), int(run["gan_replicas"])) == (2, 2)
        for key in ("ae", "gan", "ae_loss"):
            equivalence.assert_close(one[key], run[key], 1e-5, key)


@pytest.mark.slow
@pytest.mark.upstream_failure("keras_tf_fit_builds_models_without_call")
def test_upstream_cannot_build_a_model_without_call_under_a_strategy(tmp_path):
    proc, _ = _run(
        ["-m", "tfdist.bootstrap"],
        tmp_path / "upstream",
        check=False,
        TFDIST_CPU_DEVICES="2",
        TFDIST_COMPAT_EXCLUDE=custom_train_step.KERAS_TF_FIT_BUILDS_MODELS_WITHOUT_CALL,
    )
    assert proc.returncode != 0
    assert "Unable to automatically build the model" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.upstream_failure("keras_tf_custom_train_step_averages_gradients")
def test_upstream_sums_the_replicas_gradients_of_a_plain_mean_loss(tmp_path):
    _, (one,) = _run([], tmp_path / "one")
    _, (two,) = _run(
        ["-m", "tfdist.bootstrap"],
        tmp_path / "summed",
        TFDIST_CPU_DEVICES="2",
        TFDIST_COMPAT_EXCLUDE=custom_train_step.KERAS_TF_CUSTOM_TRAIN_STEP_AVERAGES_GRADIENTS,
    )
    equivalence.assert_differs(one["ae"], two["ae"], 1e-2, "ae")  # twice one device's steps
    equivalence.assert_close(one["gan"], two["gan"], 1e-5, "gan")  # a loss object: scaled
