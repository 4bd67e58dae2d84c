"""Save then load on every worker, then a load in a scope on the chief only (a broken script).

Run under ``tfdist launch -n 2`` with either Keras backend. Every worker trains the same
small model, ``tfdist.save``s it (``.keras`` and ``.weights.h5``), and loads both back in
a scope: the chief's file must be there for every worker when ``save`` returns. Then the
chief alone calls ``load(in_scope=True)``, which must end with an error naming the rule
within its timeout (the other worker stays alive meanwhile). One JSON line per worker.

    tfdist launch -n 2 tests/scripts/save_load_job.py OUT_DIR
"""

import json
import os
import sys
import time

import equivalence
import numpy as np

import tfdist

out = sys.argv[1]
on_tf = tfdist.backends.name() == "tensorflow"
if on_tf:
    tfdist.strategy()  # before any tensor

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
with tfdist.scope():
    model = build()
# Global batches of 8 (Keras shards them across the workers of a JAX job).
model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0)
expected = model.get_weights()

keras_path = tfdist.save(model, os.path.join(out, "model.keras"))
weights_path = tfdist.save(model, os.path.join(out, "model.weights.h5"))
loaded = tfdist.load(keras_path, in_scope=True)
with tfdist.scope():
    target = build()
tfdist.load(weights_path, model=target, in_scope=True)


def diff(weights):
    return equivalence.max_difference(expected, weights)


result = {
    "worker": tfdist.worker_index(),
    "keras_diff": diff(loaded.get_weights()),
    "weights_diff": diff(target.get_weights()),
    "optimizer_steps": int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)),
    "staging_left": sorted(n for n in os.listdir(out) if n.startswith(".tmp-")),
}
tfdist.barrier("loaded")
if tfdist.is_chief():
    start = time.monotonic()
    try:
        tfdist.load(keras_path, in_scope=True, timeout=5)
        result["chief_only"] = "NO ERROR"
    except RuntimeError as err:
        result["chief_only"] = str(err)
    result["chief_only_s"] = time.monotonic() - start
else:
    time.sleep(10)  # alive, but not calling load
print(json.dumps(result), flush=True)
