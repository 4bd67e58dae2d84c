"""evaluate and predict on batches with fewer examples than replicas, or than devices.

tests/scripts/small_batches_job.py, as a user writes it (no tfdist, no strategy), run cold
as a user runs it: ``python`` (one device), ``TFDIST_CPU_DEVICES=N python -m
tfdist.bootstrap`` on 2 and 4 devices, ``tfdist launch -n 2``. One image, a last batch of
one, 3 examples on 4 replicas: every result within 1e-5 of one device, on every replica
count. With the fix excluded the Conv models' cases with an empty replica fail in its
kernel, as upstream's MirroredStrategy does, and every other case is unchanged: the fix
changes only what upstream gets wrong.

On JAX the same script on 2 devices of one process and on 2 processes: a batch the
replicas cannot split evenly is placed whole on every device, and every result equals one
device's (over processes, a ``tf.data`` batch is still refused, naming its size); without
``keras_jax_evaluate_predict_uneven_batches`` tfdist's refusal (or jax's error) comes back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, SCRIPTS, cold_env, equivalence

JOB = str(SCRIPTS / "small_batches_job.py")
CASES = (
    "conv predict one image",
    "conv predict last batch of one",
    "conv predict 3 at batch 3",
    "conv predict_on_batch one image",
    "conv evaluate one image",
    "conv evaluate last batch of one, weighted",
    "conv evaluate tf.data last batch of one",
    "conv test_on_batch one image",
    "conv1d predict last batch of one",
    "conv1d evaluate last batch of one",
    "named predict one example",
    "named evaluate last batch of one",
)
# float32 values up to ~4.4: one device and a multi-worker cut round apart by up to 8.6e-6
# (the Conv1D autoencoder on 2 workers, measured).
TOLERANCE = 1e-5


def _run(argv: list[str], out: Path, backend: str = "tensorflow", **env: str) -> list[dict]:
    """``python *argv JOB OUT`` in a fresh interpreter with a user's environment."""
    proc = subprocess.run(
        [sys.executable, *argv, JOB, str(out)],
        cwd=REPO,
        env=cold_env(backend, **env),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = [dict(np.load(p)) for p in sorted(out.parent.glob(f"{out.name}-*.npz"))]
    assert found, proc.stderr[-3000:]
    return found


def test_only_an_empty_batch_gets_a_stand_in_row_and_other_inputs_keep_upstreams_path():
    import tensorflow as tf

    from tfdist.compat import empty_replicas

    empty = {"a": tf.zeros([0, 3]), "b": tf.zeros([0, 2], tf.int64), "s": tf.fill([0], "x")}
    padded, size = empty_replicas._padded(empty)
    assert int(size) == 0
    assert {k: v.shape.as_list() for k, v in padded.items()} == {"a": [1, 3], "b": [1, 2], "s": [1]}
    assert padded["s"].numpy().tolist() == [b""] and padded["b"].dtype == tf.int64
    full = tf.reshape(tf.range(6.0), [2, 3])
    same, size = empty_replicas._padded(full)
    assert int(size) == 2 and same.numpy().tolist() == full.numpy().tolist()  # nothing added
    ragged = tf.ragged.constant([[1, 2], [3]])
    assert empty_replicas._padded({"r": ragged, "a": full}) is None  # upstream's path
    assert empty_replicas._padded(tf.constant(3.0)) is None
    assert empty_replicas._replicas() == 1  # no strategy: upstream's steps, unchanged


def _cases(run: dict) -> dict:
    return {k.removeprefix("case "): v for k, v in run.items() if k.startswith("case ")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    (one,) = _run([], tmp_path_factory.mktemp("one") / "run")
    assert int(one["replicas"]) == 1 and json.loads(str(one["errors"])) == {}
    assert tuple(_cases(one)) == CASES
    return _cases(one)


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.multiworker
@pytest.mark.parametrize(
    "argv, env, replicas",
    [
        (["-m", "tfdist.bootstrap"], {"TFDIST_CPU_DEVICES": "2"}, [2]),
        (["-m", "tfdist.bootstrap"], {"TFDIST_CPU_DEVICES": "4"}, [4]),
        (["-m", "tfdist", "launch", "-n", "2"], {}, [2, 2]),
    ],
    ids=["2 devices", "4 devices", "2 workers"],
)
def test_small_batches_evaluate_and_predict_as_one_device(reference, tmp_path, argv, env, replicas):
    runs = _run(argv, tmp_path / "run", **env)
    assert [int(run["replicas"]) for run in runs] == replicas  # every process, every replica
    for run in runs:
        assert json.loads(str(run["errors"])) == {}
        cases = _cases(run)
        assert cases.keys() == reference.keys()
        for name, value in reference.items():
            equivalence.assert_close(value, cases[name], TOLERANCE, name)


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.upstream_failure("keras_tf_evaluate_predict_empty_replicas")
def test_upstream_fails_in_the_empty_replicas_kernel_and_is_right_for_dense(reference, tmp_path):
    (run,) = _run(
        ["-m", "tfdist.bootstrap"],
        tmp_path / "upstream",
        TFDIST_CPU_DEVICES="2",
        TFDIST_COMPAT_EXCLUDE="keras_tf_evaluate_predict_empty_replicas",
    )
    assert int(run["replicas"]) == 2
    errors = json.loads(str(run["errors"]))
    # Every call that leaves a Conv model's replica empty fails in that replica's kernel.
    failing = {name for name in reference if name.startswith("conv") and _empty(name)}
    assert set(errors) == failing, sorted(errors)
    for name in failing:
        assert errors[name].startswith("InvalidArgumentError"), errors[name]
    assert "Incompatible shapes: [8] vs. [0,12,12,3]" in errors["conv predict one image"]
    # The rest (no empty replica, or a Dense model) is upstream's result, equal to one device.
    for name, value in reference.items():
        if name not in failing:
            equivalence.assert_close(value, _cases(run)[name], TOLERANCE, name)


def _empty(case: str) -> bool:
    """Whether ``case`` hands one of 2 replicas no example (``*_on_batch`` calls give
    each replica the whole batch)."""
    return ("one image" in case or "last batch of one" in case) and "on_batch" not in case


@pytest.fixture(scope="module")
def jax_reference(tmp_path_factory) -> dict:
    (one,) = _run([], tmp_path_factory.mktemp("jax-one") / "run", "jax")
    assert int(one["replicas"]) == 1 and json.loads(str(one["errors"])) == {}
    assert tuple(_cases(one)) == CASES
    return _cases(one)


# Over several processes a tf.data batch is cut in the pipeline, before any call can
# feed it whole: still refused, with the sizes and what to do.
TF_DATA_REFUSED = (
    "conv evaluate tf.data last batch of one",
    "Received: global_batch_size=1 (the dataset's last batch)",
)


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
@pytest.mark.multiworker
@pytest.mark.parametrize(
    "argv, env, replicas",
    [
        (["-m", "tfdist.bootstrap"], {"TFDIST_CPU_DEVICES": "2"}, [2]),
        (["-m", "tfdist", "launch", "-n", "2"], {}, [2, 2]),
    ],
    ids=["2 devices", "2 processes"],
)
def test_jax_evaluates_and_predicts_uneven_batches_as_one_device(
    jax_reference, tmp_path, argv, env, replicas
):
    runs = _run(argv, tmp_path / "run", "jax", **env)
    assert [int(run["replicas"]) for run in runs] == replicas
    for run in runs:
        errors, cases = json.loads(str(run["errors"])), _cases(run)
        if len(replicas) > 1:
            name, refusal = TF_DATA_REFUSED
            assert list(errors) == [name] and refusal in errors[name], errors
        else:
            assert errors == {}
        assert set(cases) | set(errors) == set(CASES)
        for name, value in cases.items():
            equivalence.assert_close(jax_reference[name], value, TOLERANCE, name)


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
@pytest.mark.upstream_failure("keras_jax_evaluate_predict_uneven_batches")
def test_jax_without_the_fix_an_uneven_inference_batch_is_refused(tmp_path):
    (run,) = _run(
        ["-m", "tfdist.bootstrap"],
        tmp_path / "refused",
        "jax",
        TFDIST_CPU_DEVICES="2",
        TFDIST_COMPAT_EXCLUDE="keras_jax_evaluate_predict_uneven_batches",
    )
    errors = json.loads(str(run["errors"]))
    # Every call meets a batch of 1, or 3, before any result: refused by tfdist before the
    # first step, or by jax's IndivisibleError (test_on_batch). predict_on_batch alone
    # runs: tfdist's keras_jax_multi_process_predict path places its batch itself.
    assert set(errors) == set(CASES) - {"conv predict_on_batch one image"}, sorted(errors)
    for name, error in errors.items():
        assert "cannot be split evenly" in error or "IndivisibleError" in error, (name, error)
