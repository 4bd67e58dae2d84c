"""Keras 3 on JAX: the same tfdist script on 1 device, 4 logical devices, 2 processes x 2
devices and a 2x2 ModelParallel gives the same weights; errors are clear."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, SCRIPTS, child_env, equivalence, last_json_line, run_python

pytestmark = pytest.mark.jax
TOL = 1e-5


def _job(mode: str, devices: int | None = None) -> dict:
    env = {"KERAS_BACKEND": "jax"}
    if devices:
        env["TFDIST_CPU_DEVICES"] = str(devices)
    proc = run_python(
        f"import runpy, sys; sys.argv = ['jax_job.py', {mode!r}]; "
        f"runpy.run_path({str(SCRIPTS / 'jax_job.py')!r}, run_name='__main__')",
        timeout=240,
        **env,
    )
    return last_json_line(proc.stdout)


def _assert_same_weights(a: dict, b: dict) -> None:
    equivalence.assert_close(a["weights"], b["weights"], TOL)


@pytest.mark.devices
@pytest.mark.slow
def test_data_parallel_and_model_parallel_match_one_device():
    one = _job("dp")
    four = _job("dp", 4)
    model_parallel = _job("mp", 4)
    assert (one["replicas"], four["replicas"], model_parallel["replicas"]) == (1, 4, 2)
    assert model_parallel["kernel_sharding"] in ("P(None, 'model')", "PartitionSpec(None, 'model')")
    assert one["loss"][-1] < one["loss"][0]  # it trained
    _assert_same_weights(one, four)
    _assert_same_weights(one, model_parallel)


@pytest.mark.multiworker
@pytest.mark.slow
def test_two_processes_of_two_devices_under_launch_match_one_device():
    one = _job("dp")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdist",
            "launch",
            "-n",
            "2",
            "--devices-per-worker",
            "2",
            str(SCRIPTS / "jax_job.py"),
            "dp",
        ],
        cwd=REPO,
        env=child_env(KERAS_BACKEND="jax"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [
        last_json_line(line.partition(" ")[2])
        for line in proc.stdout.splitlines()
        if line.startswith("[w") and '"mode"' in line
    ]
    assert sorted(r["chief"] for r in results) == [False, True]
    for result in results:
        assert (result["replicas"], result["workers"]) == (4, 2)
        _assert_same_weights(one, result)


@pytest.mark.devices
def test_mesh_errors_and_tensorflow_options_are_named():
    proc = run_python(
        """
        import tfdist, keras
        from keras import distribution as kd
        mesh = kd.DeviceMesh((2,), ["batch"], devices=kd.list_devices()[:2])
        layout = kd.LayoutMap(mesh)
        for call in (lambda: tfdist.scope(layout_map=layout).__enter__(),
                     lambda: tfdist.scope(cpu_devices=2).__enter__(),
                     lambda: tfdist.scope(mesh=mesh).__enter__(),
                     lambda: tfdist.strategy()):
            try:
                call()
            except Exception as err:
                print(type(err).__name__, "|", err)
        """,
        KERAS_BACKEND="jax",
        TFDIST_CPU_DEVICES="4",
    )
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("ConfigError |") and "has 2 devices, but the job has 4" in lines[0]
    assert lines[1].startswith("TypeError |") and "TensorFlow-backend options" in lines[1]
    assert lines[2].startswith("ValueError |") and "need a layout_map" in lines[2]
    assert lines[3].startswith("RuntimeError |") and "TensorFlow backend only" in lines[3]


@pytest.mark.devices
def test_jax_process_gets_no_tensorflow_runtime_patches_and_its_own_fixes():
    proc = run_python(
        """
        import json
        import tfdist, keras
        from tfdist import compat
        packages = {f.name: f.package for f in compat.FIXES}
        print(json.dumps({"applied": compat.applied(), "packages": packages}))
        """,
        KERAS_BACKEND="jax",
    )
    result = last_json_line(proc.stdout)
    applied = result["applied"]
    assert {
        "keras_jax_initialize_once",
        "keras_jax_model_keeps_distribution",
        "keras_jax_distributed_lookahead",
        "keras_jax_sharded_epoch_length",
    } <= set(applied)
    # No TensorFlow runtime patch, and no fix written for Keras on TensorFlow.
    assert not [name for name in applied if result["packages"][name] == "tensorflow"]
    assert not [name for name in applied if name.startswith(("tf_", "keras_multi_worker"))]


_FIT_SEES = """
import json
import tfdist, keras
from keras import distribution as kd
seen = []
class Probe(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        seen.append(type(kd.distribution()).__name__)
with tfdist.scope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(keras.ops.ones((8, 2)), keras.ops.ones((8, 1)), batch_size=4, callbacks=[Probe()],
          verbose=0)
print(json.dumps(sorted(set(seen))))
"""


@pytest.mark.devices
@pytest.mark.parametrize(("exclude", "seen"), [("all", ["NoneType"]), ("", ["DataParallel"])])
@pytest.mark.upstream_failure("keras_jax_model_keeps_distribution")
def test_fit_after_the_scope_runs_under_the_models_distribution(exclude, seen):
    """Upstream (every fix excluded) runs fit after the block with no distribution."""
    proc = run_python(
        _FIT_SEES, KERAS_BACKEND="jax", TFDIST_CPU_DEVICES="2", TFDIST_COMPAT_EXCLUDE=exclude
    )
    assert last_json_line(proc.stdout) == seen


_INIT_TWICE = """
import socket
import jax, keras
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0,
                           initialization_timeout=30)
