"""A custom loop whose state is plain tf.Variables (no Keras model), as a user may write it.

Its loss is averaged over each replica's own batch and the replicas' gradients summed, so
2 devices do not train what 1 device trains. ``tfdist check`` finds no Keras model or
optimizer to compare, and must say so (exit 2), never call it equal.
"""

import keras  # noqa: F401 - imported, as scripts do; the state below is not Keras's
import numpy as np
import tensorflow as tf

strategy = tf.distribute.MirroredStrategy()
with strategy.scope():
    w = tf.Variable(np.zeros((4, 1), np.float32), name="w")
x = np.random.default_rng(0).random((256, 4), dtype=np.float32)
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
data = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
)


@tf.function
def step(batch):
    def replica_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((features @ w - labels) ** 2)  # this replica's own mean
        gradient = tape.gradient(loss, w)
        total = tf.distribute.get_replica_context().all_reduce("SUM", gradient)
        w.assign_sub(0.1 * total)

    strategy.run(replica_step, args=(batch,))


for batch in data:
    step(batch)
print("w", w.numpy().ravel())
