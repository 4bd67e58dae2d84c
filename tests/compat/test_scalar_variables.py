"""int(), float() and np.asarray of a scalar variable under a strategy (TensorFlow).

A callback reading ``int(self.model.optimizer.iterations)`` fails under
MirroredStrategy upstream ("int() argument must be ... not 'MirroredVariable'"). With
``keras_tf_scalar_of_a_mirrored_variable`` it reads the same number one device reads, on
4 replicas, in a callback and outside; a non-scalar still raises upstream's TypeError.
In a strategy's scope ``np.asarray`` of a scalar mirrored variable's value raises upstream
(NumPy 2); with ``tf_numpy_of_a_distributed_scalar`` it is one device's 0-d array, and every
value upstream reads is read the same.
"""

from __future__ import annotations

import pytest

from tfdist.compat import scalar_variables

from conftest import last_json_line, run_python

SCRIPT = """
import json
import numpy as np, keras, tensorflow as tf
import tfdist

seen = []

class Steps(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        seen.append(int(self.model.optimizer.iterations))

with tfdist.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    scale = keras.Variable(0.5, trainable=False)
model.fit(np.ones((24, 3)), np.ones((24, 2)), batch_size=8, epochs=2, verbose=0, callbacks=[Steps()])
out = {"replicas": model.distribute_strategy.num_replicas_in_sync, "seen": seen}
for name, read in (("int", lambda: int(model.optimizer.iterations)), ("float", lambda: float(scale)),
                   ("kernel", lambda: int(model.layers[0].kernel))):
    try:
        out[name] = read()
    except TypeError as err:
        out[name] = "TypeError: " + str(err)[:120]
print(json.dumps(out))
"""


@pytest.mark.devices
def test_int_of_a_mirrored_scalar_reads_its_value_in_a_callback_and_outside():
    out = last_json_line(run_python(SCRIPT, TFDIST_CPU_DEVICES="4").stdout)
    assert out["replicas"] == 4
    assert out["seen"] == [3, 6] and out["int"] == 6 and out["float"] == 0.5  # one device's
    assert out["kernel"].startswith("TypeError: Only scalar arrays"), out  # upstream's refusal


@pytest.mark.devices
@pytest.mark.upstream_failure("keras_tf_scalar_of_a_mirrored_variable")
def test_upstream_int_of_a_mirrored_scalar_raises():
    proc = run_python(
        SCRIPT,
        check=False,
        TFDIST_CPU_DEVICES="4",
        TFDIST_COMPAT_EXCLUDE=scalar_variables.KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE,
    )
    assert proc.returncode != 0
    assert "not 'MirroredVariable'" in proc.stderr, proc.stderr[-2000:]


# np.asarray of a distributed value's .value, in every context a script meets: in the
# scope (a scalar, a vector, a Normalization layer's count), outside it, in a replica.
NUMPY = """
import json
import numpy as np, keras, tensorflow as tf
import tfdist

with tfdist.scope():
    count = keras.Variable(3, dtype="int64", trainable=False)
    scale = keras.Variable(0.5)
    vector = keras.Variable([1.0, 2.0])
    norm = keras.layers.Normalization()
    norm.adapt(np.arange(8, dtype="float32")[:, None])

def read(v):
    try:
        value = np.asarray(v.value)
        return {"value": value.tolist(), "type": type(value).__name__, "shape": list(value.shape)}
    except ValueError as err:
        return {"error": str(err)}

out = {"replicas": tfdist.num_replicas()}
with tfdist.scope():
    for name, v in (("count", count), ("scale", scale), ("vector", vector), ("norm_count", norm.count)):
        out["in scope " + name] = read(v)
    out["convert in scope"] = read(type("V", (), {"value": keras.ops.convert_to_numpy(vector.value)})())
for name, v in (("count", count), ("vector", vector)):
    out["outside " + name] = read(v)
print(json.dumps(out))
"""


def _numpy(**env) -> dict:
    out = last_json_line(run_python(NUMPY, TFDIST_CPU_DEVICES="2", **env).stdout)
    assert out["replicas"] == 2, out
    return out


@pytest.mark.devices
@pytest.mark.upstream_failure("tf_numpy_of_a_distributed_scalar")
def test_numpy_of_a_distributed_scalar_fails_upstream_and_reads_its_value_with_the_fix():
    """In a strategy's scope np.asarray of a scalar mirrored variable's value raises
    upstream (NumPy 2 refuses the NumPy scalar the value on the device gives); with the
    fix it is the 0-d array one device gives."""
    fixed = _numpy()
    upstream = _numpy(TFDIST_COMPAT_EXCLUDE=scalar_variables.TF_NUMPY_OF_A_DISTRIBUTED_SCALAR)
    for name in ("count", "scale", "norm_count"):
        assert "not producing an array" in upstream[f"in scope {name}"]["error"], upstream
    assert fixed["in scope count"] == {"value": 3, "type": "ndarray", "shape": []}
    assert fixed["in scope scale"] == {"value": 0.5, "type": "ndarray", "shape": []}
    assert (
        fixed["in scope norm_count"]["shape"] == [] and "error" not in fixed["in scope norm_count"]
    )


@pytest.mark.devices
def test_numpy_of_a_distributed_value_is_unchanged_where_upstream_reads_it():
    """Where upstream reads a distributed value (a vector in the scope, any value outside
    it), the fix gives exactly what upstream gives."""
    fixed = _numpy()
    upstream = _numpy(TFDIST_COMPAT_EXCLUDE=scalar_variables.TF_NUMPY_OF_A_DISTRIBUTED_SCALAR)
    for name in ("in scope vector", "convert in scope", "outside count", "outside vector"):
        assert "error" not in upstream[name], (name, upstream[name])
        assert fixed[name] == upstream[name], name
    assert fixed["in scope vector"] == {"value": [1.0, 2.0], "type": "ndarray", "shape": [2]}
