"""The idiom matrix: each ordinary Keras idiom x topology x backend against one device.

``tests/scripts/idioms_job.py`` writes every idiom as a user's script does (numpy into
``fit``, Keras's own callbacks, optimizer options, layers, custom ``train_step``) and
trains them all in one process. It runs on one device (the reference), on 2 logical
devices and as 2 workers / 2 processes under ``tfdist launch``, on TensorFlow and on JAX.
Every cell must give what one device gives, within ``TOLERANCE``; the few that cannot
are listed in ``EXPECTED`` with why, and are checked to still behave that way (so the
list cannot go stale). docs/idioms.md's idiom table is generated from these lists
(``tools/docs/idiom_table.py``) and checked by ``test_idiom_table_is_generated``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tools.docs import idiom_table

from conftest import (
    REPO,
    SCRIPTS,
    equivalence,
    last_json_line,
    launch_cli,
    run_python,
    tagged_reports,
)

JOB = SCRIPTS / "idioms_job.py"
BACKENDS = ("tensorflow", "jax")
TOPOLOGIES = ("2 devices", "2 workers")  # each against "1 device"
IDIOMS = idiom_table.idioms()
TOLERANCE = idiom_table.TOLERANCE
EXPECTED = idiom_table.EXPECTED


# What each topology's job must report it ran on (its "_topology"): on JAX no idiom is
# expected to differ, so a cell that silently ran on one device would pass every idiom.
TOPOLOGY = {
    "1 device": {"replicas": 1, "workers": 1, "processes": 1, "local_devices": 1},
    "2 devices": {"replicas": 2, "workers": 1, "processes": 1, "local_devices": 2},
    "2 workers": {"replicas": 2, "workers": 2, "processes": 2, "local_devices": 1},
}
# What a callback idiom's callback must have done on the reference run (a callback that
# does nothing would give the same numbers on every topology): its values there.
ACTED = {
    # min_delta=10: the first epoch without that improvement stops it (patience 1), of 6.
    "early_stopping": {"epochs_run": [2]},
    # halved at each of epochs 2, 3 and 4 (min_delta=10, patience 1): 0.05 / 8.
    "reduce_lr_on_plateau": {"lr": [0.05 / 8]},
    # SGD(1e6) gives NaN within the first epoch: 1 of 3 epochs run.
    "terminate_on_nan": {"epochs_run": [1]},
    # lr * 0.5 at each of the 2 epochs' start.
    "learning_rate_scheduler": {"lr": [0.05 / 4]},
}


def _values(stdout: str, workers: int = 1) -> dict:
    """The chief's result, with every worker's (the chief's included) under ``_workers``."""
    found = tagged_reports(stdout, "IDIOMS", "_rank")
    if sorted(found) != list(range(workers)):
        pytest.fail(f"results from workers {sorted(found)}, not {workers}:\n{stdout[-3000:]}")
    return {**found[0], "_workers": found}


def run_job(backend: str, topology: str, *idioms: str, **env) -> dict:
    """The job's result as ``topology`` on ``backend`` (``idioms``: those only; ``env``:
    e.g. ``TFDIST_TEST_FAULT``)."""
    env = {"KERAS_BACKEND": backend, **env}
    if topology == "2 workers":
        proc = launch_cli("-n", "2", str(JOB), *idioms, timeout=900, **env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return _values(proc.stdout, workers=2)
    if topology == "2 devices":
        env["TFDIST_CPU_DEVICES"] = "2"
    code = f"import runpy, sys; sys.argv = {[str(JOB), *idioms]!r}; "
    code += f"runpy.run_path({str(JOB)!r}, run_name='__main__')"
    return _values(run_python(code, timeout=600, **env).stdout)


@functools.cache
def _run(backend: str, topology: str) -> dict:
    return run_job(backend, topology)


def check_topology(result: dict, topology: str) -> None:
    """The job, and every model of every idiom in it, ran on what ``topology`` names."""
    assert result["_topology"] == TOPOLOGY[topology], (topology, result["_topology"])
    want = {key: TOPOLOGY[topology][key] for key in ("replicas", "workers")}
    for idiom, cell in result.items():
        if not idiom.startswith("_") and "error" not in cell:
            assert cell["trained_on"], f"{idiom}: no model call was noted"
            wrong = [found for found in cell["trained_on"] if found != want]
            assert not wrong, f"{idiom} on {topology}: a model ran on {wrong}, not {want}"


def check_callback_acted(idiom: str, reference: dict) -> None:
    """A callback idiom's callback changed the reference run as it should."""
    if idiom in ACTED:
        equivalence.assert_close(
            ACTED[idiom],
            {key: reference["values"][key] for key in ACTED[idiom]},
            1e-7,
            f"{idiom}: the callback did not act on the reference run",
        )


def check_cell(idiom: str, backend: str, topology: str, reference: dict, cell: dict) -> None:
    """``cell`` (the idiom's result on ``topology``) against the 1-device ``reference``."""
    expected = idiom_table.expected(idiom, backend, topology)
    if expected is not None and expected[0] == "error":  # a clear error that says what to do
        assert "error" in cell and expected[2] in cell["error"], cell
        return
    assert "error" not in reference, reference.get("trace")
    assert not reference["nonfinite"] or idiom == "terminate_on_nan", reference
    assert "error" not in cell, cell.get("trace")
    if expected is None:
        tolerance = TOLERANCE.get(idiom, TOLERANCE["default"])
        equivalence.assert_close(reference["values"], cell["values"], tolerance, idiom)
    else:  # "differs": not equal by design (reason in EXPECTED); if it becomes equal,
        # update the list
        equivalence.assert_differs(
            reference["values"], cell["values"], TOLERANCE["default"], expected[1]
        )


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.multiworker
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("idiom", IDIOMS)
def test_idiom_matches_one_device(idiom, backend, topology):
    result, one = _run(backend, topology), _run(backend, "1 device")
    check_topology(one, "1 device")
    if "error" not in one[idiom]:
        check_callback_acted(idiom, one[idiom])
    for worker in result["_workers"].values():  # every worker's, not the chief's alone
        check_topology(worker, topology)
        check_cell(idiom, backend, topology, one[idiom], worker[idiom])


def test_every_callback_idiom_is_checked_for_acting():
    groups = idiom_table._descriptions()
    callbacks = {name for name in IDIOMS if groups[name][0] == "callbacks"}
    assert callbacks and callbacks == set(ACTED), callbacks ^ set(ACTED)


def test_every_idiom_is_in_the_job_and_expectations_name_real_cells():
    assert IDIOMS and len(IDIOMS) == len(set(IDIOMS))
    for (idiom, backend, topology), _ in EXPECTED.items():
        assert idiom in IDIOMS, idiom
        assert backend in (*BACKENDS, "*") and topology in (*TOPOLOGIES, "*")


def test_idiom_table_is_generated():
    table = idiom_table.markdown()
    page = (REPO / "docs" / "idioms.md").read_text()
    assert table in page, "run: python -m tools.docs.idiom_table --write"


# ------------------------------------------------------------------ upstream failures


@pytest.mark.devices
@pytest.mark.upstream_failure("keras_tf_predict_on_batch_copies")
@pytest.mark.tensorflow
def test_predict_on_batch_returns_one_row_per_example_under_two_replicas():
    code = """
    import json
    import numpy as np
    import keras, tfdist
    with tfdist.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    x = np.ones((8, 2), "float32")
    print(json.dumps({"rows": int(model.predict_on_batch(x).shape[0])}))
    """
    fixed = last_json_line(run_python(code, TFDIST_CPU_DEVICES="2").stdout)
    upstream = last_json_line(
        run_python(
            code, TFDIST_CPU_DEVICES="2", TFDIST_COMPAT_EXCLUDE="keras_tf_predict_on_batch_copies"
        ).stdout
    )
    assert (upstream["rows"], fixed["rows"]) == (16, 8)


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.upstream_failure("keras_tf_ema_overwrite_under_strategy")
@pytest.mark.tensorflow
def test_ema_overwrite_fails_upstream_under_two_replicas_and_matches_with_the_fix():
    code = f"""
    import json, sys
    sys.path.insert(0, {str(SCRIPTS)!r})
    import idioms_job
    try:
        print(json.dumps({{"weights": idioms_job.use_ema_overwrite()["weights"]}}))
    except Exception as err:
        print(json.dumps({{"error": str(err)}}))
    """
    fixed = last_json_line(run_python(code, TFDIST_CPU_DEVICES="2").stdout)
    one = last_json_line(run_python(code).stdout)
    upstream = last_json_line(
        run_python(
            code,
            TFDIST_CPU_DEVICES="2",
            TFDIST_COMPAT_EXCLUDE="keras_tf_ema_overwrite_under_strategy",
        ).stdout
    )
    assert "merge_call` called while defining a new graph" in upstream["error"]
    equivalence.assert_close(one["weights"], fixed["weights"], 1e-5)


_OVERFLOW_ON_ONE_REPLICA = """
import json
import numpy as np
import keras, tensorflow as tf, tfdist
with tfdist.scope():
    weight = keras.Variable(np.ones(1, "float32"))
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build([weight])
strategy = tfdist.strategy()

@tf.function
def step():
    def on_replica():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        # Replica 1's part of the batch overflowed float16; replica 0's did not.
        grad = tf.where(replica == 1, tf.constant([np.inf]), tf.constant([1.0]))
        optimizer.apply([grad], [weight])
    strategy.run(on_replica)

step()
print(json.dumps({"weight": float(weight.numpy()[0]),
                  "scale": float(optimizer.dynamic_scale.numpy())}))
"""


@pytest.mark.devices
@pytest.mark.upstream_failure("keras_tf_loss_scale_finite_everywhere")
@pytest.mark.tensorflow
def test_a_step_that_overflows_on_one_replica_is_skipped_on_every_replica():
    fixed = last_json_line(run_python(_OVERFLOW_ON_ONE_REPLICA, TFDIST_CPU_DEVICES="2").stdout)
    upstream = last_json_line(
        run_python(
            _OVERFLOW_ON_ONE_REPLICA,
            TFDIST_CPU_DEVICES="2",
            TFDIST_COMPAT_EXCLUDE="keras_tf_loss_scale_finite_everywhere",
        ).stdout
    )
    # Upstream: the first replica's "finite" applies the all-reduced inf to the weight.
    assert not np.isfinite(upstream["weight"])
    # Fixed: skipped as one device skips a non-finite gradient, the loss scale halved.
    assert fixed == {"weight": 1.0, "scale": 32768.0 / 2}
