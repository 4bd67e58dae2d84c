"""BatchNormalization under several replicas: the upstream failure, the warning, sync_batchnorm.

The equivalence tests share one fresh process per backend (``tests/scripts/bn_job.py``
with 2 logical CPU devices trains every variant); the rest run in the pytest process,
which has one replica.
"""

from __future__ import annotations

import warnings

import pytest

import tfdist
from tfdist import batchnorm

from conftest import SCRIPTS, equivalence, last_json_line, run_python


def _bn_job(**env) -> dict:
    proc = run_python(
        f"import runpy; runpy.run_path({str(SCRIPTS / 'bn_job.py')!r}, run_name='__main__')",
        TFDIST_CPU_DEVICES="2",
        timeout=300,
        **env,
    )
    return last_json_line(proc.stdout)


# What each TensorFlow variant trains on: the reference on one device, the others on 2.
TF_REPLICAS = {
    "one": 1,
    "synced": 2,
    "synced_made_before": 2,
    "explicit": 2,
    "unsynced": 2,
    "unsynced_again": 2,
}


def check_replicas(result: dict) -> None:
    assert result["replicas"] == TF_REPLICAS, result["replicas"]


@pytest.fixture(scope="module")
def tf_job() -> dict:
    result = _bn_job(KERAS_BACKEND="tensorflow")
    check_replicas(result)
    return result


def _max_difference(result: dict, variant: str) -> float:
    return equivalence.max_difference(result["weights"]["one"], result["weights"][variant])


def check_synced_equals_one_device(result: dict) -> None:
    """The synchronized variants equal one device within 1e-5."""
    # layers made before the scope are converted too: they are built inside it
    for variant in ("synced", "synced_made_before"):
        assert result["synchronized"][variant] == [True, True], variant
        assert _max_difference(result, variant) < 1e-5, variant
    # the same as writing synchronized=True in every layer
    assert _max_difference(result, "explicit") < 1e-5


# ----------------------------------------------------------------- unit: the argument


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_sync_batchnorm_must_be_a_bool(bad):
    with pytest.raises(
        TypeError,
        match=rf"scope: sync_batchnorm must be a bool\. Received: sync_batchnorm={bad!r}\. "
        r"Pass True",
    ):
        tfdist.scope(sync_batchnorm=bad)


def test_one_replica_changes_nothing_and_warns_nothing():
    import keras

    with warnings.catch_warnings():
        warnings.simplefilter("error", batchnorm.UnsyncedBatchNormWarning)
        with tfdist.scope(sync_batchnorm=True) as distribution:
            layer = keras.layers.BatchNormalization()
            layer.build((None, 4))
    assert tfdist.num_replicas(strategy=distribution) == 1
    assert layer.synchronized is False
    assert not batchnorm.per_replica_statistics(distribution)
    assert not batchnorm.per_replica_statistics(None)


# ------------------------------------------------ equivalence: 2 logical devices, TensorFlow


@pytest.mark.devices
@pytest.mark.slow
@pytest.mark.upstream_failure("keras_batchnorm_replicas")
def test_unsynchronized_batchnorm_on_2_replicas_differs_from_one_device(tf_job):
    # Upstream: each replica normalises with its own half of the batch, silently.
    assert tf_job["synchronized"]["unsynced"] == [False, False]
    assert _max_difference(tf_job, "unsynced") > 1e-4


@pytest.mark.devices
@pytest.mark.slow
def test_the_unsynchronized_layer_is_warned_about_once_per_process(tf_job):
    warned = tf_job["warnings"]
    for quiet in ("one", "synced", "synced_made_before", "explicit"):
        assert warned[quiet] == [], quiet
    assert len(warned["unsynced"]) == 1 and warned["unsynced_again"] == []
    message = warned["unsynced"][0]
    assert "BatchNormalization layer 'batch_normalization" in message
    assert "MirroredStrategy with 2 replicas" in message
    assert "synchronized=True" in message and "sync_batchnorm=True" in message
    assert "differs from the one a single device trains" in message


@pytest.mark.devices
@pytest.mark.slow
def test_sync_batchnorm_on_2_replicas_trains_the_one_device_model(tf_job):
    check_synced_equals_one_device(tf_job)


# ------------------------------------------------ JAX: statistics are global already


@pytest.mark.jax
@pytest.mark.devices
@pytest.mark.slow
def test_on_jax_sync_batchnorm_changes_nothing_and_nothing_is_warned():
    result = _bn_job(KERAS_BACKEND="jax")
    assert result["replicas"] == {"one": 1, "synced": 2, "unsynced": 2}
    assert result["synchronized"]["synced"] == [False, False]
    assert all(found == [] for found in result["warnings"].values())
    assert any("changes nothing under DataParallel" in m for m in result["debug"])
    for variant in ("synced", "unsynced"):
        assert _max_difference(result, variant) < 1e-5
