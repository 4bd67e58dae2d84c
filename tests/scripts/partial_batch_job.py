"""Every batch a real dataset has: partial last batches through fit, validation, evaluate
and predict, from every kind of input, trained in one process.

    python partial_batch_job.py                       # 1 device (the reference)
    TFDIST_CPU_DEVICES=2 python partial_batch_job.py  # 2 logical devices
    tfdist launch -n 2 partial_batch_job.py           # 2 workers / 2 processes
    python partial_batch_job.py --tutorial 3000 7000  # TensorFlow's MNIST tutorial (float64)

The global batch is 16. ``SIZES`` name how many examples the last batch has: 1, fewer
than one of 2 replicas' shares (5), exactly one share (8), more than one share (12), and
none. Every case builds its model from the same weights and prints what one device would
give: weights, losses per epoch, validation losses, evaluate's results, predictions.
Prints one JSON line on every worker: ``PARTIAL {"topology": {...}, "rank": r, "cases": {name:
{"values": {...}, "trained_on": [...]} or {"error": "..."}}}``; ``trained_on`` is what
each case's models ran on (tests/scripts/trained_on.py). ``TFDIST_TEST_FAULT``
(tests/scripts/faults.py: ``nan``, ``one_device``, ``outside_distribution``) injects a
fault tests/e2e/test_checks_catch_faults.py must see caught.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import faults  # noqa: E402

if faults.active("one_device"):
    os.environ.pop("TFDIST_CPU_DEVICES", None)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import trained_on  # noqa: E402

import tfdist  # noqa: E402

BATCH = 16
SIZES = {"last 1": 33, "last 5": 37, "last 8": 40, "last 12": 44, "none": 48}
EPOCHS = 2
BACKEND = keras.backend.backend()


def data(examples: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 6, 6, 1)).astype("float32")
    labels = (x[:, :3].sum(axis=(1, 2, 3)) > 0).astype("int32") + (x[:, 3:].sum(axis=(1, 2, 3)) > 0)
    weights = rng.uniform(0.5, 1.5, size=examples).astype("float32")
    return x, labels.astype("int32"), weights


def build(conv: bool):
    """The same starting weights on every topology (``seeded_classifier``)."""
    with contextlib.nullcontext() if faults.active("outside_distribution") else tfdist.scope():
        if conv:  # the tutorials' layers
            layers = [
                keras.layers.Conv2D(4, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
            ]
        else:
            layers = [keras.layers.Flatten(), keras.layers.Dense(8, activation="tanh")]
        model = keras.Sequential([keras.Input((6, 6, 1)), *layers, keras.layers.Dense(3)])
        return seeded_classifier(model, seed=42, scale=0.3)


def seeded_classifier(model, *, seed: int, scale: float):
    """``model`` with weights drawn from a numpy generator (no framework RNG decides
    them), compiled as the tutorials' classifier."""
    local = np.random.default_rng(seed)
    model.set_weights(
        [local.normal(scale=scale, size=w.shape).astype(w.dtype) for w in model.get_weights()]
    )
    model.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def tf_data(x, y, *rest, unknown=False, repeat=False):
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices((x, y, *rest))
    if unknown:  # cardinality unknown, as after a filter
        ds = ds.filter(lambda *_: True)
    ds = ds.batch(BATCH)
    return ds.repeat() if repeat else ds


def tf_records(x, y):
    """The examples written to a TFRecord file and read back, as real pipelines read them
    (tf.distribute splits a file-read batch by fixed shares: 5 of 16 -> 5 + 0)."""
    import os
    import tempfile

    import tensorflow as tf

    path = os.path.join(tempfile.mkdtemp(), f"data-{len(x)}.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for image, label in zip(x, y, strict=True):
            writer.write(
                tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            "x": tf.train.Feature(
                                float_list=tf.train.FloatList(value=image.ravel())
                            ),
                            "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                        }
                    )
                ).SerializeToString()
            )
    spec = {
        "x": tf.io.FixedLenFeature([6, 6, 1], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
    }

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        return example["x"], tf.cast(example["y"], tf.int32)

    return tf.data.TFRecordDataset(path).map(parse).batch(BATCH)


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return math.ceil(len(self.x) / BATCH)

    def __getitem__(self, i):
        return self.x[i * BATCH : (i + 1) * BATCH], self.y[i * BATCH : (i + 1) * BATCH]


def _result(model, history, x_val, y_val) -> dict:
    values = {f"weight {i}": w.ravel().tolist() for i, w in enumerate(model.get_weights())}
    values.update({k: list(v) for k, v in history.history.items()})
    values["evaluate"] = model.evaluate(tf_data(x_val, y_val), verbose=0)
    values["predict"] = model.predict(tf_data(x_val, y_val), verbose=0).ravel().tolist()
    return values


def case(examples: int, inputs: str, conv: bool = False) -> dict:
    import tensorflow as tf

    x, y, w = data(examples)
    x_val, y_val, _ = data(examples + 4, seed=1)  # its own partial last batch
    model = build(conv)
    fit = dict(epochs=EPOCHS, verbose=0, shuffle=False)
    validation = tf_data(x_val, y_val)
    if inputs == "tf.data":
        history = model.fit(tf_data(x, y), validation_data=validation, **fit)
    elif inputs == "TFRecord":
        history = model.fit(tf_records(x, y), validation_data=tf_records(x_val, y_val), **fit)
    elif inputs == "tf.data unknown cardinality":
        history = model.fit(tf_data(x, y, unknown=True), **fit)
    elif inputs == "tf.data repeat":
        steps = math.ceil(examples / BATCH)
        history = model.fit(tf_data(x, y, repeat=True), steps_per_epoch=steps, **fit)
    elif inputs == "tf.data sample_weight":
        history = model.fit(tf_data(x, y, w), **fit)
    elif inputs == "tf.data batch then map":  # the tf.data guide's vectorized map
        history = model.fit(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).map(lambda a, b: (a * 2.0, b)),
            **fit,
        )
    elif inputs == "tf.data class_weight":
        history = model.fit(tf_data(x, y), class_weight={0: 0.5, 1: 1.0, 2: 2.0}, **fit)
    elif inputs == "tf.data unbatch batch":
        history = model.fit(tf_data(x, y).unbatch().batch(BATCH), **fit)
    elif inputs == "tf.data padded_batch":
        history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).padded_batch(BATCH), **fit)
    elif inputs == "tf.data from_generator":

        def examples():
            yield from zip(x, y, strict=True)

        signature = (tf.TensorSpec((6, 6, 1), tf.float32), tf.TensorSpec((), tf.int32))
        source = tf.data.Dataset.from_generator(examples, output_signature=signature)
        history = model.fit(source.batch(BATCH), **fit)
    elif inputs == "numpy":
        history = model.fit(
            x, y, batch_size=BATCH, validation_data=(x_val, y_val), sample_weight=w, **fit
        )
    elif inputs == "numpy class_weight":
        history = model.fit(x, y, batch_size=BATCH, class_weight={0: 0.5, 1: 1.0, 2: 2.0}, **fit)
    elif inputs == "PyDataset":
        history = model.fit(Batches(x, y), **fit)
    else:
        raise ValueError(f"unknown inputs {inputs!r}")
    return _result(model, history, x_val, y_val)


