"""Writes a checkpoint with one Keras backend, or reads it with the other.

    KERAS_BACKEND=jax        python cross_backend_job.py save DIR
    KERAS_BACKEND=tensorflow python cross_backend_job.py load DIR [save DIR2 ...]

``save`` trains a small model (Dropout included) and writes ``DIR/model.keras``,
``DIR/model.weights.h5`` and ``DIR/expected.npz`` (weights, optimizer variables, and
predictions on fixed inputs). ``load`` reads both files back through ``tfdist.load``
and prints one JSON line: the largest differences from what was saved. Several
``MODE DIR`` pairs run in order in one process.
"""

import json
import os
import sys

import equivalence
import numpy as np

import tfdist

pairs = list(zip(sys.argv[1::2], sys.argv[2::2], strict=True))

import keras  # noqa: E402

X = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dropout(0.25),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def optimizer_state(model):
    return [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]


def max_diff(a, b):
    return equivalence.max_difference(a, b)


def save(out):
    with tfdist.scope():
        model = build()
    model.fit(X, X.sum(axis=1, keepdims=True), batch_size=4, epochs=2, verbose=0)
    tfdist.save(model, os.path.join(out, "model.keras"))
    tfdist.save(model, os.path.join(out, "model.weights.h5"))
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    arrays.update({f"o{i}": v for i, v in enumerate(optimizer_state(model))})
    np.savez(os.path.join(out, "expected.npz"), predictions=model.predict(X, verbose=0), **arrays)
    print(json.dumps({"saved": keras.backend.backend()}))


def load(out):
    expected = np.load(os.path.join(out, "expected.npz"))
    weights = [expected[f"w{i}"] for i in range(sum(k.startswith("w") for k in expected))]
    slots = [expected[f"o{i}"] for i in range(sum(k.startswith("o") for k in expected))]
    with tfdist.scope():
        whole = tfdist.load(os.path.join(out, "model.keras"), in_scope=True)
        fresh = build()
    tfdist.load(os.path.join(out, "model.weights.h5"), model=fresh)
    print(
        json.dumps(
            {
                "loaded": keras.backend.backend(),
                "keras_weights": max_diff(whole.get_weights(), weights),
                "keras_optimizer": max_diff(optimizer_state(whole), slots),
                "keras_predictions": max_diff(whole.predict(X, verbose=0), expected["predictions"]),
                "h5_weights": max_diff(fresh.get_weights(), weights),
                "h5_optimizer": max_diff(optimizer_state(fresh), slots),
                "steps": int(keras.ops.convert_to_numpy(whole.optimizer.iterations)),
            }
        )
    )


for mode, directory in pairs:
    (save if mode == "save" else load)(directory)
