"""Trains without fit and without a loop tfdist check can count: it says so.

By default the script never calls fit nor draws a batch of a distributed dataset.
``--traced`` runs a loop in the style of TensorFlow's guide that draws each batch inside
its ``tf.function`` (``next(iterator)`` traced once): the check cannot count its steps.
"""

import argparse

import keras
import numpy as np
import tensorflow as tf

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--traced", action="store_true")
args = parser.parse_args()

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
print("predicted", model.predict(np.zeros((2, 4)), verbose=0).shape)
if args.traced:
    strategy = tfdist.strategy()
    data = tf.data.Dataset.from_tensor_slices(np.ones((64, 4), "float32")).batch(8)
    iterator = iter(strategy.experimental_distribute_dataset(data))
    optimizer = keras.optimizers.SGD(0.1)

    @tf.function
    def train_step(iterator):
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        strategy.run(step, args=(next(iterator),))

    for _ in range(8):
        train_step(iterator)
