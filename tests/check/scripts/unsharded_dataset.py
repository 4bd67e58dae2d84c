"""A tf.data input with auto-sharding turned off: every worker reads the whole dataset.

2 devices train the one-device model (one process, one dataset); 2 workers do not, each
reading every example instead of its share. ``--policy auto`` leaves the policy to
TensorFlow (the twin: equal on 2 workers).
"""

import argparse

import keras
import numpy as np
import tensorflow as tf

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--policy", choices=("off", "auto"), default="off")
args = parser.parse_args()

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)  # the global batch
if args.policy == "off":
    options = tf.data.Options()
    policy = tf.data.experimental.AutoShardPolicy.OFF  # the mistake
    options.experimental_distribute.auto_shard_policy = policy
    dataset = dataset.with_options(options)

with tfdist.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse")

model.fit(dataset, epochs=2, verbose=0)
