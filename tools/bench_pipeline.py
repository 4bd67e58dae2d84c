"""Benchmark of tfdist.data.pipeline on real MNIST, measured side by side in one run.

Two figures, each a ratio of runs alternated A B A B (the machine is noisy):

* throughput: examples per second over 3 epochs of ``tfdist.data.pipeline`` against
  the naive ``raw.map(scale).batch(128)``, both reading the same tfds MNIST. ``warm``
  shares one tfds dataset whose decoded examples are already in tfds's memory cache
  (what the second and later runs of a training script in a notebook see; each
  pipeline still pays for its own cache); ``cold`` loads MNIST afresh for every run,
  so the first epoch decodes 60 000 PNG images in both.
* input-bound ratio: the time per training step of a small convnet fed by the pipeline,
  divided by the same convnet fed with batches already in memory (goal <= 1.05).

Usage (needs MNIST under TFDS_DATA_DIR)::

    TFDS_DATA_DIR=/path/to/tensorflow_datasets python tools/bench_pipeline.py

As a module: ``from tools.bench_pipeline import run; figures = run()``.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
import warnings

import numpy as np
import tensorflow as tf

from tfdist import data

BATCH = 128
EPOCHS = 3


def _naive(raw: tf.data.Dataset) -> tf.data.Dataset:
    return raw.map(data.scale).batch(BATCH)


def _count(ds: tf.data.Dataset) -> int:
    # Read inside TensorFlow (Dataset.reduce), so the figure is the pipeline's speed
    # and not that of a Python loop over batches.
    return int(
        ds.reduce(tf.constant(0, tf.int64), lambda n, b: n + tf.shape(b[0], out_type=tf.int64)[0])
    )


def _timed_epochs(make, epochs: int) -> tuple[float, int]:
    """Seconds to build a dataset with ``make()`` and read ``epochs`` epochs of it."""
    start = time.perf_counter()
    ds = make()
    examples = sum(_count(ds) for _ in range(epochs))
    return time.perf_counter() - start, examples


def throughput(*, rounds: int = 2, epochs: int = EPOCHS, cold: bool = False) -> dict:
    """Examples/s of the pipeline variants and of the naive pipeline, alternated.

    Args:
        rounds: how many times each variant runs (A B C A B C ...).
        epochs: epochs read per run.
        cold: load MNIST afresh for every run (first epoch decodes PNGs) instead of
            sharing one tfds dataset whose decoded examples are cached.

    Returns:
        A dict of examples/s per variant (median over rounds) and the ratios to naive.
    """
    shared = None
    if not cold:
        shared = data.mnist("train")
        for _ in shared.batch(10_000):  # fills tfds's in-memory cache of decoded examples
            pass

    def raw():
        return data.mnist("train") if cold else shared

    variants = {
        "naive": lambda: _naive(raw()),
        "pipeline": lambda: data.pipeline(raw(), BATCH, map_fn=data.scale, seed=0),
        "pipeline_map_per_example": lambda: data.pipeline(
            raw(), BATCH, map_fn=data.scale, map_on="example", seed=0
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, make in variants.items():
            seconds, examples = _timed_epochs(make, epochs)
            rates[name].append(examples / seconds)
    result = {f"{name}_examples_per_s": round(statistics.median(r)) for name, r in rates.items()}
    naive = statistics.median(rates["naive"])
    for name in ("pipeline", "pipeline_map_per_example"):
        result[f"{name}_vs_naive"] = round(statistics.median(rates[name]) / naive, 2)
    result.update({"epochs": epochs, "rounds": rounds, "cold": cold})
    return result


def _convnet():
    import keras

    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _step_seconds(model, dataset) -> list[float]:
    """Trains one epoch; returns the time of each step after the first."""
    import keras

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.times = [time.perf_counter()]

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    clock = Clock()
    model.fit(dataset, epochs=1, verbose=0, callbacks=[clock])
    return list(np.diff(clock.times[1:]))


def input_bound(*, rounds: int = 3, map_on: str = "auto") -> dict:
    """Step time of a small convnet fed by the pipeline / fed batches already in memory.

    Both models train one epoch per measurement, alternated; the first epoch of each
    (tracing) is not measured. The step time is the median over all measured steps,
    which a burst of load from other processes moves less than a mean.

    Args:
        rounds: measured epochs per feed.
        map_on: ``map_on`` of the pipeline under test.

    Returns:
        A dict with the step times (ms, median and mean) and their ratios.
    """
    raw = data.mnist("train")
    images, labels = next(iter(raw.batch(60_000)))
    steps = int(images.shape[0]) // BATCH
    x = tf.reshape(tf.cast(images[: steps * BATCH], tf.float32) / 255.0, (steps, BATCH, 28, 28, 1))
    y = tf.reshape(labels[: steps * BATCH], (steps, BATCH))
    in_memory = tf.data.Dataset.from_tensor_slices((x, y))  # each element is a whole batch

    feeds = {
        "pipeline": data.pipeline(raw, BATCH, map_fn=data.scale, map_on=map_on, seed=0),
        "in_memory": in_memory,
    }
    models = {name: _convnet() for name in feeds}
    for name, feed in feeds.items():  # warm-up: trace the train step
        _step_seconds(models[name], feed)
    per_step: dict[str, list[float]] = {name: [] for name in feeds}
    for _ in range(rounds):
        for name, feed in feeds.items():
            per_step[name].extend(_step_seconds(models[name], feed))
    median = {name: statistics.median(v) * 1000 for name, v in per_step.items()}
    mean = {name: statistics.fmean(v) * 1000 for name, v in per_step.items()}
    return {
        "pipeline_step_ms": round(median["pipeline"], 2),
        "in_memory_step_ms": round(median["in_memory"], 2),
        "input_bound_ratio": round(median["pipeline"] / median["in_memory"], 3),
        "input_bound_ratio_of_means": round(mean["pipeline"] / mean["in_memory"], 3),
        "steps_per_epoch": steps,
        "rounds": rounds,
        "map_on": map_on,
    }


def run(*, rounds: int = 2, train_rounds: int = 3) -> dict:
    """All figures of this benchmark, as one dict.

    Example:
        >>> figures = run()                     # doctest: +SKIP
        >>> figures["throughput_warm"]["pipeline_vs_naive"] >= 7  # doctest: +SKIP
        True
    """
    import os
    import platform

    return {
        "machine": {
            "cpus": os.cpu_count(),
            "gpus": len(tf.config.list_physical_devices("GPU")),
            "platform": platform.platform(),
            "tensorflow": tf.__version__,
        },
        "throughput_warm": throughput(rounds=rounds),
        "throughput_cold": throughput(rounds=rounds, cold=True),
        "input_bound": input_bound(rounds=train_rounds),
    }


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    # Keras warns once per fit that an input of unknown length "ran out of data";
    # that is how every epoch of the pipeline ends, not a problem.
    warnings.filterwarnings("ignore", message=".*ran out of data.*")
    warnings.filterwarnings("ignore", message=".*shuffle=True.*")
    np.set_printoptions(precision=3)
    print(json.dumps(run(), indent=2))
