"""Added losses as Keras's guides write them: an endpoint layer and a regularizer.

``python added_loss_job.py OUT``: a model whose only loss is a Keras loss object's value
given to ``add_loss`` by an endpoint layer (no loss in ``compile``), and a model with a
``kernel_regularizer`` and a compiled loss; both trained with SGD (whose steps show a
gradient's scale, which Adam's hide). OUT-<pid>.npz gets their weights and logged losses.
"""

import os
import sys

import keras
import numpy as np
from keras import ops

rng = np.random.default_rng(0)
features, targets = rng.random((64, 3)), rng.random((64, 10))


class LogisticEndpoint(keras.layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, targets, logits, sample_weights=None):
        self.add_loss(self.loss_fn(targets, logits, sample_weights))
        return ops.sigmoid(logits)


keras.utils.set_random_seed(0)
inputs = keras.Input(shape=(3,), name="inputs")
labels = keras.Input(shape=(10,), name="targets")
logits = keras.layers.Dense(10)(inputs)
endpoint = keras.Model([inputs, labels], LogisticEndpoint(name="predictions")(labels, logits))
endpoint.compile(optimizer=keras.optimizers.SGD(0.5))
data = {"inputs": features, "targets": targets}
history = endpoint.fit(data, batch_size=16, epochs=2, verbose=0, shuffle=False)
found = {
    "endpoint": np.concatenate([w.numpy().ravel() for w in endpoint.weights]),
    "endpoint_loss": np.array(history.history["loss"]),
}

keras.utils.set_random_seed(0)
regularized = keras.Sequential(
    [keras.Input((3,)), keras.layers.Dense(10, kernel_regularizer=keras.regularizers.L2(0.1))]
)
regularized.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
history = regularized.fit(features, targets, batch_size=16, epochs=2, verbose=0, shuffle=False)
found["regularized"] = np.concatenate([w.numpy().ravel() for w in regularized.weights])
found["regularized_loss"] = np.array(history.history["loss"])
np.savez(f"{sys.argv[1]}-{os.getpid()}.npz", **found)
