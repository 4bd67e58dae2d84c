"""Only the chief reaches a barrier before training: under 2 workers it waits for the
other, which waits in fit's first step for the chief. One device never waits.
"""

import keras
import numpy as np

import tfdist

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ np.ones((8, 1))).astype("float32")

with tfdist.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse")

if tfdist.is_chief():
    tfdist.barrier("files written")  # the mistake: every worker must reach a barrier

model.fit(x, y, batch_size=32, epochs=1, verbose=0)
