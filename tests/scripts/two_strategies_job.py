"""Two strategies in one process, in either order: tfdist's and the script's own.

``python two_strategies_job.py ORDER OUT [same]``: ORDER is ``tfdist-first`` or
``own-first``. One model is built in ``tfdist.scope()`` and fit on a
``tfdist.data.pipeline`` (size 500: a partial last batch); another, of another size (of
the same size with ``same``), in the script's own ``tf.distribute.MirroredStrategy()``,
fit on ``batch(64, drop_remainder=True)``. OUT.npz gets each model's weights and replicas.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist

order, out = sys.argv[1], sys.argv[2]
own_width = 16 if sys.argv[3:] == ["same"] else 24
rng = np.random.default_rng(0)
x = rng.random((500, 8), dtype=np.float32)
y = (x.sum(1) > 4).astype("int64")


def build(width):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(2)]
    )
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def with_tfdist():
    with tfdist.scope():
        model = build(16)
    data = tf.data.Dataset.from_tensor_slices((x, y))
    model.fit(tfdist.data.pipeline(data, global_batch=64, shuffle=None), epochs=2, verbose=0)
    return model


def with_own():
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = build(own_width)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True)
    model.fit(data, epochs=2, verbose=0)
    return model


steps = [with_tfdist, with_own] if order == "tfdist-first" else [with_own, with_tfdist]
found = {}
for step in steps:
    model = step()
    name = step.__name__
    found[name] = np.concatenate([w.numpy().ravel() for w in model.weights])
    found[name + "_replicas"] = model.distribute_strategy.num_replicas_in_sync
np.savez(out, **found)
print("done", {k: v for k, v in found.items() if k.endswith("replicas")})
