"""Each worker seeds its data from its own index: 2 devices train the one-device model,
2 workers do not (each trains on other numbers).
"""

import os

import keras
import numpy as np

import tfdist

keras.utils.set_random_seed(0)
rank = int(os.environ.get("RANK", "0"))  # tfdist launch sets it; 0 on one process
rng = np.random.default_rng(rank)  # the mistake: other data on every worker
x = rng.normal(size=(512, 8)).astype("float32")
y = (x @ np.ones((8, 1))).astype("float32")

with tfdist.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse")

model.fit(x, y, batch_size=32, epochs=2, verbose=0)