import tfdist
from tfdist import compat
compat.apply_all()
try:
    keras.distribution.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
    print("OK", jax.process_count())
except Exception as err:
    print("ERR", err)
"""


@pytest.mark.devices
@pytest.mark.parametrize(("exclude", "expect"), [("all", "ERR"), ("", "OK 1")])
@pytest.mark.upstream_failure("keras_jax_initialize_once")
def test_keras_initialize_after_jax_was_initialised(exclude, expect):
    """Upstream refuses a second jax initialisation; fixed, the script's call joins."""
    proc = run_python(_INIT_TWICE, KERAS_BACKEND="jax", TFDIST_COMPAT_EXCLUDE=exclude)
    assert proc.stdout.strip().splitlines()[-1].startswith(expect), proc.stdout


# How far ahead of the step the batches are sent to the devices: the data adapter's
# iterator counts what it handed out when each training step begins. jax reports an
# accelerator backend here (the fix is a no-op on CPU, as upstream's own look-ahead is).
_LOOKAHEAD = """
import json
import jax
jax.default_backend = lambda: "gpu"
import numpy as np
import tfdist, keras
from keras.src.trainers.data_adapters import array_data_adapter as ada
pulled = [0]
original = ada.ArrayDataAdapter.get_jax_iterator
def counting(self):
    for batch in original(self):
        pulled[0] += 1
        yield batch
ada.ArrayDataAdapter.get_jax_iterator = counting
ahead = []
class Probe(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        ahead.append(pulled[0] - (batch + 1))
keras.utils.set_random_seed(0)
with tfdist.scope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.arange(32, dtype="float32").reshape(16, 2) / 32
model.fit(x, x[:, :1], batch_size=4, shuffle=False, callbacks=[Probe()], verbose=0)
print(json.dumps({"ahead": ahead, "weights": [w.tolist() for w in model.get_weights()]}))
"""


@pytest.mark.devices
@pytest.mark.upstream_failure("keras_jax_distributed_lookahead")
def test_batches_reach_the_devices_one_step_ahead_under_a_distribution():
    results = {}
    for exclude in ("keras_jax_distributed_lookahead", ""):
        proc = run_python(
            _LOOKAHEAD, KERAS_BACKEND="jax", TFDIST_CPU_DEVICES="2", TFDIST_COMPAT_EXCLUDE=exclude
        )
        results[exclude] = last_json_line(proc.stdout)
    upstream, fixed = results["keras_jax_distributed_lookahead"], results[""]
    # Upstream's loop holds only the batch it is about to run; with the fix the batches
    # after it have been produced (their copies started) while a step runs.
    assert len(fixed["ahead"]) == len(upstream["ahead"]) == 4
    assert all(f > u for f, u in zip(fixed["ahead"][:-1], upstream["ahead"][:-1], strict=True))
    assert fixed["weights"] == upstream["weights"]  # the same batches, in the same order


