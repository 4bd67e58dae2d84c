"""Numpy arrays, PyDataset and generators into fit/evaluate/predict on JAX: one device, 4
devices and 2 processes x 2 devices give the same losses, weights, metrics and
predictions (tfdist.compat.inputs.jax); upstream refuses them under 2 processes."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import SCRIPTS, equivalence, last_json_line, launch_cli, run_python

pytestmark = pytest.mark.jax
TOL = 1e-5
JOB = SCRIPTS / "jax_inputs_job.py"
FIXES = "keras_jax_multi_process_inputs,keras_jax_multi_process_predict"
FIT_KINDS = {
    "numpy",
    "numpy_shuffled",
    "sample_weight",
    "class_weight",
    "validation_data",
    "validation_split",
    "pydataset",
    "pydataset_shuffled",
    "generator",
}
KINDS = FIT_KINDS | {
    "evaluate_numpy",
    "evaluate_pydataset",
    "evaluate_generator",
    "predict_numpy",
    "predict_pydataset",
    "predict_generator",
    "predict_tf",
}


def _by_kind(lines) -> dict[str, dict]:
    results = {}
    for line in lines:
        result = last_json_line(line)
        results[result["kind"]] = result
    return results


def _one_process(devices: int | None = None, *kinds: str, **env) -> dict[str, dict]:
    """``jax_inputs_job.py`` in one process on ``devices`` (``kinds`` only, if named;
    ``env`` adds to its environment)."""
    env["KERAS_BACKEND"] = "jax"
    if devices:
        env["TFDIST_CPU_DEVICES"] = str(devices)
    proc = run_python(
        f"import runpy, sys; sys.argv = {['jax_inputs_job.py', *kinds]!r}; "
        f"runpy.run_path({str(JOB)!r}, run_name='__main__')",
        timeout=300,
        **env,
    )
    return _by_kind(line for line in proc.stdout.splitlines() if '"kind"' in line)


def _two_processes(*args: str, **env) -> dict[int, dict[str, dict]]:
    """Each process's results of ``jax_inputs_job.py`` under 2 processes x 2 devices."""
    proc = launch_cli(
        "-n", "2", "--devices-per-worker", "2", str(JOB), *args, timeout=400,
        KERAS_BACKEND="jax", **env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [
        line.partition(" ")[2]
        for line in proc.stdout.splitlines()
        if line.startswith("[w") and '"kind"' in line
    ]
    by_process: dict[int, list[str]] = {0: [], 1: []}
    for line in lines:
        by_process[last_json_line(line)["process"]].append(line)
    return {process: _by_kind(found) for process, found in by_process.items()}


def _assert_same(one: dict[str, dict], other: dict[str, dict], kinds=KINDS) -> None:
    """Every kind of ``other`` (of ``kinds``) equals one device's within TOL (losses,
    metrics, weights, predictions row by row, so in order)."""
    assert kinds <= set(other), sorted(kinds - set(other))
    for kind in sorted(kinds):
        a, b = one[kind], other[kind]
        keys = [key for key in ("history", "metrics", "weights", "predictions") if key in a]
        assert keys, kind
        equivalence.assert_close(
            {key: a[key] for key in keys}, {key: b.get(key, {}) for key in keys}, TOL, kind
        )


def _assert_topology(results: dict[str, dict], replicas: int, processes: int, devices: int):
    """The run's "setup" line: the replicas, processes and devices it ran on."""
    setup = results["setup"]
    got = (setup["replicas"], setup["processes"], setup["devices"])
    assert got == (replicas, processes, devices), setup


def _assert_models_ran_on(results: dict[str, dict], replicas: int, processes: int) -> None:
    """Every kind's model ran on ``replicas`` devices of ``processes`` processes (its
    ``trained_on``): a model built outside ``tfdist.scope()`` runs on one."""
    kinds = sorted(KINDS & set(results))
    assert kinds, sorted(results)
    for kind in kinds:
        ran_on = results[kind]["trained_on"]
        assert ran_on == [{"replicas": replicas, "workers": processes}], (kind, ran_on)


@pytest.fixture(scope="module")
def one_device():
    results = _one_process()
    assert KINDS <= set(results)
    # Both fixes are applied on JAX; in one process they leave every input to upstream.
    assert results["setup"] == {
        "kind": "setup",
        "process": 0,
        "applied": ["keras_jax_multi_process_inputs", "keras_jax_multi_process_predict"],
        "share": None,
        "replicas": 1,
        "processes": 1,
        "devices": 1,
    }
    _assert_models_ran_on(results, replicas=1, processes=1)
    loss = results["numpy"]["history"]["loss"]
    assert loss[-1] < loss[0]  # it trained
    # The kinds differ from one another where their inputs do (weights, shuffles).
    assert results["numpy_shuffled"]["history"]["loss"] != loss
    assert results["class_weight"]["history"]["loss"] != loss
    assert len(results["predict_numpy"]["predictions"]) == 72
    return results


@pytest.mark.devices
@pytest.mark.slow
def test_four_devices_in_one_process_match_one_device(one_device):
    four = _one_process(4)
    _assert_topology(four, replicas=4, processes=1, devices=4)
    _assert_models_ran_on(four, replicas=4, processes=1)
    assert four["setup"]["share"] is None  # one process: upstream's inputs
    _assert_same(one_device, four)


@pytest.mark.multiworker
@pytest.mark.slow
def test_two_processes_match_one_device_for_every_input_kind(one_device):
    """Each process ends with one device's weights and metrics, and predict returns every
    prediction in order on each; a last batch that does not divide between the 4 replicas
    fails with the counts on every process."""
    results = _two_processes()
    for process in (0, 1):
        _assert_topology(results[process], replicas=4, processes=2, devices=4)
        _assert_models_ran_on(results[process], replicas=4, processes=2)
        # Process p feeds part p of 2 of every batch, which 4 replicas split.
        assert results[process]["setup"]["share"] == [process, 2, 4]
        _assert_same(one_device, results[process])
        uneven = results[process]["uneven"]["error"]
        assert uneven.startswith("ValueError: tfdist: the last batch (70 examples in batches")
        assert "has 6 examples" in uneven and "4 data-parallel replicas" in uneven
        assert "x[:64]" in uneven


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.upstream_failure("keras_jax_multi_process_inputs", "keras_jax_multi_process_predict")
def test_upstream_refuses_numpy_and_cannot_return_predictions_under_two_processes():
    """Without the fixes: Keras's refusal of numpy inputs, and predict failing on a
    tf.data.Dataset (so we notice when upstream fixes either)."""
    results = _two_processes("upstream", TFDIST_COMPAT_EXCLUDE=FIXES)
    for process in (0, 1):
        upstream = results[process]["upstream"]
        assert upstream["fit_numpy"].startswith("ValueError: When using a multi-worker")
        assert "the data must be provided as a `tf.data.Dataset`" in upstream["fit_numpy"]
        assert "non-addressable" in upstream["predict_tf"]


def test_each_process_cuts_its_part_of_every_batch():
    """Process 1 of 2 (4 replicas) keeps rows 8-15 of a batch of 16, every array alike."""
    from tfdist.compat.inputs.jax import _cut, _Share

    x, y = np.arange(32).reshape(16, 2), np.arange(16)
    part_x, part_y, weights = _cut((x, y, None), _Share(index=1, parts=2, replicas=4))
    equivalence.assert_allclose(part_x, x[8:16])
    equivalence.assert_allclose(part_y, y[8:16])
    assert weights is None
    with pytest.raises(ValueError, match=r"a batch has 10 examples.*4 data-parallel replicas"):
        _cut((x[:10],), _Share(index=0, parts=2, replicas=4))
    with pytest.raises(TypeError, match="cannot be sliced"):
        _cut(([1, 2],), _Share(index=0, parts=2, replicas=4))


def test_array_batches_that_do_not_divide_fail_before_the_first_step():
    from types import SimpleNamespace

    from tfdist.compat.inputs.jax import _check_array_batches, _Share

    share = _Share(index=0, parts=2, replicas=4)
    even = SimpleNamespace(batch_size=16, partial_batch_size=8, num_batches=5)
    _check_array_batches(even, share)  # 72 examples: 4 x 16 + 8
    odd = SimpleNamespace(batch_size=6, partial_batch_size=None, num_batches=3)
    with pytest.raises(ValueError, match=r"every batch \(batch_size=6\) has 6 examples.*"
                       r"Received: batch_size=6 for 18 examples"):  # fmt: skip
        _check_array_batches(odd, share)
