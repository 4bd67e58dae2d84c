"""Training batches that would leave a replica with no example, one case per line.

Run with ``TFDIST_CPU_DEVICES`` set (2 or 4). Prints ``EMPTY {json}`` with, per case,
``{"error": "...", "iterations": n, "finite": bool}`` or ``{"values": {...}}``, and the
number of replicas. Cases (global batch 16 unless named):

* ``conv numpy last 1`` / ``bn tf.data last 1`` / ``conv tf.data unknown last 1``: a
  Conv2D + MaxPooling2D and a Dense + BatchNormalization model on 33 examples (last batch
  1): refused before the first step when the sizes are known, by the input pipeline at
  that batch otherwise.
* ``dense numpy last 1``: a Dense model takes an empty replica and trains.
* ``conv evaluate/predict last 1``: evaluate and predict on the same 33 examples run, and
  equal the same weights on one device (a model built outside ``tfdist.scope()``).
* ``conv numpy batch 6`` (4 replicas: 2 + 2 + 1 + 1) trains; ``conv numpy batch 3``
  (1 + 1 + 1 + 0) is refused.
"""

from __future__ import annotations

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist

EXAMPLES = 33


def data(examples=EXAMPLES):
    rng = np.random.default_rng(0)
    return rng.random((examples, 6, 6, 1)).astype("float32"), rng.integers(0, 3, examples)


def build(kind: str, distributed: bool = True):
    scope = tfdist.scope() if distributed else tf.distribute.get_strategy().scope()
    with scope:
        if kind == "conv":  # the tutorials' layers
            layers = [
                keras.layers.Conv2D(4, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
            ]
        elif kind == "bn":
            layers = [
                keras.layers.Flatten(),
                keras.layers.Dense(8),
                keras.layers.BatchNormalization(),
            ]
        else:
            layers = [keras.layers.Flatten(), keras.layers.Dense(8, activation="tanh")]
        model = keras.Sequential([keras.Input((6, 6, 1)), *layers, keras.layers.Dense(3)])
        rng = np.random.default_rng(42)
        model.set_weights(
            [rng.normal(scale=0.3, size=w.shape).astype(w.dtype) for w in model.get_weights()]
        )
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model


def weights(model) -> list:
    return np.concatenate([w.ravel() for w in model.get_weights()]).astype(float).tolist()


def refused(model, *args, **kwargs) -> dict:
    """The error ``model.fit(*args, **kwargs)`` raised, the steps taken before it, and
    whether the weights stayed finite; or the weights when it trained."""
    try:
        model.fit(*args, epochs=1, verbose=0, shuffle=False, **kwargs)
    except Exception as error:  # the result under test
        return {
            "error": f"{type(error).__name__}: {str(error)[:2000]}",
            "iterations": int(model.optimizer.iterations.numpy()),
            "finite": bool(np.isfinite(weights(model)).all()),
        }
    return {
        "values": {"weights": weights(model)},
        "finite": bool(np.isfinite(weights(model)).all()),
    }


def main(cases: list[str]) -> None:
    x, y = data()
    out = {}
    for name in cases:
        kind = name.split()[0]
        model = build(kind)
        if name in ("conv numpy last 1", "dense numpy last 1", "bn numpy last 1"):
            out[name] = refused(model, x, y, batch_size=16)
        elif name == "bn tf.data last 1":
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(lambda a, b: (a, b))
            out[name] = refused(model, ds.prefetch(1))
        elif name == "conv tf.data unknown last 1":
            ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(16)
            out[name] = refused(model, ds)
        elif name.startswith("conv numpy batch "):
            size = int(name.split()[-1])
            out[name] = refused(model, x[:18], y[:18], batch_size=size)
        elif name == "conv evaluate/predict last 1":
            single = build(kind, distributed=False)
            out[name] = {
                "values": {
                    "evaluate": [model.evaluate(x, y, batch_size=16, verbose=0)],
                    "predict": model.predict(x, batch_size=16, verbose=0).ravel().tolist(),
                },
                "one device": {
                    "evaluate": [single.evaluate(x, y, batch_size=16, verbose=0)],
                    "predict": single.predict(x, batch_size=16, verbose=0).ravel().tolist(),
                },
            }
        else:
            raise ValueError(f"unknown case {name!r}")
    replicas = tfdist.num_replicas()
    line = "EMPTY " + json.dumps({"replicas": replicas, "cases": out}) + "\n"
    os.write(1, line.encode())


if __name__ == "__main__":
    main(sys.argv[1:])
