"""tf.distribute's data iterators end promptly at an epoch's start (the
``tf_multi_device_iterators_end_promptly`` fix), and training is unchanged.

Upstream, Keras's ``fit`` drops each epoch's multi-device iterator at the next epoch's first
step, and tf.data's destructor waits there for the autotuning threads of the host pipeline's
iterator and of each per-device one (seconds to tens of seconds; the wait is measured by
tools/bench/epoch_start.py, never asserted here). The job records whether each of those
datasets autotunes.
"""

from __future__ import annotations

import functools
import json

import pytest

from conftest import SCRIPTS, equivalence, run_python

JOB = SCRIPTS / "epoch_start_job.py"
FIX = "tf_multi_device_iterators_end_promptly"
# fit (3 epochs, each with a validation pass), evaluate and predict: one multi-device
# iterator each at least; every one builds a dataset per device.
AT_LEAST_ITERATORS = 8


def run_job(devices: int, exclude: str = "", **env) -> dict:
    """The job's report on ``devices`` logical devices, unchecked."""
    env = {"KERAS_BACKEND": "tensorflow", "TFDIST_COMPAT_EXCLUDE": exclude, **env}
    if devices > 1:
        env["TFDIST_CPU_DEVICES"] = str(devices)
    stdout = run_python(
        f"import runpy; runpy.run_path({str(JOB)!r}, run_name='__main__')", timeout=300, **env
    ).stdout
    line = next(line for line in stdout.splitlines() if line.startswith("EPOCH_START "))
    return json.loads(line[len("EPOCH_START ") :])


def check_topology(result: dict, devices: int) -> None:
    assert result["topology"] == {"replicas": devices}, result["topology"]


def check_training_unchanged(upstream: dict, fixed: dict) -> None:
    """The same iterators over the same elements: the same model, exactly."""
    equivalence.assert_close(upstream["values"], fixed["values"], 0.0, "2 devices")


@functools.cache
def run(devices: int, exclude: str = "") -> dict:
    result = run_job(devices, exclude)
    check_topology(result, devices)
    return result


@pytest.mark.slow
@pytest.mark.devices
def test_iterators_do_not_autotune_unless_the_user_chose_and_training_is_unchanged():
    fixed, upstream = run(2), run(2, exclude=FIX)
    hosts, devices = fixed["autotune"]["host"], fixed["autotune"]["device"]
    assert len(hosts) >= AT_LEAST_ITERATORS and set(hosts) == {False}, hosts
    assert len(devices) == 2 * len(hosts) and set(devices) == {False}, devices
    # A pipeline whose options say autotune=True keeps it; the per-device datasets do not.
    chose = fixed["autotune_user_chose_on"]
    assert chose["host"] and set(chose["host"]) == {True}, chose
    assert chose["device"] and set(chose["device"]) == {False}, chose
    assert len(upstream["autotune"]["host"]) == len(hosts)
    check_training_unchanged(upstream, fixed)


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.upstream_failure("tf_multi_device_iterators_end_promptly")
def test_upstream_iterators_autotune_so_their_destruction_waits():
    upstream = run(2, exclude=FIX)
    # None is tf.data's default: autotuning on, one autotuning thread per iterator, which
    # the iterator's destructor waits for (docs/benchmarks.md: the epoch-start stall).
    assert set(upstream["autotune"]["host"]) == {None}, upstream["autotune"]
    assert set(upstream["autotune"]["device"]) == {None}, upstream["autotune"]
