"""``compile(jit_compile=True)`` in ``tfdist.scope()``: what predict, evaluate and fit do.

    TFDIST_CPU_DEVICES=2 python jit_compile_job.py
    tfdist launch -n 2 jit_compile_job.py

Prints on the chief ``JIT {"replicas": N, "predict": "ok" | "Type: message", ...}``.
"""

from __future__ import annotations

import json

import keras
import numpy as np

import tfdist

x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
with tfdist.scope():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile("sgd", "mse", jit_compile=True)
out = {"replicas": tfdist.num_replicas(), "workers": tfdist.num_workers()}
calls = {
    "predict": lambda: model.predict(x, batch_size=16, verbose=0),
    "evaluate": lambda: model.evaluate(x, y, batch_size=16, verbose=0),
    "fit": lambda: model.fit(x, y, batch_size=16, epochs=1, verbose=0),
}
for name, call in calls.items():
    try:
        call()
        out[name] = "ok"
    except Exception as error:  # the result is what each call raised
        out[name] = f"{type(error).__name__}: {error}"
if tfdist.is_chief():
    print("JIT " + json.dumps(out), flush=True)
