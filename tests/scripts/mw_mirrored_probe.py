"""Single-process probe for tests/compat/test_compat.py (run with TFDIST_CPU_DEVICES=2).

Nothing is patched when it starts. Under tf.distribute.MirroredStrategy on 2 logical
CPUs it records, before and after ``tfdist.compat.apply_all(exclude=[])``:

* how many times ``fit(epochs=2)`` starts iterating a dataset (upstream peeks one
  extra batch to build the model; the spec-based build does not);
* the upstream error of ``SGD(gradient_accumulation_steps=2)``, then the fixed
  result, compared with the same model trained without a strategy;
* a dataset whose element spec has an unknown rank (the fallback path of the
  spec-based build), compared with training without a strategy;
* a model built in the scope and compiled outside it with ``optimizer="adam"``: the
  upstream error, then the fixed run against the same model without a strategy.

Prints one JSON line.
"""

import json
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import equivalence  # noqa: E402

from tfdist import compat
from tfdist.backends import tensorflow as tf_backend
from tfdist.core import config

tf_backend.configure_cpu_devices(config.cpu_devices() or 2)
mirrored = tf.distribute.MirroredStrategy()

import keras  # noqa: E402

tf.config.experimental.enable_op_determinism()
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = (x @ rng.normal(size=(4, 1))).astype("float32")
iterations = {"count": 0}


def counting_dataset():
    def gen():
        iterations["count"] += 1  # called once per iterator created over the dataset
        yield from zip(x, y, strict=True)

    spec = (tf.TensorSpec((4,), tf.float32), tf.TensorSpec((1,), tf.float32))
    return tf.data.Dataset.from_generator(gen, output_signature=spec).batch(16)


def unknown_rank_dataset():
    def no_shape(a, b):
        a = tf.numpy_function(lambda v: v, [a], tf.float32)  # loses the static shape
        return a, b

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(no_shape)


class Reshaping(keras.Model):
    """Accepts inputs of unknown rank (it reshapes them), unlike keras.Sequential."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        return self.dense(tf.reshape(inputs, (-1, 4)))


def build(accumulate=None, scope=True, reshaping=False):
    keras.utils.set_random_seed(0)
    with mirrored.scope() if scope else tf.distribute.get_strategy().scope():
        if reshaping:
            model = Reshaping()
        else:
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=accumulate),
            loss="mse",
        )
    return model


def compiled_outside(optimizer, scope=True):
    """Built in the scope (or without one), compiled after it, then fit: logs, weights, steps."""
    model = build(scope=scope)
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    steps = int(model.optimizer.iterations.numpy())
    return {"history": history.history, "weights": model.get_weights(), "steps": steps}


def iterations_of_fit():
    iterations["count"] = 0
    build().fit(counting_dataset(), epochs=2, verbose=0)
    return iterations["count"]


def failure(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"[-1500:]
    return None


def max_diff(a, b):
    return equivalence.max_difference(a, b)


result = {"iterations_unfixed": iterations_of_fit()}
result["accumulation_unfixed"] = failure(
    lambda: build(accumulate=2).fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
)

result["adam_outside_unfixed"] = failure(lambda: compiled_outside("adam"))

result["applied"] = compat.apply_all(exclude=[])
result["iterations_fixed"] = iterations_of_fit()

accumulating = build(accumulate=2)
accumulating.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
reference = build(accumulate=2, scope=False)
reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
result["accumulation_diff"] = max_diff(accumulating.get_weights(), reference.get_weights())
plain = build(scope=False)
plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
result["accumulation_differs_from_plain"] = max_diff(reference.get_weights(), plain.get_weights())

unknown = build(reshaping=True)
unknown.fit(unknown_rank_dataset(), epochs=2, verbose=0)
known = build(scope=False, reshaping=True)
known.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
result["unknown_rank_diff"] = max_diff(unknown.get_weights(), known.get_weights())
adam_reference = compiled_outside("adam", scope=False)
result["adam_outside_diff"] = max_diff(adam_reference, compiled_outside("adam"))
result["replicas"] = mirrored.num_replicas_in_sync
print(json.dumps(result), flush=True)
