"""One fit with Keras's own file-writing callbacks, for tests/compat/test_keras_callbacks.py.

The same script runs on one process, under ``tfdist launch -n 2`` (TensorFlow's
MultiWorkerMirroredStrategy) and with ``KERAS_BACKEND=jax`` (jax's multi-process
runtime). Variants (``--variant``, comma-separated: each trains a fresh model in its own
sub-directory of ``--dir``):

* ``all``: every callback in one fit: CSVLogger (append), TensorBoard (histograms),
  LearningRateScheduler, a PrintLR callback, ModelCheckpoint three times (per-epoch
  ``.weights.h5`` as in TensorFlow's "Distributed training with Keras" tutorial,
  ``save_best_only`` ``.keras``, ``save_freq`` in steps), BackupAndRestore
  (``double_checkpoint``, kept at the end), ReduceLROnPlateau and EarlyStopping (both
  triggered). CSVLogger and TensorBoard come first, so that even a run whose saves fail
  has written their first epoch.
* ``backup``: BackupAndRestore as TensorFlow's multi-worker tutorial uses it (defaults:
  backup each epoch, removed at the end), per-epoch ModelCheckpoint, an epoch-only
  learning-rate decay. ``--kill-rank R --kill-epoch E``: worker R SIGKILLs itself when
  epoch E begins, in the launcher's first attempt only (``TFDIST_RESTART=0``), so that
  ``--max-restarts 1`` restarts the group and BackupAndRestore resumes it.
  ``--tear-rank R --tear-epoch E``: in the second attempt (``TFDIST_RESTART=1``),
  worker R's backup save at the end of epoch E writes its file, cuts it in half and
  SIGKILLs the worker: a backup torn mid-write.

After the fits every worker waits for the others, lists the files under ``--dir`` and
loads every checkpoint file it finds. The last stdout line is JSON:
``{"worker", "workers", "chief", "variants": {name: {...}}}``.

    python keras_callbacks_job.py --dir /tmp/out --variant all,backup
"""

import argparse
import csv
import hashlib
import json
import os
import shutil
import signal
import tempfile

import equivalence
import numpy as np
import tensorflow as tf

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--variant", default="all")
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--kill-rank", type=int, default=None)
parser.add_argument("--kill-epoch", type=int, default=2)
parser.add_argument("--tear-rank", type=int, default=None)
parser.add_argument("--tear-epoch", type=int, default=3)
args = parser.parse_args()

import keras  # noqa: E402

GLOBAL_BATCH = 32
EXAMPLES = 256  # 8 steps an epoch

rng = np.random.default_rng(0)
X = rng.normal(size=(EXAMPLES, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(EXAMPLES, 1))).astype("float32")
RANK = tfdist.worker_index()


def build():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    # Initial weights from numpy: the same on both Keras backends (their RNGs differ).
    init = np.random.default_rng(1)
    model.set_weights(
        [init.normal(scale=0.3, size=w.shape).astype("float32") for w in model.weights]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse")
    return model


def learning_rate(model) -> float:
    return float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))


class PrintLR(keras.callbacks.Callback):
    """The tutorial's PrintLR: the learning rate at each epoch's end."""

    def on_epoch_end(self, epoch, logs=None):
        print(f"Learning rate for epoch {epoch + 1} is {learning_rate(self.model)}", flush=True)


class Record(keras.callbacks.Callback):
    """The epochs this process trained and the learning rate each began with."""

    def __init__(self):
        super().__init__()
        self.epochs, self.rates = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)
        self.rates.append(learning_rate(self.model))


