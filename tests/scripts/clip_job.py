"""Trains one small model per clipping variant and prints their final weights as JSON.

Every variant starts from the same weights and trains 2 epochs on the same seeded data
with the same global batch; run on 1 device, 2 logical devices or 2 workers, the weights
must agree. One process trains them all, under one scope:

    python clip_job.py                                 # tfdist.scope(), every variant
    python clip_job.py --scope mirrored --variants global_clipnorm,clipvalue

``--scope mirrored`` builds ``tf.distribute.MirroredStrategy()`` by hand, as users write.
One scope per process: two MirroredStrategy objects in one process number their
collectives alike and can collide ("Shape mismatch in the collective instance").

Printed: {"applied": fixes applied, "replicas": n, "strategy": class name,
"weights": {variant: every weight, flattened}, "worker": TF_CONFIG index}.
``TFDIST_TEST_FAULT`` (tests/scripts/faults.py: ``nan``, ``one_device``) injects a fault
tests/e2e/test_checks_catch_faults.py must see caught.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import faults  # noqa: E402

if faults.active("one_device"):
    os.environ.pop("TFDIST_CPU_DEVICES", None)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist import compat  # noqa: E402


def optimizers(keras):
    """Variant name -> a function making its optimizer (fresh for every model)."""
    adam = keras.optimizers.Adam
    return {
        "none": lambda: adam(1e-2),
        "global_clipnorm": lambda: adam(1e-2, global_clipnorm=0.5),
        "global_clipnorm_eager": lambda: adam(1e-2, global_clipnorm=0.5),
        "clipnorm": lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.3),
        "clipvalue": lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipvalue=0.05),
        "accumulate": lambda: adam(1e-2, global_clipnorm=0.5, gradient_accumulation_steps=2),
        "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(adam(1e-2, global_clipnorm=0.5)),
        # No ema_overwrite_frequency: its overwrite fails under a strategy upstream, clipped
        # or not (a merge_call inside ops.cond), a failure of its own.
        "decay_ema": lambda: keras.optimizers.AdamW(
            1e-2, weight_decay=0.05, global_clipnorm=0.5, use_ema=True
        ),
    }


parser = argparse.ArgumentParser()
parser.add_argument("--scope", default="tfdist", choices=["tfdist", "mirrored"])
parser.add_argument("--variants", default="all")
parser.add_argument("--global-batch", type=int, default=32)
args = parser.parse_args()

import keras  # noqa: E402

tf.config.experimental.enable_op_determinism()
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
# Large targets: gradients large enough that every limit clips, globally and per replica.
y = (x @ rng.normal(size=(8, 1)) * 3 + rng.normal(size=(256, 1))).astype("float32")
makers = optimizers(keras)
variants = list(makers) if args.variants == "all" else args.variants.split(",")


def train(variant: str) -> list[float]:
    keras.utils.set_random_seed(0)  # every model starts from the same weights
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(makers[variant](), "mse", run_eagerly=variant.endswith("_eager"))
    model.fit(x, y, batch_size=args.global_batch, epochs=2, shuffle=False, verbose=0)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    if faults.active("nan"):
        weights[0] = np.nan
    return weights.tolist()


# As users write it: tfdist's scope, or a MirroredStrategy built by hand (no tfdist call).
scope = tfdist.scope() if args.scope == "tfdist" else tf.distribute.MirroredStrategy().scope()
with scope:
    strategy = tf.distribute.get_strategy()
    result = {"weights": {variant: train(variant) for variant in variants}}
result["replicas"] = strategy.num_replicas_in_sync
result["strategy"] = type(strategy).__name__
result["applied"] = compat.applied()
result["worker"] = tfdist.cluster_from_env().rank
print(json.dumps(result))
