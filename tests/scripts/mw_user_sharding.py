"""Which elements each worker trains on, for pipelines users hand to ``fit`` as they are.

Run as ``tfdist launch -n 2 mw_user_sharding.py SOURCE OUT_DIR`` with SOURCE ``mnist``
(the Distributed-training tutorial's pipeline on tfds MNIST: one TFRecord file) or
``tfrecord`` (a single TFRecord file of numbered records written by worker 0... and
read by both). Builds ``tf.distribute.MultiWorkerMirroredStrategy()`` itself, sets no
``tf.data.Options``, and fits 2 epochs with a ``train_step`` that records an id per
example (the record's number, or a hash of the MNIST image), then predicts.

Prints one JSON line: worker, error, the ids trained on per epoch, every id of the
dataset, and how many predictions came back.
"""

import hashlib
import json
import logging
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

from tfdist.core import cluster

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
SOURCE, OUT = sys.argv[1], Path(sys.argv[2])
mwms = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402

GLOBAL_BATCH, EXAMPLES = 32, 256
seen: list[list[str]] = []


def mnist_ids(x):
    return [hashlib.sha1(row.tobytes()).hexdigest()[:12] for row in np.asarray(x)]


def record_ids(x):
    return [str(int(v)) for v in np.asarray(x)[:, 0]]


def tutorial_pipeline():
    import tensorflow_datasets as tfds

    def scale(image, label):
        return tf.cast(image, tf.float32) / 255.0, label

    # The tutorial's shuffle has no seed; under DATA sharding every worker must shuffle
    # alike, so the script seeds TensorFlow once (tfdist warns when it does not).
    tf.random.set_seed(1)
    train = tfds.load("mnist", split="train", as_supervised=True).take(EXAMPLES)
    return train.map(scale).cache().shuffle(EXAMPLES).batch(GLOBAL_BATCH), mnist_ids


def tfrecord_pipeline():
    path = str(OUT / "single.tfrecord")
    if not Path(path).exists():
        raise SystemExit("write the file first (the test does)")

    def parse(record):
        value = tf.io.parse_single_example(record, {"id": tf.io.FixedLenFeature([], tf.int64)})
        return tf.cast(tf.reshape(value["id"], (1,)), tf.float32), value["id"] % 10

    return tf.data.TFRecordDataset(path).map(parse).batch(GLOBAL_BATCH), record_ids


class Recorder(keras.Model):
    """A linear classifier whose train_step records the ids of the examples it gets."""

    def __init__(self, ids, **kwargs):
        super().__init__(**kwargs)
        self.ids = ids
        self.flat = keras.layers.Flatten()
        self.dense = keras.layers.Dense(10)

    def call(self, inputs):
        return self.dense(self.flat(inputs))

    def train_step(self, data):
        tf.py_function(lambda x: seen[-1].extend(self.ids(x)), [data[0]], [])
        return super().train_step(data)


class NewEpoch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        seen.append([])


dataset, ids = tutorial_pipeline() if SOURCE == "mnist" else tfrecord_pipeline()
every_id = sorted(i for x, _ in dataset for i in ids(x))
with mwms.scope():
    model = Recorder(ids)
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
result = {"worker": cluster.cluster_from_env().rank, "error": None}
try:
    model.fit(dataset, epochs=2, verbose=0, callbacks=[NewEpoch()])
    result["predicted"] = len(model.predict(dataset, verbose=0))
except Exception as err:  # noqa: BLE001 - the test reads the message
    result["error"] = f"{type(err).__name__}: {str(err)[:600]}"
result.update(epochs=[sorted(epoch) for epoch in seen], every_id=every_id)
print(json.dumps(result), flush=True)
