"""A small convnet in the style of Keras's "Simple MNIST convnet" example, with
BatchNormalization after each convolution and Adam, on random images.

The BatchNormalization layers are synchronized (``tfdist.scope(sync_batchnorm=True)``):
every topology trains one device's model. The convolutions' biases feed a
BatchNormalization, which subtracts the batch's mean: their true gradient is zero, and
Adam turns the rounding in it into steps of up to its learning rate. ``--dense`` uses
Dense layers in place of the convolutions (the same biases before BatchNormalization);
``--bn plain`` leaves the BatchNormalization layers unsynchronized (a real difference).
"""

import argparse

import keras
import numpy as np

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--dense", action="store_true")
parser.add_argument("--bn", choices=("sync", "plain"), default="sync")
args = parser.parse_args()

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 12, 12, 1)).astype("float32")
y = rng.integers(0, 10, size=(1024,))

with tfdist.scope(sync_batchnorm=args.bn == "sync"):
    if args.dense:
        body = [keras.layers.Flatten(), keras.layers.Dense(32), keras.layers.BatchNormalization()]
        body += [keras.layers.ReLU(), keras.layers.Dense(32), keras.layers.BatchNormalization()]
    else:
        body = [keras.layers.Conv2D(8, 3), keras.layers.BatchNormalization(), keras.layers.ReLU()]
        body += [keras.layers.Conv2D(16, 3), keras.layers.BatchNormalization()]
        body += [keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D()]
    model = keras.Sequential([keras.Input((12, 12, 1)), *body, keras.layers.Dense(10)])
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

model.fit(x, y, batch_size=64, epochs=2, verbose=0)