def cases() -> dict:
    """``{name: (examples, inputs, conv)}``: every size through tf.data and numpy, the
    other inputs at one partial size, the Conv2D + MaxPooling2D model where every replica
    gets an example."""
    table = {}
    for size, examples in SIZES.items():
        table[f"{size} tf.data"] = (examples, "tf.data", False)
        table[f"{size} numpy"] = (examples, "numpy", False)
        table[f"{size} TFRecord"] = (examples, "TFRecord", False)
    for inputs in (
        "tf.data unknown cardinality",
        "tf.data repeat",
        "tf.data sample_weight",
        "numpy class_weight",
        "PyDataset",
    ):
        table[f"last 5 {inputs}"] = (SIZES["last 5"], inputs, False)
    for size in ("last 5", "last 8", "last 12"):
        table[f"{size} conv TFRecord"] = (SIZES[size], "TFRecord", True)
    for inputs in (  # datasets whose batch size only the data knows
        "tf.data batch then map",
        "tf.data class_weight",
        "tf.data unbatch batch",
        "tf.data padded_batch",
        "tf.data from_generator",
    ):
        table[f"last 8 {inputs}"] = (SIZES["last 8"], inputs, False)
    return table


def tutorial(examples: int, dtype: str) -> dict:
    """TensorFlow's MNIST tutorial pipeline and model, one epoch, global batch 128.

    In float64 by default: in float32 two replicas' summed half-batch gradients differ
    from one device's in the last bits, and over hundreds of steps of this model that
    grows (measured, 60000 examples with no partial batch at all: weights 1e-3 apart),
    which would hide what is compared here: how each example is weighed.
    """
    import tensorflow as tf

    keras.config.set_floatx(dtype)
    import tensorflow_datasets as tfds

    def scale(image, label):
        return tf.cast(image, tf.float32) / 255.0, label

    ds = tfds.load("mnist", split=f"train[:{examples}]", as_supervised=True)
    ds = ds.map(scale).cache().batch(128).prefetch(tf.data.AUTOTUNE)
    with tfdist.scope():
        model = keras.Sequential(
            [
                keras.Input((28, 28, 1)),
                keras.layers.Conv2D(8, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        seeded_classifier(model, seed=7, scale=0.1)
    history = model.fit(ds, epochs=1, verbose=0)
    keras.config.set_floatx("float32")
    values = {f"weight {i}": w.ravel().tolist() for i, w in enumerate(model.get_weights())}
    values.update({k: list(v) for k, v in history.history.items()})
    return values


def topology() -> dict:
    return {
        "backend": BACKEND,
        "replicas": tfdist.num_replicas(),
        "workers": tfdist.num_workers(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tutorial", type=int, nargs="*", help="MNIST tutorial sizes")
    parser.add_argument("--dtype", default="float64", help="the tutorial's floatx")
    parser.add_argument("names", nargs="*", help="cases to run (default: all)")
    args = parser.parse_args()
    if args.tutorial:
        jobs = {f"tutorial {n}": (tutorial, (n, args.dtype)) for n in args.tutorial}
    else:
        jobs = {name: (case, spec) for name, spec in cases().items()}
        if args.names:
            jobs = {name: jobs[name] for name in args.names}
    out = {}
    trained_on.install()
    for name, (run, spec) in jobs.items():
        keras.utils.set_random_seed(0)
        trained_on.NOTED.clear()
        try:
            values = run(*spec)
            if faults.active("nan"):
                values["weight 0"][0] = float("nan")
            out[name] = {"values": values, "trained_on": list(trained_on.NOTED)}
        except Exception as error:  # a failing case is a result, not a crash of the others
            traceback.print_exc()
            out[name] = {"error": f"{type(error).__name__}: {str(error)[:1500]}"}
    report = {"topology": topology(), "rank": tfdist.worker_index(), "cases": out}
    trained_on.emit("PARTIAL", report)  # every worker: each is compared


if __name__ == "__main__":
    main()
