"""A tiny multi-worker TensorFlow job that prints TensorFlow's usual start-up noise.

Used by tests/launch/test_launch_habits.py: ``tfdist launch -n 2`` must show none of it. The
eager ``strategy.run`` produces the eager-overhead line, the generator dataset the
GeneratorDatasetOp line; importing TensorFlow the banner (and cuInit on CPU machines).
"""

import keras
import numpy as np
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()


def rows():
    for i in range(32):
        yield np.full((4,), i % 3, "float32"), np.float32(i % 2)


spec = (tf.TensorSpec((4,), tf.float32), tf.TensorSpec((), tf.float32))
data = tf.data.Dataset.from_generator(rows, output_signature=spec).batch(8).repeat()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
model.fit(data, epochs=2, steps_per_epoch=2, verbose=1)
print("DONE", flush=True)
