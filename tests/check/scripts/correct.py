"""A correct script in the tutorials' style: tfdist.scope(), one seed on every worker.

tfdist check runs it unchanged; ``--bn`` adds BatchNormalization (``--bn sync``:
synchronized through tfdist.scope(sync_batchnorm=True), ``--bn plain``: not);
``--random dropout`` or ``noise`` adds a Dropout or GaussianNoise layer (each replica draws
its own); ``--examples N`` trains on N examples (501: a last batch of 21 of 32, which 2
replicas share 11 + 10; 500: 20, shared 10 + 10).
"""

import argparse

import keras
import numpy as np

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--bn", choices=("none", "plain", "sync"), default="none")
parser.add_argument("--random", choices=("none", "dropout", "noise"), default="none")
parser.add_argument("--examples", type=int, default=512)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

keras.utils.set_random_seed(0)  # the same initial weights and data on every worker
# The same global batch on every topology: 32 on one device, 16 per replica on two.
rng = np.random.default_rng(0)
x = rng.normal(size=(args.examples, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")

with tfdist.scope(sync_batchnorm=args.bn == "sync"):
    layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu")]
    if args.bn != "none":
        layers.append(keras.layers.BatchNormalization())
    if args.random == "dropout":
        layers.append(keras.layers.Dropout(0.5))
    elif args.random == "noise":
        layers.append(keras.layers.GaussianNoise(0.5))
    model = keras.Sequential([*layers, keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])

model.fit(x, y, batch_size=32, epochs=args.epochs, verbose=0)
model.save("never-written.keras")  # the check ends the process when fit returns
