"""Overhead of tfdist: a model trained with ``tfdist.scope`` + ``tfdist.data.pipeline``
against the same model trained with hand-written ``tf.distribute`` code (the guides'
MirroredStrategy, ``map -> cache -> shuffle -> batch -> prefetch`` pipeline).

Both run in one process on the same logical devices, one epoch each, alternately
(A B A B ...); the figure is the ratio of epoch times (goal <= 1.01).

    TFDIST_CPU_DEVICES=2 python -m tools.bench.overhead --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from tools.bench import harness


def measure(*, pairs: int = 5, split: str = "train[:25%]", per_replica_batch: int = 64) -> dict:
    """Epoch times of both sides, alternated; returns figures and per-pair ratios.

    Example:
        >>> measure(pairs=2, split="train[:5%]")["ratio_median"]  # doctest: +SKIP
        1.0
    """
    import keras
    import tensorflow as tf

    import tfdist
    from tfdist_examples.recipes import tutorial_model

    strategy_a = tfdist.strategy()
    from tfdist.backends import tensorflow as tf_backend

    devices = list(tf_backend.current_plan().devices)
    raw = tfdist.data.mnist(split)

    def build():
        model = tutorial_model()  # the guides' small convnet
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    # A: tfdist
    train_a = tfdist.data.pipeline(raw, per_replica_batch, map_fn=tfdist.data.scale, seed=0)
    with tfdist.scope():
        model_a = build()

    # B: what the guides have users write by hand
    strategy_b = (
        tf.distribute.MirroredStrategy(devices=devices)
        if len(devices) > 1
        else tf.distribute.OneDeviceStrategy(devices[0])
    )
    global_batch = per_replica_batch * strategy_b.num_replicas_in_sync

    def scale(image, label):
        return tf.cast(image, tf.float32) / 255.0, label

    train_b = (
        raw.map(scale, num_parallel_calls=tf.data.AUTOTUNE)
        .cache()
        .shuffle(10_000)
        .batch(global_batch, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    with strategy_b.scope():
        model_b = build()

    def epoch(model, data):
        start = time.perf_counter()
        model.fit(data, epochs=1, verbose=0, shuffle=False)
        return time.perf_counter() - start

    for _ in range(1):  # warm-up: tracing, caches
        epoch(model_a, train_a)
        epoch(model_b, train_b)
    a_times, b_times = [], []
    for i in range(pairs):
        order = [(model_a, train_a, a_times), (model_b, train_b, b_times)]
        for model, data, out in harness.in_turn(order, i):
            out.append(epoch(model, data))
    ratios = [a / b for a, b in zip(a_times, b_times, strict=True)]
    return {
        "replicas": strategy_a.num_replicas_in_sync,
        "steps_per_epoch": int(train_a.cardinality()),
        "a_epoch_s": a_times,
        "b_epoch_s": b_times,
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
    }


# --- the table's rows (python -m tools.bench, tools/bench/suite.py) --------------------


def _figures_overhead(quick: bool, pairs: int) -> dict:
    # A quarter of MNIST per epoch (seconds per side), REPEATS alternated pairs per
    # recorded pair: on a shared machine one side's whole-MNIST epoch took from 21 to 82 s
    # in one run; shorter alternated epochs put such a stretch on both sides of a pair.
    repeats = 1 if quick else harness.REPEATS
    f = measure(pairs=pairs * repeats, split="train[:10%]" if quick else "train[:25%]")
    return {**f, "repeats": repeats}


def _result_overhead(f: dict, quick: bool) -> harness.Result:
    repeats = f.get("repeats", 1)
    ratios = harness.grouped(f["ratios"], repeats)
    return harness.Result(
        ratios,
        met=statistics.median(ratios) <= 1.01,
        a_values=f["a_epoch_s"],
        b_values=f["b_epoch_s"],
        notes=f"epoch time on {f['replicas']} replicas, {f['steps_per_epoch']} steps "
        f"(A {statistics.median(f['a_epoch_s']):.2f} s, B {statistics.median(f['b_epoch_s']):.2f} s); "
        f"each ratio the median of {repeats} alternated pair(s)",
    )


TABLE_ROWS = [
    harness.Row(
        "overhead",
        "tfdist.scope + tfdist.data.pipeline, epoch time",
        "hand-written MirroredStrategy + map/cache/shuffle/batch/prefetch",
        "<= 1.01",
        _figures_overhead,
        _result_overhead,
        {"TFDIST_CPU_DEVICES": "2"},
    )
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--split", default="train[:25%]")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    print(json.dumps(measure(pairs=args.pairs, split=args.split)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
