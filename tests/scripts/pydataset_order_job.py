"""An unseeded shuffled ``fit(PyDataset)``: which examples did each step train on?

    tfdist launch -n 2 pydataset_order_job.py

Each worker's Python ``random`` is put in a different state right before ``fit`` (as
scripts that seed it per worker, or draw from it a different number of times, have it).
The model is one zero embedding per example id whose loss is its own output: SGD(1.0)
moves an id's weight by 1 / global batch each time it is trained on. The chief prints
the ids every step trained on, across every worker: ``ORDER {"workers": 2, "steps":
[[ids], ...]}``; one device's steps are the PyDataset's batches, whole.
"""

from __future__ import annotations

import json
import random

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


with tfdist.scope():
    model = keras.Sequential(
        [
            keras.Input((1,), dtype="int32"),
            keras.layers.Embedding(EXAMPLES, 1, embeddings_initializer="zeros"),
        ]
    )
    model.compile(keras.optimizers.SGD(1.0), trained)

steps, before = [], np.zeros(EXAMPLES)


class Record(keras.callbacks.Callback):
    """The ids each step trained on: those whose weight moved (by 1 / global batch each)."""

    def on_train_batch_end(self, batch, logs=None):
        global before
        now = model.get_weights()[0][:, 0]
        times = np.round((before - now) * BATCH).astype(int)
        steps.append([int(i) for i in np.repeat(np.arange(EXAMPLES), times)])
        before = now


random.seed(1000 + tfdist.cluster_from_env().rank)  # every worker differs
for _ in range(tfdist.cluster_from_env().rank):
    random.random()
model.fit(Ids(), epochs=EPOCHS, shuffle=True, verbose=0, callbacks=[Record()])
if tfdist.is_chief():
    print(
        "ORDER "
        + json.dumps(
            {
                "workers": tfdist.num_workers(),
                "replicas": tfdist.num_replicas(),
                "steps": steps,
            }
        ),
        flush=True,
    )
