"""A script that builds its own ``tf.distribute.MultiWorkerMirroredStrategy()``, as the
official multi-worker tutorial does: it reads only ``TF_CONFIG`` and never imports tfdist.

tests/e2e/test_slurm.py runs it with the per-node recipe of docs/slurm.md
(``srun --ntasks-per-node=1 ... tfdist launch -n 2 ...``), and alone with ``python`` as the
one-worker reference: the same global batch, so the same final weights. Prints one JSON line.
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 16

strategy = tf.distribute.MultiWorkerMirroredStrategy()
tf.config.experimental.enable_op_determinism()
keras.utils.set_random_seed(0)

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(256, 1))).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

with strategy.scope():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
model.fit(dataset, epochs=2, verbose=0)

task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {})
print(
    json.dumps(
        {
            "task": task.get("index", 0),
            "replicas": strategy.num_replicas_in_sync,
            "weights": [w.tolist() for w in model.get_weights()],
        }
    ),
    flush=True,
)