class KillAt(keras.callbacks.Callback):
    """SIGKILL of this worker when ``epoch`` begins, in the launcher's first attempt."""

    def __init__(self, rank, epoch):
        super().__init__()
        self.rank, self.epoch = rank, epoch

    def on_epoch_begin(self, epoch, logs=None):
        first_attempt = os.environ.get("TFDIST_RESTART", "0") == "0"
        if first_attempt and RANK == self.rank and epoch == self.epoch:
            print(f"worker {RANK}: SIGKILL at the start of epoch {epoch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class TearBackup(keras.callbacks.Callback):
    """Worker ``rank``'s next weights save after epoch ``epoch`` (BackupAndRestore's, which
    comes next in the list) is cut in half, then the worker is SIGKILLed: a torn write."""

    def __init__(self, rank, epoch):
        super().__init__()
        self.rank, self.epoch = rank, epoch

    def on_epoch_end(self, epoch, logs=None):
        second_attempt = os.environ.get("TFDIST_RESTART", "0") == "1"
        if not (second_attempt and RANK == self.rank and epoch == self.epoch):
            return
        save_weights = self.model.save_weights

        def torn(filepath, *a, **k):
            save_weights(filepath, *a, **k)
            with open(filepath, "r+b") as f:
                f.truncate(os.path.getsize(filepath) // 2)
            print(f"worker {RANK}: SIGKILL with {filepath} half written", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        self.model.save_weights = torn


def schedule(epoch, lr):
    # Two arguments: it scales the current rate, so ReduceLROnPlateau's cuts persist.
    return lr if epoch < 2 else lr * 0.9


def decay(epoch):
    # The tutorial's shape of decay (epoch only), at this model's scale.
    return 0.05 if epoch < 2 else 0.02 if epoch < 4 else 0.01


def all_callbacks(out):
    return [
        keras.callbacks.CSVLogger(os.path.join(out, "log.csv"), append=True),
        keras.callbacks.TensorBoard(os.path.join(out, "tb"), histogram_freq=1),
        keras.callbacks.LearningRateScheduler(schedule),
        PrintLR(),
        keras.callbacks.ModelCheckpoint(
            os.path.join(out, "ckpt", "ckpt_{epoch}.weights.h5"), save_weights_only=True
        ),
        keras.callbacks.ModelCheckpoint(
            os.path.join(out, "best.keras"), monitor="loss", save_best_only=True
        ),
        keras.callbacks.ModelCheckpoint(
            os.path.join(out, "steps", "step-{epoch}-{batch}.weights.h5"),
            save_weights_only=True,
            save_freq=5,
        ),
        keras.callbacks.BackupAndRestore(
            os.path.join(out, "backup"), double_checkpoint=True, delete_checkpoint=False
        ),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.02),
        keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=0.01),
    ]


def backup_callbacks(out):
    callbacks = [
        keras.callbacks.BackupAndRestore(backup_dir=os.path.join(out, "backup")),
        keras.callbacks.ModelCheckpoint(
            os.path.join(out, "ckpt", "ckpt_{epoch}.weights.h5"), save_weights_only=True
        ),
        keras.callbacks.LearningRateScheduler(decay),
    ]
    if args.kill_rank is not None:
        callbacks.append(KillAt(args.kill_rank, args.kill_epoch))
    if args.tear_rank is not None:
        callbacks.insert(0, TearBackup(args.tear_rank, args.tear_epoch))
    return callbacks


def digest(weights) -> str:
    return hashlib.sha256(b"".join(np.asarray(w, "float32").tobytes() for w in weights)).hexdigest()


def train(variant):
    out = os.path.join(args.dir, variant)
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
    with tfdist.scope():
        model = build()
    record = Record()
    callbacks = all_callbacks(out) if variant == "all" else backup_callbacks(out)
    history = model.fit(data, epochs=args.epochs, callbacks=[*callbacks, record], verbose=0)
    weights = model.get_weights()
    return {
        "epochs": record.epochs,
        "rates": record.rates,
        "history": history.history,
        "learning_rate": learning_rate(model),
        "weights": [w.tolist() for w in weights],
        "sha256": digest(weights),
    }


def files_under(root):
    found = []
    for parent, _dirs, names in os.walk(root):
        found += [os.path.relpath(os.path.join(parent, n), root) for n in names]
    return sorted(found)


def loads(path, final):
    """Loads one file; for checkpoints: the largest difference from the final weights."""
    if path.endswith(".keras"):
        weights = keras.models.load_model(path).get_weights()
    elif path.endswith((".weights.h5", ".weights.h5.bkp")):
        model = build()
        model.optimizer.build(model.trainable_variables)
        with tempfile.TemporaryDirectory() as tmp:  # Keras wants the suffix .weights.h5
            model.load_weights(shutil.copy(path, os.path.join(tmp, "copy.weights.h5")))
        weights = model.get_weights()
    elif path.endswith(".csv"):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        return {"rows": len(rows), "headers": sum(r[:1] == ["epoch"] for r in rows)}
    elif path.endswith(".json"):
        with open(path) as f:
            return json.load(f)
    else:
        return os.path.getsize(path) > 0
    return equivalence.max_difference(final, weights)


def inspect(variant, result):
    root = os.path.join(args.dir, variant)
    files = files_under(root) if os.path.isdir(root) else []
    final = [np.asarray(w) for w in result["weights"]]
    result["files"] = {}
    for name in files:
        path = os.path.join(root, name)
        result["files"][name] = loads(path, final)
    return result


variants = {}
for name in args.variant.split(","):
    variants[name] = train(name)
tfdist.barrier("keras_callbacks_job: every worker has finished training")
for name, result in variants.items():
    inspect(name, result)
print(
    json.dumps(
        {
            "worker": RANK,
            "workers": tfdist.num_workers(),
            "chief": tfdist.is_chief(),
            "replicas": tfdist.num_replicas(),
            "variants": variants,
        }
    ),
    flush=True,
)
