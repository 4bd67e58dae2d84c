"""Checks tfdist.data.pipeline under this process's strategy; prints the results as JSON.

Run with TFDIST_CPU_DEVICES=1 and =2 (see tests/data/test_data.py) and compare:

* ``fit``: weights after Keras ``fit`` on a seeded pipeline with the same global batch
  (they must agree across device counts), and the weights of the same training
  interrupted after ``--stop-after`` batches of epoch 0 and resumed with
  ``set_position(0, stop_after)`` (they must agree with the uninterrupted run).
* ``--mnist``: one epoch of ``pipeline(mnist train, 64, map_fn=scale)``: batch shapes,
  dtypes and value range, per-replica shapes, and the labels of a seeded pipeline.

    TFDIST_CPU_DEVICES=2 python data_devices.py --global-batch 32 --mnist
"""

import argparse
import json
import time
from dataclasses import astuple

import numpy as np
import tensorflow as tf

import tfdist
from tfdist import data

parser = argparse.ArgumentParser()
parser.add_argument("--global-batch", type=int, default=32)
parser.add_argument("--stop-after", type=int, default=3)
parser.add_argument("--mnist", action="store_true")
args = parser.parse_args()

import keras  # noqa: E402

keras.utils.set_random_seed(0)
tf.config.experimental.enable_op_determinism()
strategy = tfdist.strategy()
replicas = strategy.num_replicas_in_sync
result = {"replicas": replicas, "strategy": type(strategy).__name__}

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")


class Resume(keras.callbacks.Callback):
    """What checkpointing does: set the position when an epoch begins; can stop early."""

    def __init__(self, skip_at_epoch0=0, stop_after=None):
        super().__init__()
        self.skip, self.stop_after = skip_at_epoch0, stop_after

    def on_epoch_begin(self, epoch, logs=None):
        data.set_position(epoch, self.skip if epoch == 0 else 0)

    def on_train_batch_end(self, batch, logs=None):
        if self.stop_after is not None and batch + 1 == self.stop_after:
            self.model.stop_training = True


def fresh_model():
    keras.utils.set_random_seed(0)
    with tfdist.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


train = data.pipeline((x, y), args.global_batch // replicas, seed=3)
straight = fresh_model()
straight.fit(train, epochs=2, verbose=0, callbacks=[Resume()])
result["weights"] = [w.tolist() for w in straight.get_weights()]

interrupted = fresh_model()
interrupted.fit(train, epochs=2, verbose=0, callbacks=[Resume(stop_after=args.stop_after)])
interrupted.fit(train, epochs=2, verbose=0, callbacks=[Resume(skip_at_epoch0=args.stop_after)])
result["resumed_weights"] = [w.tolist() for w in interrupted.get_weights()]

# Creating an iterator must not consume the position: Keras creates one it never reads
# at the end of each epoch, before the next on_epoch_begin sets the position.
data.set_position(0)
with tfdist.scope():  # built inside the scope: its state must still be plain host variables
    probe = data.pipeline((x, y), args.global_batch // replicas, seed=9)
iterator = iter(strategy.experimental_distribute_dataset(probe))
time.sleep(1.0)  # time for any background prefetch to start (none should)
result["position_after_iter"] = list(astuple(data.position(probe)))
next(iterator)
result["position_after_next"] = list(astuple(data.position(probe)))

if args.mnist:
    raw = data.mnist("train")
    train = data.pipeline(raw, 64, map_fn=data.scale)
    shapes, dtypes, low, high, first_labels = set(), set(), 1.0, 0.0, []
    for epoch in range(2):
        for step, (images, labels) in enumerate(train):
            if epoch == 0:
                shapes.add(tuple(images.shape))
                dtypes.add(images.dtype.name)
                low = min(low, float(tf.reduce_min(images)))
                high = max(high, float(tf.reduce_max(images)))
            if step == 0:
                first_labels.append(labels.numpy().tolist())
                if epoch == 1:
                    break
    result["mnist"] = {
        "shapes": sorted(shapes),
        "dtypes": sorted(dtypes),
        "min": low,
        "max": high,
        "first_labels": first_labels,
    }
    images, _ = next(iter(strategy.experimental_distribute_dataset(train)))
    result["mnist"]["per_replica"] = [
        list(v.shape) for v in strategy.experimental_local_results(images)
    ]
    data.set_position(0)
    seeded = data.pipeline(raw, 64, map_fn=data.scale, seed=5)
    result["mnist"]["seeded_labels"] = [
        labels.numpy().tolist() for _, (_, labels) in zip(range(3), seeded, strict=False)
    ]
print(json.dumps(result))
