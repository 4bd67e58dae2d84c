"""A script as the Keras examples write it: no tfdist, no strategy, no distribution.

Its shapes are MNIST's (28x28x1, 10 classes), its model the examples' convnet
(Conv2D, MaxPooling2D, Dense), and its data size (300) leaves a partial last batch at its
batch_size of 64. ``python keras_example_convnet.py OUT`` writes OUT-<pid>.npz: the
weights after ``fit``, the replicas the model trained on, its logged loss, and whether the
model saved by every process to OUT.keras (a custom layer without ``__init__`` in it)
loads back with the same predictions.
``--own-strategy`` then trains a second model in the script's own MirroredStrategy (a
notebook comparing tfdist with a hand-written strategy) and records it too.
"""

import os
import sys

import keras
import numpy as np
from keras import layers

keras.utils.set_random_seed(1)
rng = np.random.default_rng(0)
x = rng.random((300, 28, 28, 1), dtype=np.float32)
y = rng.integers(0, 10, 300)


class Halve(layers.Layer):
    """A custom layer with no ``__init__`` of its own: Keras configures it automatically."""

    def call(self, inputs):
        return inputs * 0.5


def build():
    model = keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            Halve(),
            layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(loss="sparse_categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def replicas(model) -> int:
    if keras.backend.backend() == "tensorflow":
        return model.distribute_strategy.num_replicas_in_sync
    chosen = keras.distribution.distribution()
    return 1 if chosen is None else chosen.device_mesh.devices.size


model = build()
history = model.fit(x, y, batch_size=64, epochs=2, verbose=0, shuffle=False)
found = {
    "weights": np.concatenate([w.numpy().ravel() for w in model.weights]),
    "replicas": replicas(model),
    "loss": np.array(history.history["loss"]),
}
# Every process saves, as the examples' last line: to one path when the model trained on
# the job (tfdist writes it once); to its own when each process trained a copy of its own
# (TFDIST_UNSCOPED_MODELS=local: two copies saved to one path tear it, as upstream).
saved = f"{sys.argv[1]}.keras" if found["replicas"] > 1 else f"{sys.argv[1]}-{os.getpid()}.keras"
model.save(saved)
loaded = keras.models.load_model(saved, custom_objects={"Halve": Halve})
same = np.allclose(loaded.predict(x[:8], verbose=0), model.predict(x[:8], verbose=0), atol=1e-6)
found["reloaded_equal"] = same
if "--own-strategy" in sys.argv:
    import tensorflow as tf

    keras.utils.set_random_seed(1)
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        own = build()
    own.fit(x[:256], y[:256], batch_size=64, epochs=2, verbose=0, shuffle=False)
    found["own_weights"] = np.concatenate([w.numpy().ravel() for w in own.weights])
    found["own_replicas"] = own.distribute_strategy.num_replicas_in_sync
np.savez(f"{sys.argv[1]}-{os.getpid()}.npz", **found)
