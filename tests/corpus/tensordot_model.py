"""A subclassed model whose ``call`` mixes the whole batch with ``ops.tensordot``.

The shape of models that relate examples of a batch to each other (a batch's Gram matrix,
in-batch attention): a Dense embedding, then ``ops.tensordot`` over the batch axis gives
a features-by-features matrix of the whole batch that reweights each example. On N
replicas each sees its part of the batch only: a batch-wide sum by construction.
"""

import keras
import numpy as np
from keras import layers, ops


class BatchMixer(keras.Model):
    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(units, activation="tanh")
        self.head = layers.Dense(1)

    def call(self, inputs):
        h = self.embed(inputs)
        batch = ops.cast(ops.shape(h)[0], h.dtype)
        gram = ops.tensordot(h, h, axes=[[0], [0]]) / batch
        return self.head(ops.matmul(h, gram))


keras.utils.set_random_seed(29)
rng = np.random.default_rng(29)
x = rng.normal(size=(250, 6)).astype("float32")
y = (x[:, :1] * 2 - x[:, 1:2]).astype("float32")

model = BatchMixer()
model.compile(optimizer="adam", loss="mse")
history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=2)

if __name__ == "__main__":
    import record

    record.save(__file__, model, history)
