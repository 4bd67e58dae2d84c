"""Trains a small fixed model on fixed data with tfdist and prints its final weights as JSON.

Run under different strategies (1 device, N logical devices, N workers) with the same
global batch: the printed weights must agree. Used by the equivalence tests.

    python fit_equivalence.py --global-batch 32 --epochs 2
    python fit_equivalence.py --validation --evaluate --predict --accumulate 2

Always printed: replicas, strategy, variable_type, loss (per epoch), weights. With
--validation: val_loss and val_mae (validation data and a metric during fit); with
--evaluate: evaluate ([loss, mae] on held-out data with a partial last batch); with
--predict: predict (outputs on that data, in order); with --accumulate K: a second
model trained with ``SGD(gradient_accumulation_steps=K)``, its accumulated_loss and
accumulated_weights. Also worker (TF_CONFIG task index, 0 without a cluster).

``TFDIST_TEST_FAULT`` (tests/scripts/faults.py: ``nan``, ``outside_distribution``) injects a
fault tests/e2e/test_checks_catch_faults.py must see caught.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import faults  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--global-batch", type=int, default=32)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--examples", type=int, default=256)
parser.add_argument("--validation", action="store_true")
parser.add_argument("--evaluate", action="store_true")
parser.add_argument("--predict", action="store_true")
parser.add_argument("--accumulate", type=int, default=0)
args = parser.parse_args()

import keras  # noqa: E402

keras.utils.set_random_seed(0)
tf.config.experimental.enable_op_determinism()

rng = np.random.default_rng(0)
x = rng.normal(size=(args.examples, 8)).astype("float32")
w_true = rng.normal(size=(8, 1))
y = (x @ w_true + 0.1 * rng.normal(size=(args.examples, 1))).astype("float32")
# Held-out data whose size is not a multiple of the global batch: a partial last batch.
x_val = rng.normal(size=(100, 8)).astype("float32")
y_val = (x_val @ w_true).astype("float32")
metrics = ["mae"] if (args.validation or args.evaluate) else []


def _scope():
    """``tfdist.scope()``; nothing under the ``outside_distribution`` fault."""
    return contextlib.nullcontext() if faults.active("outside_distribution") else tfdist.scope()


def build(accumulate=None):
    # Same seed for every model: the two models start from the same weights.
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=accumulate)
    model.compile(optimizer=optimizer, loss="mse", metrics=metrics)
    return model


with _scope():
    model = build()
    mirrored = type(model.weights[0].value).__name__

history = model.fit(
    x,
    y,
    batch_size=args.global_batch,
    epochs=args.epochs,
    shuffle=False,
    verbose=0,
    validation_data=(x_val, y_val) if args.validation else None,
)
weights = model.get_weights()
if faults.active("nan"):
    weights[0].flat[0] = np.nan
result = {
    "replicas": tfdist.num_replicas(),
    "strategy": type(tfdist.strategy()).__name__,
    "variable_type": mirrored,
    "worker": tfdist.cluster_from_env().rank,
    "loss": history.history["loss"],
    "weights": [w.tolist() for w in weights],
}
if args.validation:
    result["val_loss"] = history.history["val_loss"]
    result["val_mae"] = history.history["val_mae"]
if args.evaluate:
    result["evaluate"] = model.evaluate(x_val, y_val, batch_size=args.global_batch, verbose=0)
if args.predict:
    result["predict"] = model.predict(x_val, batch_size=args.global_batch, verbose=0).tolist()
if args.accumulate:
    with _scope():
        accumulating = build(accumulate=args.accumulate)
    acc_history = accumulating.fit(
        x, y, batch_size=args.global_batch, epochs=args.epochs, shuffle=False, verbose=0
    )
    result["accumulated_loss"] = acc_history.history["loss"]
    result["accumulated_weights"] = [w.tolist() for w in accumulating.get_weights()]
print(json.dumps(result))
