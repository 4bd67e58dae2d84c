"""Every non-tf.data input kind into fit/evaluate/predict on JAX, one JSON line per kind.

Run with ``KERAS_BACKEND=jax`` on one device (``python jax_inputs_job.py``), on
``TFDIST_CPU_DEVICES=4`` or as ``tfdist launch -n 2 --devices-per-worker 2`` (see
tests/compat/test_jax_inputs.py): every kind trains a fresh model (the same seed) under
``tfdist.scope()`` and prints its losses and final weights, or its metrics, or its
predictions. Batches of 16 over 72 examples end with a partial batch of 8, which divides
between 4 replicas; ``uneven`` (72 - 2 examples, several processes only) does not.
``python jax_inputs_job.py upstream`` prints what upstream says to numpy ``fit`` and to
``predict`` on a ``tf.data.Dataset`` (run with the fixes excluded);
``python jax_inputs_job.py KIND...`` runs the kinds named only. Each kind's line says what
its model ran on (``trained_on``, tests/scripts/trained_on.py). ``TFDIST_TEST_FAULT``
(tests/scripts/faults.py: ``nan``, ``outside_distribution``) injects a fault
tests/e2e/test_checks_catch_faults.py must see caught.
"""

import contextlib
import json
import random
import sys
from pathlib import Path

import jax
import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist import compat
from tfdist.compat.inputs import jax as jax_inputs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import faults  # noqa: E402
import trained_on  # noqa: E402

BATCH = 16
rng = np.random.RandomState(0)
X = rng.rand(96, 6).astype("float32")
Y = (X.sum(axis=1) * 3 / 6).astype("int64") % 3
W = rng.rand(96).astype("float32") + 0.5
x, y, w = X[:72], Y[:72], W[:72]


def build():
    keras.utils.set_random_seed(0)
    with contextlib.nullcontext() if faults.active("outside_distribution") else tfdist.scope():
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
        )
        model.compile(
            keras.optimizers.SGD(0.1),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


class Batches(keras.utils.PyDataset):
    """The batches of 16 of ``x, y`` (the last one 8)."""

    def __init__(self, with_targets=True):
        super().__init__()
        self.with_targets = with_targets

    def __len__(self):
        return -(-len(x) // BATCH)

    def __getitem__(self, index):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return (x[rows], y[rows]) if self.with_targets else (x[rows],)


def batches(with_targets=True, forever=False):
    while True:
        for index in range(len(Batches())):
            rows = slice(index * BATCH, (index + 1) * BATCH)
            yield (x[rows], y[rows]) if with_targets else (x[rows],)
        if not forever:
            return


FITS = {
    "numpy": lambda m: m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0),
    "numpy_shuffled": lambda m: m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=True, verbose=0),
    "sample_weight": lambda m: m.fit(
        x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False, verbose=0
    ),
    "class_weight": lambda m: m.fit(
        x, y, class_weight={0: 1.0, 1: 2.0, 2: 0.5}, batch_size=BATCH, epochs=2, verbose=0
    ),
    "validation_data": lambda m: m.fit(
        x, y, validation_data=(X[72:], Y[72:]), batch_size=BATCH, epochs=2, verbose=0
    ),
    # 80 examples: 60 to train (last batch 12) and 20 to validate (last batch 4).
    "validation_split": lambda m: m.fit(
        X[:80], Y[:80], validation_split=0.25, batch_size=BATCH, epochs=2, verbose=0
    ),
    "pydataset": lambda m: m.fit(Batches(), epochs=2, shuffle=False, verbose=0),
    "pydataset_shuffled": lambda m: m.fit(Batches(), epochs=2, shuffle=True, verbose=0),
    "generator": lambda m: m.fit(batches(forever=True), steps_per_epoch=5, epochs=2, verbose=0),
}
EVALUATES = {
    "evaluate_numpy": lambda m: m.evaluate(x, y, batch_size=BATCH, verbose=0),
    "evaluate_pydataset": lambda m: m.evaluate(Batches(), verbose=0),
    "evaluate_generator": lambda m: m.evaluate(batches(), verbose=0),
}
PREDICTS = {
    "predict_numpy": lambda m: m.predict(x, batch_size=BATCH, verbose=0),
    "predict_pydataset": lambda m: m.predict(Batches(with_targets=False), verbose=0),
    "predict_generator": lambda m: m.predict(batches(with_targets=False), verbose=0),
    # tf.data: no partial batch (Keras's own sharding cannot split one between processes).
    "predict_tf": lambda m: m.predict(
        tf.data.Dataset.from_tensor_slices(x[:64]).batch(BATCH), verbose=0
    ),
}


def emit(kind, **result):
    print(json.dumps({"kind": kind, "process": tfdist.worker_index(), **result}), flush=True)


def error(call):
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return None


def weights(model) -> list:
    """The model's weights as lists, the first one NaN under the ``nan`` fault."""
    values = [v.tolist() for v in model.get_weights()]
    if faults.active("nan"):
        values[0][0][0] = float("nan")
    return values


def chosen(kinds: dict, args: list[str]) -> dict:
    """The ``kinds`` named in ``args``, or all of them when none is."""
    return {kind: run for kind, run in kinds.items() if not args or kind in args}


def main(args):
    if args == ["upstream"]:
        model = build()
        emit(
            "upstream",
            fit_numpy=error(lambda: model.fit(x, y, batch_size=BATCH, verbose=0)),
            predict_tf=error(lambda: PREDICTS["predict_tf"](model)),
        )
        return
    with tfdist.scope() as distribution:
        share = jax_inputs._share_of(distribution)
    fixes = [jax_inputs.KERAS_JAX_MULTI_PROCESS_INPUTS, jax_inputs.KERAS_JAX_MULTI_PROCESS_PREDICT]
    emit(
        "setup",
        applied=[name for name in compat.applied() if name in fixes],
        share=None if share is None else [share.index, share.parts, share.replicas],
        # what it runs on: data-parallel replicas, processes, devices (every process's)
        replicas=tfdist.num_replicas(),
        processes=jax.process_count(),
        devices=jax.device_count(),
    )
    trained_on.install()
    model = build()
    initial = model.get_weights()
    for kind, fit in chosen(FITS, args).items():
        # One model for every kind (compiled once): its first weights back, and the seed
        # every kind's shuffles start from. SGD without momentum keeps no other state.
        model.set_weights(initial)
        keras.utils.set_random_seed(1)
        if kind.endswith("_shuffled"):
            # Each process seeds differently: its shuffles must still follow process 0's.
            np.random.seed(100 + tfdist.worker_index())
            random.seed(100 + tfdist.worker_index())
        trained_on.NOTED.clear()
        history = fit(model)
        emit(kind, history=history.history, weights=weights(model), trained_on=trained_on.NOTED)
    model.set_weights(initial)
    for kind, evaluate in chosen(EVALUATES, args).items():
        trained_on.NOTED.clear()
        metrics = [float(v) for v in evaluate(model)]
        emit(kind, metrics=metrics, trained_on=trained_on.NOTED)
    for kind, predict in chosen(PREDICTS, args).items():
        trained_on.NOTED.clear()
        predictions = np.asarray(predict(model)).tolist()
        emit(kind, predictions=predictions, trained_on=trained_on.NOTED)
    if tfdist.num_workers() > 1 and not args:
        uneven = error(lambda: model.fit(x[:70], y[:70], batch_size=BATCH, verbose=0))
        emit("uneven", error=uneven)


if __name__ == "__main__":
    main(sys.argv[1:])
