"""``compile(jit_compile=True)`` in ``tfdist.scope()``: what predict, evaluate and fit do.

    TFDIST_CPU_DEVICES=2 python jit_compile_job.py
    tfdist launch -n 2 jit_compile_job.py

Prints on the chief ``JIT {"replicas": N, "workers": W, "predict": "ok" | "Type: message",
"evaluate": ..., "fit": ..., "predictions": [...]}``: ``predictions`` are predict's outputs,
flattened (predict runs first, on the initial weights, set by a seed). ``TFDIST_TEST_FAULT``
(tests/scripts/faults.py: ``nan``, a NaN in the predictions, and ``one_device``) injects a
fault tests/e2e/test_checks_catch_faults.py must see caught.
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

import tfdist  # noqa: E402

x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
keras.utils.set_random_seed(0)  # the same initial weights on every topology
with tfdist.scope():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile("sgd", "mse", jit_compile=True)
out = {"replicas": tfdist.num_replicas(), "workers": tfdist.num_workers()}


def predict():
    predictions = model.predict(x, batch_size=16, verbose=0).ravel()
    if faults.active("nan"):
        predictions[0] = np.nan
    out["predictions"] = predictions.tolist()


calls = {
    "predict": predict,
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
