"""Benchmark of tfdist.data.pipeline on real MNIST, measured side by side in one run.

Two figures, each a ratio of runs alternated A B A B (the machine is noisy):

* throughput: examples per second over 3 epochs of ``tfdist.data.pipeline`` (the
  time includes building it, i.e. reading MNIST into memory) against the naive
  ``raw.map(scale).batch(128)``, both reading the same tfds MNIST and consumed inside
  TensorFlow (``Dataset.reduce``), so Python's loop does not blur the difference.
  ``warm``: one tfds dataset, whose decoded examples tfds already holds in its memory
  cache, is shared by every run, which compares the pipelines themselves; ``cold``:
  MNIST is loaded afresh for every run, so the first epoch of each decodes 60 000 PNG
  images. ``pipeline_map_per_example`` is the pipeline with ``map_on="example"`` (one
  ``map_fn`` call per example, the classic "map, then cache").
* input-bound ratio: the time per training step of a small convnet fed by the pipeline,
  divided by the same convnet fed with batches already in memory (goal <= 1.05).

Usage (needs MNIST under TFDS_DATA_DIR)::

    TFDS_DATA_DIR=/path/to/tensorflow_datasets python -m tools.bench.pipeline

As a module: ``from tools.bench_pipeline import run; figures = run()``.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
import warnings
from typing import TYPE_CHECKING

import numpy as np

from tools.bench import harness

if TYPE_CHECKING:  # TensorFlow loads when a benchmark runs, not when the table imports this
    import tensorflow as tf

BATCH = 128
EPOCHS = 3


def _naive(raw: tf.data.Dataset) -> tf.data.Dataset:
    from tfdist import data

    return raw.map(data.scale).batch(BATCH)


def _count(ds: tf.data.Dataset) -> int:
    import tensorflow as tf

    # Read inside TensorFlow (Dataset.reduce), so the figure is the pipeline's speed
    # and not that of a Python loop over batches.
    return int(
        ds.reduce(tf.constant(0, tf.int64), lambda n, b: n + tf.shape(b[0], out_type=tf.int64)[0])
    )


def _timed_epochs(make, epochs: int) -> tuple[float, float, int]:
    """Wall and CPU seconds to build a dataset with ``make()`` and read ``epochs`` epochs.

    CPU seconds (all threads of this process) are also reported: on a machine shared
    with other jobs they move much less than wall time.
    """
    wall, cpu = time.perf_counter(), time.process_time()
    ds = make()
    examples = sum(_count(ds) for _ in range(epochs))
    return time.perf_counter() - wall, time.process_time() - cpu, examples


def throughput(*, rounds: int = 3, epochs: int = EPOCHS, cold: bool = False) -> dict:
    """Examples/s of the pipeline variants and of the naive pipeline, alternated.

    Args:
        rounds: how many times each variant runs (A B C A B C ...), after one warm-up
            run each that is not measured.
        epochs: epochs read per run.
        cold: load MNIST afresh for every run (first epoch decodes PNGs) instead of
            sharing one tfds dataset whose decoded examples are cached.

    Returns:
        Per variant: examples per wall second and per CPU second (medians over rounds),
        the wall seconds of every run, and the ratios to the naive pipeline.
    """
    from tfdist import data

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
    for make in variants.values():  # warm-up, not measured: first traces, allocator growth
        _timed_epochs(make, 1)
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, make in variants.items():
            runs[name].append(_timed_epochs(make, epochs))
    rate = {n: statistics.median(e / w for w, _, e in r) for n, r in runs.items()}
    cpu_rate = {n: statistics.median(e / c for _, c, e in r) for n, r in runs.items()}
    result: dict = {"epochs": epochs, "rounds": rounds, "cold": cold}
    for name in variants:
        result[f"{name}_examples_per_s"] = round(rate[name])
        result[f"{name}_examples_per_cpu_s"] = round(cpu_rate[name])
        result[f"{name}_wall_s"] = [round(w, 2) for w, _, _ in runs[name]]
    for name in ("pipeline", "pipeline_map_per_example"):
        result[f"{name}_vs_naive"] = round(rate[name] / rate["naive"], 2)
        result[f"{name}_vs_naive_cpu"] = round(cpu_rate[name] / cpu_rate["naive"], 2)
    return result


def _convnet():
    import keras

    from tfdist_examples.recipes import tutorial_model  # the guides' small convnet

    model = tutorial_model()
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _epoch_steps(model, dataset) -> tuple[list[float], float]:
    """Trains one epoch: the wall time of each step after the first, and CPU s/step."""
    import keras

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.times = [time.perf_counter()]
            self.cpu = time.process_time()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            self.cpu = (time.process_time() - self.cpu) / (len(self.times) - 1)

    clock = Clock()
    model.fit(dataset, epochs=1, verbose=0, callbacks=[clock])
    return list(np.diff(clock.times[1:])), clock.cpu


def input_bound(*, rounds: int = 3, map_on: str = "auto", split: str = "train") -> dict:
    """Step time of a small convnet fed by the pipeline / fed batches already in memory.

    Both models train one epoch per measurement, alternated; the first epoch of each
    (tracing) is not measured. The step time is the median over all measured steps,
    which a burst of load from other processes moves less than a mean; CPU time per
    step (all threads) is reported too, and the CPU time each feed needs to produce a
    batch on its own (what the pipeline adds to a step, free of training noise).

    Args:
        rounds: measured epochs per feed.
        map_on: ``map_on`` of the pipeline under test.
        split: the MNIST split to train on (e.g. ``"train[:20%]"`` for a quick run).

    Returns:
        A dict with the step times (ms: median, mean, CPU) and their ratios.
    """
    import tensorflow as tf

    from tfdist import data

    raw = data.mnist(split)
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
        _epoch_steps(models[name], feed)
    walls: dict[str, list[float]] = {name: [] for name in feeds}
    cpus: dict[str, list[float]] = {name: [] for name in feeds}
    for _ in range(rounds):
        for name, feed in feeds.items():
            steps_s, cpu = _epoch_steps(models[name], feed)
            walls[name].extend(steps_s)
            cpus[name].append(cpu)
    median = {name: statistics.median(v) * 1000 for name, v in walls.items()}
    mean = {name: statistics.fmean(v) * 1000 for name, v in walls.items()}
    cpu = {name: statistics.median(v) * 1000 for name, v in cpus.items()}
    # The input side alone: CPU time to produce one batch, with no training beside it.
    # Added to a training step, this is what the pipeline costs the step.
    reading: dict[str, list[float]] = {name: [] for name in feeds}
    for _ in range(rounds):
        for name, feed in feeds.items():
            start = time.process_time()
            batches = _count(feed) // BATCH
            reading[name].append((time.process_time() - start) / batches * 1000)
    input_ms = {name: statistics.median(v) for name, v in reading.items()}
    return {
        "pipeline_input_cpu_ms_per_batch": round(input_ms["pipeline"], 3),
        "in_memory_input_cpu_ms_per_batch": round(input_ms["in_memory"], 3),
        "pipeline_step_ms": round(median["pipeline"], 2),
        "in_memory_step_ms": round(median["in_memory"], 2),
        "input_bound_ratio": round(median["pipeline"] / median["in_memory"], 3),
        "input_bound_ratio_of_means": round(mean["pipeline"] / mean["in_memory"], 3),
        "pipeline_cpu_ms_per_step": round(cpu["pipeline"], 2),
        "in_memory_cpu_ms_per_step": round(cpu["in_memory"], 2),
        "input_bound_ratio_cpu": round(cpu["pipeline"] / cpu["in_memory"], 3),
        "steps_per_epoch": steps,
        "rounds": rounds,
        "map_on": map_on,
    }


def run(*, rounds: int = 3, train_rounds: int = 3) -> dict:
    """All figures of this benchmark, as one dict.

    Example:
        >>> figures = run()                     # doctest: +SKIP
        >>> figures["throughput_warm"]["pipeline_vs_naive"] >= 7  # doctest: +SKIP
        True
    """
    from tools.bench import harness

    return {
        "machine": harness.machine(),
        "throughput_warm": throughput(rounds=rounds),
        "throughput_cold": throughput(rounds=rounds, cold=True),
        "input_bound": input_bound(rounds=train_rounds),
    }


# --- the table's rows (python -m tools.bench, tools/bench/suite.py) --------------------


PIPELINE_EPOCHS = 10  # each run reads MNIST 10 times: seconds for the fast side, not ~1 s


def _figures_pipeline(quick: bool, pairs: int) -> dict:
    return throughput(rounds=pairs, epochs=1 if quick else PIPELINE_EPOCHS)


def _result_pipeline(f: dict, quick: bool) -> harness.Result:
    ratios = harness.ratios(
        f["naive_wall_s"], f["pipeline_wall_s"]
    )  # = throughput A / throughput B
    return harness.Result(
        ratios,
        unit="throughput ratio",
        met=statistics.median(ratios) >= 7,
        a_values=f["pipeline_wall_s"],
        b_values=f["naive_wall_s"],
        notes=f"examples/s over {f['epochs']} epoch(s): pipeline "
        f"{f['pipeline_examples_per_s']}, naive {f['naive_examples_per_s']}; ratio is "
        "throughput A / throughput B",
    )


def _figures_input_bound(quick: bool, pairs: int) -> dict:
    return input_bound(rounds=1 if quick else pairs, split="train[:20%]" if quick else "train")


def _result_input_bound(f: dict, quick: bool) -> harness.Result:
    return harness.Result(
        [f["input_bound_ratio"]],
        met=f["input_bound_ratio"] <= 1.05,
        a_values=[f["pipeline_step_ms"]],
        b_values=[f["in_memory_step_ms"]],
        value_unit="ms/step",
        notes=f"median step {f['pipeline_step_ms']} ms vs {f['in_memory_step_ms']} ms "
        f"over {f['rounds']} alternated epoch(s) each; CPU-time ratio "
        f"{f['input_bound_ratio_cpu']}",
    )


TABLE_ROWS = [
    harness.Row(
        "pipeline",
        "tfdist.data.pipeline throughput (MNIST, 10 epochs)",
        "naive raw.map(scale).batch(128)",
        ">= 7",
        _figures_pipeline,
        _result_pipeline,
    ),
    harness.Row(
        "input-bound",
        "convnet step fed by tfdist.data.pipeline",
        "fed by in-memory batches",
        "<= 1.05",
        _figures_input_bound,
        _result_input_bound,
    ),
]


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    # Keras warns once per fit that an input of unknown length "ran out of data";
    # that is how every epoch of the pipeline ends, not a problem.
    warnings.filterwarnings("ignore", message=".*ran out of data.*")
    warnings.filterwarnings("ignore", message=".*shuffle=True.*")
    np.set_printoptions(precision=3)
    print(json.dumps(run(), indent=2))
