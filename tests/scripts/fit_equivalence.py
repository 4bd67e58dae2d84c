"""Trains a small fixed model on fixed data with tfdist and prints its final weights as JSON.

Run under different strategies (1 device, N logical devices, N workers) with the same
global batch: the printed weights must agree. Used by the equivalence tests.

    python fit_equivalence.py --global-batch 32 --epochs 2
"""

import argparse
import json

import numpy as np
import tensorflow as tf

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--global-batch", type=int, default=32)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--examples", type=int, default=256)
args = parser.parse_args()

import keras  # noqa: E402

keras.utils.set_random_seed(0)
tf.config.experimental.enable_op_determinism()

rng = np.random.default_rng(0)
x = rng.normal(size=(args.examples, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(args.examples, 1))).astype("float32")

with tfdist.scope():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    mirrored = type(model.weights[0].value).__name__

history = model.fit(
    x, y, batch_size=args.global_batch, epochs=args.epochs, shuffle=False, verbose=0
)
print(
    json.dumps(
        {
            "replicas": tfdist.num_replicas(),
            "strategy": type(tfdist.strategy()).__name__,
            "variable_type": mirrored,
            "loss": history.history["loss"],
            "weights": [w.tolist() for w in model.get_weights()],
        }
    )
)
