"""int() and float() of a scalar Keras variable under a strategy (TensorFlow).

A callback reading ``int(self.model.optimizer.iterations)`` fails under
MirroredStrategy upstream ("int() argument must be ... not 'MirroredVariable'"). With
``keras_tf_scalar_of_a_mirrored_variable`` it reads the same number one device reads, on
4 replicas, in a callback and outside; a non-scalar still raises upstream's TypeError.
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
