"""A subclassed model in the style of Keras's "Making new layers and models via
subclassing" guide: no ``keras.Input``, so Keras builds it at its first ``fit`` step.

Seeded (``keras.utils.set_random_seed``), so every topology starts from the same weights.
``--batch-sum model`` adds to each example a feature summed over the batch axis
(``ops.sum(h, axis=0)``): on TensorFlow each replica sums over its own part of the
global batch (on JAX the batch is one array). ``--batch-sum loss`` compiles a loss that
returns the squared errors summed over the batch, a scalar: Keras sums the replicas'
scalar losses, so this one trains as on one device; ``--batch-sum mean`` returns their
mean, a scalar too, which the replicas' sum then makes R times one device's.
"""

import argparse

import keras
import numpy as np
from keras import ops

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--batch-sum", choices=("none", "model", "loss", "mean"), default="none")
args = parser.parse_args()

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")


class Regressor(keras.Model):
    def __init__(self, batch_sum=False, **kwargs):
        super().__init__(**kwargs)
        self.batch_sum = batch_sum
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.head = keras.layers.Dense(1)

    def call(self, inputs):
        h = self.hidden(inputs)
        if self.batch_sum:  # a batch-wide context: every example sees the others
            h = h + 0.01 * ops.sum(h, axis=0, keepdims=True)
        return self.head(h)


def summed_squared_error(y_true, y_pred):
    return ops.sum(ops.square(y_true - y_pred))  # summed over the batch, not averaged


def scalar_mean_squared_error(y_true, y_pred):
    return ops.mean(ops.square(y_true - y_pred))  # one scalar: Keras does not scale it


with tfdist.scope():
    model = Regressor(batch_sum=args.batch_sum == "model")
    losses = {"loss": summed_squared_error, "mean": scalar_mean_squared_error}
    loss = losses.get(args.batch_sum, "mse")
    lr = 0.002 if args.batch_sum == "loss" else 0.05
    model.compile(keras.optimizers.SGD(lr, momentum=0.9), loss)

model.fit(x, y, batch_size=32, epochs=2, verbose=0)
