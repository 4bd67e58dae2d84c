"""An unseeded shuffled ``fit(PyDataset)``: which examples did each step train on?

    tfdist launch -n 2 pydataset_order_job.py [VARIANT ...]

Each worker's Python ``random`` is put in a different state right before ``fit`` (as
scripts that seed it per worker, or draw from it a different number of times, have it).
Variants (default ``plain``), each a fresh model in the same process: ``plain``;
``workers=2`` (Keras's enqueuer with 2 threads) and ``multiprocessing`` (2 processes),
which draw the order in the enqueuer's own thread; ``local fit first`` (the chief alone
first fits a small local model, built outside ``tfdist.scope()``, on a shuffled
PyDataset: a probe that no other worker runs).
The model is one zero embedding per example id whose loss is its own output: SGD(1.0)
moves an id's weight by 1 / global batch each time it is trained on. The chief prints
the ids every step trained on, across every worker: ``ORDER {"workers": 2, "steps":
[[ids], ...], "variant": ...}`` per variant; one device's steps are the PyDataset's
batches, whole.
"""

from __future__ import annotations

import json
import random
import sys

import keras
import numpy as np

import tfdist

EXAMPLES, BATCH, EPOCHS = 48, 8, 3


class Ids(keras.utils.PyDataset):
    def __len__(self):
        return EXAMPLES // BATCH

    def __getitem__(self, i):
        ids = np.arange(i * BATCH, (i + 1) * BATCH, dtype="int32")[:, None]
        return ids, np.zeros((BATCH, 1), "float32")


def trained(y_true, y_pred):
    """Each example's own output: its embedding's gradient is 1 / global batch."""
    return keras.ops.reshape(y_pred, (-1,))


def build():
    with tfdist.scope():
        model = keras.Sequential(
            [
                keras.Input((1,), dtype="int32"),
                keras.layers.Embedding(EXAMPLES, 1, embeddings_initializer="zeros"),
            ]
        )
        model.compile(keras.optimizers.SGD(1.0), trained)
    return model


class Record(keras.callbacks.Callback):
    """The ids each step trained on: those whose weight moved (by 1 / global batch each)."""

    def __init__(self):
        super().__init__()
        self.steps, self.before = [], np.zeros(EXAMPLES)

    def on_train_batch_end(self, batch, logs=None):
        now = self.model.get_weights()[0][:, 0]
        times = np.round((self.before - now) * BATCH).astype(int)
        self.steps.append([int(i) for i in np.repeat(np.arange(EXAMPLES), times)])
        self.before = now


def local_probe() -> bool:
    """The chief alone fits a local model on a shuffled PyDataset; True if it trained
    on this worker alone (its strategy spans no other worker)."""
    probe = keras.Sequential(
        [keras.Input((1,), dtype="int32"), keras.layers.Embedding(EXAMPLES, 1)]
    )
    probe.compile(keras.optimizers.SGD(0.1), trained)
    probe.fit(Ids(), epochs=1, shuffle=True, verbose=0)
    return probe.distribute_strategy.num_replicas_in_sync == 1


def run(variant: str) -> dict:
    rank = tfdist.cluster_from_env().rank
    probed = None
    if variant == "local fit first" and tfdist.is_chief():
        probed = local_probe()
    options = {
        "workers=2": {"workers": 2},
        "multiprocessing": {"workers": 2, "use_multiprocessing": True},
    }
    data = Ids(**options.get(variant, {}))
    model, record = build(), Record()
    random.seed(1000 + rank)  # every worker differs
    for _ in range(rank):
        random.random()
    model.fit(data, epochs=EPOCHS, shuffle=True, verbose=0, callbacks=[record])
    return {
        "variant": variant,
        "workers": tfdist.num_workers(),
        "replicas": tfdist.num_replicas(),
        "probe alone": probed,
        "steps": record.steps,
    }


for variant in sys.argv[1:] or ["plain"]:
    result = run(variant)
    if tfdist.is_chief():
        print("ORDER " + json.dumps(result), flush=True)
