"""Predictions and evaluations on batches with fewer examples than replicas, as users write
them: one image, a last batch of one, a batch of 3 on 4 replicas, a dict-input model.

No tfdist, no strategy: under ``python -m tfdist.bootstrap`` or ``tfdist launch`` the
models train on the job's replicas (``TFDIST_UNSCOPED_MODELS=job``). The weights are set
from a seed, not trained, so that every topology holds the same model; BatchNormalization's
moving statistics too. Each call's result (or its error) is saved to ``OUT-<rank>.npz``.

    python small_batches_job.py OUT
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

out = sys.argv[1]
rng = np.random.RandomState(0)


def seeded(model):
    """Every weight from the seed (BatchNormalization's moving variance kept positive)."""
    model.set_weights(
        [
            np.abs(rng.normal(1.0, 0.3, w.shape)).astype(w.dtype)
            if "variance" in v.path
            else rng.normal(0.0, 0.3, w.shape).astype(w.dtype)
            for v, w in zip(model.weights, model.get_weights(), strict=True)
        ]
    )
    return model


inputs = keras.Input((12, 12, 3))
h = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
h = keras.layers.BatchNormalization()(h)
h = keras.layers.MaxPooling2D()(h)
h = keras.layers.Flatten()(h)
conv = seeded(keras.Model(inputs, keras.layers.Dense(10)(h)))
conv.compile(
    "adam",
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)

# The shape of Keras's time-series anomaly-detection autoencoder.
autoencoder = seeded(
    keras.Sequential(
        [
            keras.Input((20, 4)),
            keras.layers.Conv1D(32, 7, padding="same", strides=2, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Conv1D(16, 7, padding="same", strides=2, activation="relu"),
            keras.layers.Conv1DTranspose(16, 7, padding="same", strides=2, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Conv1DTranspose(32, 7, padding="same", strides=2, activation="relu"),
            keras.layers.Conv1DTranspose(4, 7, padding="same"),
        ]
    )
)
autoencoder.compile("adam", "mse")

a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
named = seeded(
    keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
)
named.compile("sgd", "mse", metrics=["mae"])

images = rng.rand(17, 12, 12, 3).astype("float32")
labels = rng.randint(0, 10, 17)
weights = rng.rand(17).astype("float32")
series = rng.rand(17, 20, 4).astype("float32")
tables = {"a": rng.rand(17, 3).astype("float32"), "b": rng.rand(17, 2).astype("float32")}
targets = rng.rand(17, 1).astype("float32")

CASES = {
    "conv predict one image": lambda: conv.predict(images[:1], verbose=0),
    "conv predict last batch of one": lambda: conv.predict(images, batch_size=16, verbose=0),
    "conv predict 3 at batch 3": lambda: conv.predict(images[:3], batch_size=3, verbose=0),
    "conv predict_on_batch one image": lambda: conv.predict_on_batch(images[:1]),
    "conv evaluate one image": lambda: conv.evaluate(images[:1], labels[:1], verbose=0),
    "conv evaluate last batch of one, weighted": lambda: conv.evaluate(
        images, labels, sample_weight=weights, batch_size=16, verbose=0
    ),
    "conv evaluate tf.data last batch of one": lambda: conv.evaluate(
        tf.data.Dataset.from_tensor_slices((images, labels)).batch(16), verbose=0
    ),
    "conv test_on_batch one image": lambda: conv.test_on_batch(images[:1], labels[:1]),
    "conv1d predict last batch of one": lambda: autoencoder.predict(
        series, batch_size=16, verbose=0
    ),
    "conv1d evaluate last batch of one": lambda: autoencoder.evaluate(
        series, series, batch_size=16, verbose=0
    ),
    "named predict one example": lambda: named.predict(
        {k: v[:1] for k, v in tables.items()}, verbose=0
    ),
    "named evaluate last batch of one": lambda: named.evaluate(
        tables, targets, batch_size=16, verbose=0
    ),
}

results, errors = {}, {}
for name, call in CASES.items():
    try:
        results[name] = np.asarray(call(), dtype="float64")
    except Exception as err:  # noqa: BLE001 - each call's error is a result
        errors[name] = f"{type(err).__name__}: {err}"  # whole: the cause may come last

rank = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
if keras.backend.backend() == "jax":
    import jax

    rank = jax.process_index()
    replicas = len(conv.weights[0].value.sharding.device_set)
else:
    replicas = conv.distribute_strategy.num_replicas_in_sync
np.savez(
    f"{out}-{rank}.npz",
    replicas=replicas,
    errors=json.dumps(errors),
    **{f"case {name}": value for name, value in results.items()},
)
