"""A script's own saves on every worker: ``model.save`` / ``save_weights`` then a load.

    tfdist launch -n 2 user_saves_job.py DIR [ROUNDS]     # TensorFlow workers
    KERAS_BACKEND=jax tfdist launch -n 2 user_saves_job.py DIR [ROUNDS]

Every worker trains the same model (a rank-guarded callback saving on the chief alone
every other epoch, as scripts written for one process do), then ROUNDS times:
``model.save(DIR/model.keras)`` and ``keras.models.load_model`` of it,
``model.save_weights(DIR/w.weights.h5)`` and ``load_weights`` into a second model, each
load on every worker right after the save returns (no barrier between save and load),
the weights changed between rounds (a barrier ends each round, so that no worker saves
round i + 1 while another still loads round i). Then the other ways scripts save: the
chief alone after ``fit``, the chief alone then every worker, ``keras.saving.save_model``
and (TensorFlow) ``model.export`` by every worker, and the TensorFlow tutorial's
per-worker pattern (each non-chief saves to a path of its own and removes it). With
``kill`` as third argument every worker saves once, then the chief alone saves again and
kills itself -9 inside that save. Each worker prints
``SAVES {"worker": i, "workers": n, "failures": [...], "worst": d, "trained_on": [...]}``,
``trained_on`` what the model's ``fit`` ran on (tests/scripts/trained_on.py).
``TFDIST_TEST_FAULT`` (tests/scripts/faults.py: ``nan``, ``outside_distribution``) injects
a fault tests/e2e/test_checks_catch_faults.py must see caught.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys

import equivalence
import faults
import keras
import numpy as np
import trained_on

import tfdist

directory = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
kill = sys.argv[3:] == ["kill"]  # the chief kills itself -9 inside its second save
worker = tfdist.cluster_from_env().rank


def build():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


class ChiefSavesEveryOtherEpoch(keras.callbacks.Callback):
    """A user's callback, guarded by rank: the chief alone saves, inside ``fit``."""

    def __init__(self):
        super().__init__()
        self.saved = None

    def on_epoch_end(self, epoch, logs=None):
        if epoch % 2 == 1:
            self.model.save(os.path.join(directory, "callback.keras"))
            self.saved = self.model.get_weights()


trained_on.install()
with contextlib.nullcontext() if faults.active("outside_distribution") else tfdist.scope():
    model, other = build(), build()
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
in_fit = ChiefSavesEveryOtherEpoch()
model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[in_fit] if worker == 0 else [])

failures, worst = [], 0.0


def kill_when_staging_appears():
    """SIGKILL this process once a staging file of model.keras has bytes in it."""
    import signal
    import threading
    import time

    def watch():
        while True:
            for name in os.listdir(directory):
                if name.startswith(".tmp-") and name.endswith("model.keras"):
                    if os.path.getsize(os.path.join(directory, name)) > 0:
                        os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()


if kill:
    model.save(os.path.join(directory, "model.keras"))
    np.savez(os.path.join(directory, f"saved-{worker}.npz"), *model.get_weights())
    tfdist.barrier()  # every worker's first save is in place
    model.set_weights([w + 1.0 for w in model.get_weights()])
    if tfdist.is_chief():
        kill_when_staging_appears()
        model.save(os.path.join(directory, "model.keras"))  # the chief dies in here
    sys.exit(3)  # never reached by the chief


def compare(what, loaded):
    """The loaded weights must be the saved ones exactly (tests/scripts/equivalence.py)."""
    global worst
    if isinstance(loaded, keras.Model):
        loaded = loaded.get_weights()
    if faults.active("nan"):  # as a load that read one bad value
        loaded = [np.array(w, copy=True) for w in loaded]
        loaded[0].flat[0] = np.nan
    try:
        difference = equivalence.assert_close(model.get_weights(), loaded, 0.0, what)
        worst = difference if difference > worst else worst
    except equivalence.NotEquivalent as error:
        failures.append(str(error))
        worst = float("inf")


for i in range(rounds):
    model.set_weights([w + 0.01 * (i + 1) for w in model.get_weights()])
    path = os.path.join(directory, "model.keras")
    try:
        model.save(path)
        compare(f"round {i} load_model", keras.models.load_model(path).get_weights())
    except Exception as error:
        failures.append(f"round {i} save/load_model: {type(error).__name__}: {error}"[:300])
    path = os.path.join(directory, "w.weights.h5")
    try:
        model.save_weights(path)
        other.load_weights(path)
        compare(f"round {i} load_weights", other.get_weights())
    except Exception as error:
        failures.append(f"round {i} save/load_weights: {type(error).__name__}: {error}"[:300])
    tfdist.barrier()


def attempt(what, action):
    try:
        action()
    except Exception as error:
        failures.append(f"{what}: {type(error).__name__}: {error}"[:300])


def saved_in_fit():
    loaded = keras.models.load_model(os.path.join(directory, "callback.keras")).get_weights()
    if worker == 0:
        equivalence.assert_close(in_fit.saved, loaded, 0.0, "the callback's save")


def chief_alone():
    if tfdist.is_chief():
        model.save(os.path.join(directory, "chief.keras"))
        compare("chief alone", keras.models.load_model(os.path.join(directory, "chief.keras")))


def chief_alone_then_every_worker():
    path = os.path.join(directory, "counts.weights.h5")
    if tfdist.is_chief():
        model.save_weights(path)
    model.save_weights(path)
    other.load_weights(path)
    compare("chief alone, then every worker", other.get_weights())


def save_model_function():
    path = os.path.join(directory, "function.keras")
    keras.saving.save_model(model, path)
    compare("keras.saving.save_model", keras.models.load_model(path).get_weights())


def export_by_every_worker():
    import tensorflow as tf

    path = os.path.join(directory, "export")
    model.export(path, verbose=False)
    # A directory is replaced by two renames: read it once no worker is replacing it.
    tfdist.barrier()
    served = tf.saved_model.load(path)
    expected = model(x[:8]).numpy()  # not predict: it is collective, and this is local
    equivalence.assert_close([expected], [served.serve(x[:8]).numpy()], 1e-6, "export")


attempt("a chief-only save in a callback", saved_in_fit)
attempt("a chief-only save after fit", chief_alone)
attempt("a chief-only save, then one by every worker", chief_alone_then_every_worker)
attempt("keras.saving.save_model", save_model_function)
if keras.backend.backend() == "tensorflow":
    attempt("model.export by every worker", export_by_every_worker)
tfdist.barrier()

# The TensorFlow multi-worker tutorial: the chief saves to the real path, the others to
# a temporary one of their own, which they delete.
# (Another file name too: the workers' meetings must not depend on the path given.)
own = directory if worker == 0 else os.path.join(directory, f"workertemp_{worker}")
name = "tutorial.keras" if worker == 0 else f"tutorial-{worker}.keras"
try:
    os.makedirs(own, exist_ok=True)  # as the tutorial's write_filepath does
    model.save(os.path.join(own, name))
    if worker != 0:
        assert os.path.exists(os.path.join(own, name)), "own path not written"
        shutil.rmtree(own)
    tfdist.barrier()
    compare(
        "tutorial", keras.models.load_model(os.path.join(directory, "tutorial.keras")).get_weights()
    )
except Exception as error:
    failures.append(f"tutorial pattern: {type(error).__name__}: {error}"[:300])

print(
    "SAVES "
    + json.dumps(
        {
            "worker": worker,
            "workers": tfdist.num_workers(),
            "failures": failures,
            "worst": worst,
            "trained_on": trained_on.NOTED,
        }
    ),
    flush=True,
)
