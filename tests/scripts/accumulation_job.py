"""Gradient accumulation (k=4) under tfdist.scope(): weights and all-reduces per window.

    python accumulation_job.py                      # 1 device (the reference)
    TFDIST_CPU_DEVICES=2 python accumulation_job.py # MirroredStrategy, 2 logical devices
    python -m tfdist launch -n 2 accumulation_job.py

Trains every variant (SGD with momentum; AdamW with weight decay and ``global_clipnorm``;
SGD with ``clipnorm``; SGD without accumulation), each from the same seed, over 4
accumulation windows, and prints one JSON line: ``weights`` per variant,
``reduces_per_window`` per variant (the gradient
all-reduces that ran, counted at run time: each call of the strategy's
``extended.batch_reduce_to`` on the gradients adds 1 to a counter variable when it runs,
so a call inside a ``tf.cond`` branch counts only when the branch runs), ``replicas``,
and ``mid_window``: a model saved after 6 micro-steps (2 into a window), loaded and
trained on (its saved accumulators, its weights, and the same epoch run straight).
``TFDIST_TEST_FAULT`` (tests/scripts/faults.py: ``nan``, ``one_device``) injects a fault
tests/e2e/test_checks_catch_faults.py must see caught.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import faults  # noqa: E402

if faults.active("one_device"):
    os.environ.pop("TFDIST_CPU_DEVICES", None)

import numpy as np  # noqa: E402

import tfdist  # noqa: E402

K = 4
GLOBAL_BATCH = 32
EXAMPLES = GLOBAL_BATCH * K * 2  # 2 windows per epoch
EPOCHS = 2

strategy = tfdist.strategy()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.experimental.enable_op_determinism()
rng = np.random.default_rng(0)
x = rng.normal(size=(EXAMPLES, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) * 3 + rng.normal(size=(EXAMPLES, 1))).astype("float32")

VARIANTS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=K),
    "adamw_decay_global_clipnorm": lambda: keras.optimizers.AdamW(
        1e-2, weight_decay=0.05, global_clipnorm=0.5, gradient_accumulation_steps=K
    ),
    "sgd_clipnorm": lambda: keras.optimizers.SGD(0.05, clipnorm=0.3, gradient_accumulation_steps=K),
    # No accumulation: a window's K steps all-reduce K times (checks the counter).
    "sgd_momentum_plain": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}

# Run-time count of the gradient all-reduces (a plain variable: outside the strategy scope).
counter = tf.Variable(0, dtype=tf.int64, trainable=False)
n_grads = {"value": None}
extended = strategy.extended
reduce_to = extended.batch_reduce_to


def counting_batch_reduce_to(reduce_op, value_destination_pairs, options=None):
    if len(value_destination_pairs) == n_grads["value"]:  # the gradients, not a metric
        counter.assign_add(1)
    return reduce_to(reduce_op, value_destination_pairs, options)


if strategy.num_replicas_in_sync > 1:
    extended.batch_reduce_to = counting_batch_reduce_to


def train(make_optimizer):
    model = build(make_optimizer)
    n_grads["value"] = len(model.trainable_variables)
    counter.assign(0)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    windows = EPOCHS * EXAMPLES // GLOBAL_BATCH // K
    weights = model.get_weights()
    if faults.active("nan"):
        weights[0].flat[0] = np.nan
    return [w.tolist() for w in weights], int(counter.numpy()) / windows


def build(make_optimizer):
    keras.utils.set_random_seed(0)
    with tfdist.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=make_optimizer(), loss="mse")
    return model


def resume_mid_window(make_optimizer, directory):
    """One epoch (2 windows) as 6 micro-steps, a save mid-window (2 of 4 accumulated),
    a load into a new model, then the last 2 micro-steps."""
    model = build(make_optimizer)
    split = 6 * GLOBAL_BATCH
    model.fit(x[:split], y[:split], batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    # Every worker saves (each to its own file here), as Keras callbacks do under tfdist.
    path = os.path.join(directory, f"mid-window-{tfdist.worker_index()}.keras")
    model.save(path)
    with tfdist.scope():
        loaded = keras.models.load_model(path)
    saved = [np.asarray(a).tolist() for a in loaded.optimizer._accumulated_gradients]
    loaded.fit(x[split:], y[split:], batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    straight = build(make_optimizer)
    straight.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    return {
        "saved_accumulators": saved,
        "resumed": [w.tolist() for w in loaded.get_weights()],
        "straight": [w.tolist() for w in straight.get_weights()],
    }


result = {"replicas": strategy.num_replicas_in_sync, "weights": {}, "reduces_per_window": {}}
for name, make in VARIANTS.items():
    result["weights"][name], result["reduces_per_window"][name] = train(make)
result["mid_window"] = {}
with tempfile.TemporaryDirectory() as scratch:
    for name in ("sgd_momentum", "adamw_decay_global_clipnorm"):
        result["mid_window"][name] = resume_mid_window(VARIANTS[name], scratch)
if tfdist.is_chief():
    print(json.dumps(result), flush=True)
