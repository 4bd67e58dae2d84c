"""Trains one small convnet with BatchNormalization per variant and prints the results as JSON.

Every variant starts from the same weights and trains 2 epochs on the same seeded numpy
data with the same global batch, in one process (run it with ``TFDIST_CPU_DEVICES=2``):

    one                 one device (TensorFlow: OneDeviceStrategy; JAX: no distribution)
    synced              tfdist.scope(sync_batchnorm=True)
    synced_made_before  the same, its layers made before the scope, built inside (TF)
    explicit            tfdist.scope(), BatchNormalization(synchronized=True)  (TF)
    unsynced            tfdist.scope()
    unsynced_again      tfdist.scope(), a second model, its layers made before  (TF)

The order matters: the warning is given once per process, so the variants that must not
warn run before the first that must.

Printed: {"backend", "replicas": {variant: n}, "weights": {variant: [each weight,
flattened]}, "synchronized": {variant: [each BatchNormalization's flag]}, "warnings":
{variant: [UnsyncedBatchNormWarning messages]}, "debug": [tfdist.batchnorm debug logs]}.
``TFDIST_TEST_FAULT`` (tests/scripts/faults.py: ``nan`` in every variant's weights but
``one``'s, ``one_device``) injects a fault tests/e2e/test_checks_catch_faults.py must see
caught.
"""

import contextlib
import json
import logging
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import faults  # noqa: E402

if faults.active("one_device"):
    os.environ.pop("TFDIST_CPU_DEVICES", None)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tfdist import batchnorm  # noqa: E402

BACKEND = keras.backend.backend()
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 6, 6, 2)).astype("float32")
y = (x.mean(axis=(1, 2)) @ rng.normal(size=(2, 1))).astype("float32")


def make_layers(**bn):
    keras.utils.set_random_seed(0)  # every model starts from the same weights
    return [
        keras.layers.Conv2D(4, 3),
        keras.layers.BatchNormalization(**bn),
        keras.layers.ReLU(),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(8),
        keras.layers.BatchNormalization(**bn),
        keras.layers.ReLU(),
        keras.layers.Dense(1),
    ]


def build(layers):
    model = keras.Sequential([keras.Input((6, 6, 2)), *layers])  # built here, with its input
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    return model


def one_device():
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.distribute.OneDeviceStrategy("/cpu:0").scope()
    return contextlib.nullcontext()


def synced():
    return tfdist.scope(sync_batchnorm=True)


# name: (scope, BatchNormalization's arguments, whether the layers are made before the scope)
VARIANTS = {
    "one": (one_device, {}, False),
    "synced": (synced, {}, False),
    "synced_made_before": (synced, {}, True),
    "explicit": (tfdist.scope, {"synchronized": True}, False),
    "unsynced": (tfdist.scope, {}, False),
    "unsynced_again": (tfdist.scope, {}, True),
}
if BACKEND != "tensorflow":  # synchronized=True is TensorFlow-only in Keras
    VARIANTS = {k: VARIANTS[k] for k in ("one", "synced", "unsynced")}


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


debug = Records()
logging.getLogger(batchnorm.__name__).addHandler(debug)
logging.getLogger(batchnorm.__name__).setLevel(logging.DEBUG)
if BACKEND == "tensorflow":
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()

result = {"backend": BACKEND, "replicas": {}, "weights": {}, "synchronized": {}, "warnings": {}}
for name, (scope, bn, made_before) in VARIANTS.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers = make_layers(**bn) if made_before else None
        with scope():
            model = build(layers or make_layers(**bn))
            # JAX without a distribution trains on one device, whatever tfdist would pick.
            one = BACKEND != "tensorflow" and keras.distribution.distribution() is None
            result["replicas"][name] = 1 if one else tfdist.num_replicas()
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    result["weights"][name] = [w.ravel().tolist() for w in model.get_weights()]
    if faults.active("nan") and name != "one":
        result["weights"][name][0][0] = float("nan")
    result["synchronized"][name] = [
        layer.synchronized
        for layer in model.layers
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    result["warnings"][name] = [
        str(w.message) for w in caught if issubclass(w.category, batchnorm.UnsyncedBatchNormWarning)
    ]
result["debug"] = debug.messages
print(json.dumps(result))