# Keras's per-process sharding (rebatch + shard) of a seeded pipeline, called directly:
# in one process it runs the same code as in each process of a multi-process job.
_SHARDED_LENGTH = """
import json
import numpy as np
import tfdist, keras
import tensorflow as tf
from keras import distribution as kd
x = np.arange(64, dtype="float32").reshape(32, 2)
with tfdist.scope() as dist:
    train = tfdist.data.pipeline((x, x[:, :1]), 4, seed=1)
    evaluation = tfdist.data.pipeline((x, x[:, :1]), 4, shuffle=None)
print(json.dumps({
    "declared": int(train.cardinality()),
    "sharded": int(dist.distribute_tf_dataset(train).cardinality()),
    "sharded_batches": sum(1 for _ in dist.distribute_tf_dataset(train)),
    "evaluation": int(dist.distribute_tf_dataset(evaluation).cardinality()),
}))
"""


@pytest.mark.devices
@pytest.mark.parametrize(("exclude", "sharded"), [("keras_jax_sharded_epoch_length", -2), ("", 4)])
@pytest.mark.upstream_failure("keras_jax_sharded_epoch_length")
def test_per_process_sharding_keeps_the_declared_epoch_length(exclude, sharded):
    """Upstream's sharded dataset has an unknown length (Keras then takes the first,
    possibly resumed and short, epoch's length for all); fixed, it keeps the pipeline's."""
    proc = run_python(
        _SHARDED_LENGTH, KERAS_BACKEND="jax", TFDIST_CPU_DEVICES="2", TFDIST_COMPAT_EXCLUDE=exclude
    )
    result = last_json_line(proc.stdout)
    assert result["declared"] == 4  # 32 examples, global batch 8
    assert result["sharded"] == sharded
    assert result["sharded_batches"] == 4  # the data itself is the same either way
    # an unshuffled pipeline with no partial batch has a static batch size (Keras needs
    # it to shard), and its length is lost and kept alike
    assert result["evaluation"] == sharded


_PARTIAL_BATCH = """
import json
import numpy as np
import tfdist, keras
x = np.arange(62, dtype="float32").reshape(31, 2) / 62
y = x[:, :1]
keras.utils.set_random_seed(0)
with tfdist.scope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
    model.compile("sgd", "mse", metrics=["mae"])
results = {}
# 30 examples, global batch 8: a last batch of 6, 3 per replica
evaluation = tfdist.data.pipeline((x[:30], y[:30]), 4, shuffle=None)
results["split"] = model.evaluate(evaluation, verbose=0, return_dict=True)
kernel = model.get_weights()[0]
errors = x[:30] @ kernel - y[:30]
results["expected"] = {"loss": float(np.mean(errors**2)), "mae": float(np.mean(abs(errors)))}
# 29: a last batch of 5, which 2 processes cannot share; 30 (6: 3 each) they can
for name, count, processes in (("replicas", 31, 1), ("processes", 29, 2), ("shared", 30, 2)):
    jax_count = tfdist.backends.jax.jax.process_count
    tfdist.backends.jax.jax.process_count = lambda: processes
    try:
        tfdist.data.pipeline((x[:count], y[:count]), 4, shuffle=None)
    except ValueError as err:
        results[name] = str(err)
    finally:
        tfdist.backends.jax.jax.process_count = jax_count
print(json.dumps(results))
"""


@pytest.mark.devices
def test_a_partial_last_batch_splits_evenly_or_fails_when_built():
    """Keras on JAX splits every batch evenly between devices: a last batch that does
    is evaluated whole; one that does not fails when the pipeline is built, naming the
    numbers, instead of deep inside jax at the last step."""
    proc = run_python(_PARTIAL_BATCH, KERAS_BACKEND="jax", TFDIST_CPU_DEVICES="2")
    result = last_json_line(proc.stdout)
    for metric in ("loss", "mae"):  # float32 sums in another order: relative 1e-5
        expected = result["expected"][metric]
        assert abs(result["split"][metric] - expected) <= 1e-5 * max(1.0, abs(expected))
    assert "31 examples, so its last batch has 7 (global batch 8)" in result["replicas"]
    assert "cannot split that batch between 2 replicas" in result["replicas"]
    assert "drop_remainder=True" in result["replicas"]
    assert "cannot split that batch between 2 workers" in result["processes"]
    assert "shared" not in result  # built: each process feeds 3 of the last 6
