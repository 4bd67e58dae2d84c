"""A custom loop in TensorFlow's tf.distribute guide's style whose optimizer builds itself
on its first ``apply_gradients`` inside ``strategy.run``, and the ways users vary it.

    python optimizer_build_job.py [CASE ...]            # 1 device (every case by default)
    TFDIST_CPU_DEVICES=4 python optimizer_build_job.py  # 4 devices
    tfdist launch -n 2 optimizer_build_job.py           # 2 workers

Each case builds a fresh model (Conv2D, MaxPooling2D, Dense; the same initial weights)
and optimizer in ``tfdist.strategy().scope()`` and trains 2 epochs of 54 examples at a
global batch of 16 (a last batch of 6): Adam and SGD with momentum left to build
themselves in the traced step, Adam built first (upstream's working path), Adam whose
loss object is called in a ``tf.cond``, and Adam stepped eagerly (no ``tf.function``).
Prints on the chief ``OPTBUILD {"replicas": N, "workers": W, "cases": {case: weights
as lists | "Type: message"}}``. ``TFDIST_TEST_FAULT`` (tests/scripts/faults.py: ``nan``,
``one_device``) injects a fault tests/e2e/test_checks_catch_faults.py must see caught.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import faults  # noqa: E402

if faults.active("one_device"):
    os.environ.pop("TFDIST_CPU_DEVICES", None)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402

GLOBAL_BATCH = 16
rng = np.random.default_rng(0)
x = rng.normal(size=(54, 6, 6, 1)).astype("float32")
y = rng.integers(0, 3, size=(54,)).astype("int32")
strategy = tfdist.strategy()


def build_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )


def train(optimizer_name: str, *, build_first=False, in_cond=False, eager=False):
    with strategy.scope():
        model = build_model()
        if optimizer_name == "adam":
            optimizer = keras.optimizers.Adam(0.01)
        else:
            optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        if build_first:
            optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    data = data.with_options(_data_sharding())

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            if in_cond:  # the loss object called in a tf.cond (both branches the same here)
                per_example = tf.cond(
                    tf.size(yb) >= 0, lambda: loss_fn(yb, logits), lambda: loss_fn(yb, logits)
                )
            else:
                per_example = loss_fn(yb, logits)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    def step(batch):
        return strategy.run(replica_step, args=batch)

    step = step if eager else tf.function(step)
    for _ in range(2):
        for batch in strategy.experimental_distribute_dataset(data):
            step(batch)
    weights = [np.array(w.numpy()) for w in model.weights]
    if faults.active("nan"):
        weights[0].flat[0] = np.nan
    return [w.tolist() for w in weights]


def _data_sharding():
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return options


CASES = {
    "adam builds itself": lambda: train("adam"),
    "sgd momentum builds itself": lambda: train("sgd"),
    "adam built first": lambda: train("adam", build_first=True),
    "adam, loss in tf.cond": lambda: train("adam", in_cond=True),
    "adam eager": lambda: train("adam", eager=True),
}
out: dict = {"replicas": strategy.num_replicas_in_sync, "workers": tfdist.num_workers()}
cases: dict = {}
for name in sys.argv[1:] or CASES:
    try:
        cases[name] = CASES[name]()
    except Exception as error:  # the result is what the case raised
        # TensorFlow puts the op's stack first and its message last: keep both ends (the
        # stack's length depends on where the checkout lies).
        text = str(error)
        text = text if len(text) <= 4000 else f"{text[:1000]} [...] {text[-3000:]}"
        cases[name] = f"{type(error).__name__}: {text}"
out["cases"] = cases
if tfdist.is_chief():
    print("OPTBUILD " + json.dumps(out), flush=True)
