"""Multi-worker probe for tests/compat/test_compat.py: the upstream failures, then the fixes.

Run as ``tfdist launch -n 2 --no-fixes mw_compat_probe.py`` (optionally with
``--devices-per-worker 2``): nothing is patched when it starts. It builds
``tf.distribute.MultiWorkerMirroredStrategy()`` itself (as the official tutorial does),
then, on every worker:

1. ``fit`` with no fix: records the upstream error (PerReplica conversion);
2. with only ``keras_tf_symbolic_build_from_spec``: records the next upstream error
   (invalid reduction dimension);
3. with the two fit fixes but not ``keras_tf_progbar_chief_only``: ``fit(verbose=2)``
   between the markers ``STAGE progbar-unfixed`` / ``STAGE progbar-fixed`` prints an
   epoch line on every worker; nor ``keras_tf_compile_in_model_scope``: a model compiled
   again outside the scope (a plain-function loss, ``optimizer="sgd"``) reports each
   worker's own loss;
4. with every fix: ``fit`` with validation data and a metric, ``evaluate``,
   ``predict``, ``fit`` of an ``SGD(gradient_accumulation_steps=2)`` model, and the
   second compile outside the scope, each compared with the same model trained in this
   process without a strategy (one device, same global batch).

Prints one JSON line: worker, replicas, errors, and the largest differences from the
one-device reference.
"""

import json
import os
import sys

import equivalence
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.backends import tensorflow as tf_backend
from tfdist.core import cluster, config

wanted = config.cpu_devices()
if wanted:
    tf_backend.configure_cpu_devices(wanted)  # logical CPUs exist; upstream ignores them
mwms = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402

tf.config.experimental.enable_op_determinism()
GLOBAL_BATCH = 32
rng = np.random.default_rng(0)
x = rng.normal(size=(128, 8)).astype("float32")
w_true = rng.normal(size=(8, 1))
y = (x @ w_true).astype("float32")
x_val = rng.normal(size=(40, 8)).astype("float32")
y_val = (x_val @ w_true).astype("float32")


def build(accumulate=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=accumulate),
        loss="mse",
        metrics=["mae"],
    )
    return model


def train(model, verbose=0, **kwargs):
    return model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=verbose, **kwargs
    )


def in_scope(accumulate=None):
    with mwms.scope():
        return build(accumulate)


def squared_error(y_true, y_pred):
    """A plain-function loss, as a user writes one."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def recompiled(model):
    """Compiled again outside any scope (the transfer-learning layout), then fit."""
    model.compile(optimizer="sgd", loss=squared_error, metrics=["mae"])
    history = train(model).history
    return {"history": history, "weights": [w.tolist() for w in model.get_weights()]}


def failure(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        text = f"{type(err).__name__}: {err}"
        return text if len(text) < 1200 else f"{text[:600]} ... {text[-600:]}"
    return None


def max_diff(a, b):
    """Raveled (evaluate's scalars and lists), through the one comparison."""
    return equivalence.max_difference(*(np.ravel(np.asarray(v, dtype=float)) for v in (a, b)))


errors = {"unfixed": failure(lambda: train(in_scope()))}
compat.apply_all(
    exclude=[n for n in compat.fix_names() if n != "keras_tf_symbolic_build_from_spec"]
)
errors["symbolic_build_fixed"] = failure(lambda: train(in_scope()))

compat.apply_all(exclude=["keras_tf_progbar_chief_only", "keras_tf_compile_in_model_scope"])
print("STAGE progbar-unfixed", flush=True)
train(in_scope(), verbose=2)
sys.stdout.flush()
recompiled_unfixed = recompiled(in_scope())
compat.apply_all(exclude=[])
print("STAGE progbar-fixed", flush=True)
model = in_scope()
history = train(model, verbose=2, validation_data=(x_val, y_val))
print("STAGE done", flush=True)
evaluated = model.evaluate(x_val, y_val, batch_size=GLOBAL_BATCH, verbose=0)
predicted = model.predict(x_val, batch_size=GLOBAL_BATCH, verbose=0)
accumulating = in_scope(accumulate=2)
train(accumulating)
recompiled_fixed = recompiled(in_scope())

reference = build()  # no strategy scope: one device, the same global batch
ref_history = train(reference, validation_data=(x_val, y_val))
ref_accumulating = build(accumulate=2)
train(ref_accumulating)
ref_recompiled = recompiled(build())
diffs = {
    "weights": equivalence.max_difference(reference.get_weights(), model.get_weights()),
    "history": equivalence.max_difference(ref_history, history),
    "evaluate": max_diff(evaluated, reference.evaluate(x_val, y_val, batch_size=32, verbose=0)),
    "predict": max_diff(predicted, reference.predict(x_val, batch_size=32, verbose=0)),
    "accumulated_weights": equivalence.max_difference(
        ref_accumulating.get_weights(), accumulating.get_weights()
    ),
    "recompiled": equivalence.max_difference(ref_recompiled, recompiled_fixed),
}
print(
    json.dumps(
        {
            "worker": cluster.cluster_from_env().rank,
            "replicas": mwms.num_replicas_in_sync,
            "applied": compat.applied(),
            "errors": errors,
            "diffs": diffs,
            "recompiled": {
                "unfixed": recompiled_unfixed,
                "reference": ref_recompiled,
            },
            "trained": max_diff(reference.get_weights()[0], build().get_weights()[0]),
            "pid": os.getpid(),
        }
    ),
    flush=True,
)
