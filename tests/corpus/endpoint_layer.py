"""The endpoint layer pattern: a layer that computes the loss with ``add_loss``.

The shape of Keras's "Endpoint layer pattern" example: the model takes its targets as a
named input, a custom layer computes the loss from the logits and targets and hands it
to ``self.add_loss``, the model compiles with an optimizer and no loss, and ``fit`` gets
a dict of inputs and no labels.
"""

import keras
import numpy as np
from keras import layers


class LogisticEndpoint(layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, logits, targets=None, sample_weight=None):
        if targets is not None:
            self.add_loss(self.loss_fn(targets, logits, sample_weight))
        return keras.ops.sigmoid(logits)


keras.utils.set_random_seed(23)
rng = np.random.default_rng(23)
data = {
    "inputs": rng.random((250, 3)).astype("float32"),
    "targets": rng.integers(0, 2, (250, 10)).astype("float32"),
}

inputs = keras.Input(shape=(3,), name="inputs")
targets = keras.Input(shape=(10,), name="targets")
logits = layers.Dense(10)(inputs)
predictions = LogisticEndpoint(name="predictions")(logits, targets)
model = keras.Model(inputs=[inputs, targets], outputs=predictions)
model.compile(optimizer="adam")
history = model.fit(data, epochs=2, batch_size=32, shuffle=False, verbose=2)

if __name__ == "__main__":
    import record

    record.save(__file__, model, history)
