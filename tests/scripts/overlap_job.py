"""Trains the MLP of mw_bench_job.py with or without tfdist.compat.overlap; prints one JSON line.

    python overlap_job.py [--enable] [--steps 20]

Worker 0 prints ``collectives`` (CollectiveReduceV2 ops in a traced replica step that calls
``optimizer.apply_gradients``), ``enabled`` and the final ``weights`` after ``--steps``
steps of ``model.fit`` (global batch 64, SGD, seed 0), for the equivalence tests.
"""

import argparse
import json

import numpy as np

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--enable", action="store_true")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

strategy = tfdist.strategy()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdist.compat import overlap  # noqa: E402

enabled = overlap.enable() if args.enable else False
GLOBAL_BATCH = 64


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


with strategy.scope():
    model = build()
    probe = build()  # traced only: its graph shows how many collectives a step issues


@tf.function
def probe_step():
    def replica(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, probe(x), from_logits=True)
            )
        grads = tape.gradient(loss, probe.trainable_variables)
        probe.optimizer.apply_gradients(zip(grads, probe.trainable_variables, strict=True))

    return strategy.run(replica, (tf.zeros((8, 784)), tf.zeros((8,), tf.int32)))


graph = probe_step.get_concrete_function().graph
collectives = sum(op.type == "CollectiveReduceV2" for op in graph.get_operations())

rng = np.random.default_rng(0)
x = rng.random((GLOBAL_BATCH * 4, 784), dtype=np.float32)
y = rng.integers(0, 10, size=(GLOBAL_BATCH * 4,))
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH).with_options(options)
model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
if tfdist.is_chief():
    report = {
        "replicas": strategy.num_replicas_in_sync,
        "enabled": enabled,
        "collectives": collectives,
        "weights": [w.tolist() for w in model.get_weights()],
    }
    print(json.dumps(report), flush=True)
