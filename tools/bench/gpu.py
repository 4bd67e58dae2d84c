"""One accelerator: what tfdist's scope costs, and the convnet's compute time for the model.

Keras on JAX, one process (run with KERAS_BACKEND=jax). For each global batch it builds
the MNIST ``fast`` convnet three times: with no distribution (``none``), in
``tfdist.scope()`` (``tfdist``) and under a hand-written ``keras.distribution
DataParallel`` (``keras``), then alternates one ``fit`` epoch of each (after a warm-up
epoch that compiles) and reports median ms/step and images/s per variant and the
ratios tfdist/none and tfdist/keras. ``ms_per_step`` of ``none`` is the per-step compute
that ``tools/scaling_model.py --gpu FILE`` uses to predict 8-512 GPUs.

``tfdist_ahead`` probes a fix: Keras's JAX trainer starts the next batch's host-to-device
copy one step ahead only when no distribution is set (``JAXEpochIterator._get_iterator``);
under any distribution each batch is copied just before its step. That variant is the
tfdist model with the same one-batch look-ahead applied to the distributed iterator.

    KERAS_BACKEND=jax python -m tools.bench.gpu --json gpu.json
    KERAS_BACKEND=jax python -m tools.bench.gpu --batches 128 --rounds 1 --steps 10   # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time

import tfdist  # (before jax: device set-up)
from tools.bench import harness

_nothing = contextlib.nullcontext

VARIANTS = ("none", "tfdist", "keras", "tfdist_ahead")


def _convnet(keras):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _models(keras) -> dict:
    from keras import distribution as kd

    models = {"none": _convnet(keras)}
    with tfdist.scope():
        models["tfdist"] = _convnet(keras)
        models["tfdist_ahead"] = _convnet(keras)
    previous = kd.distribution()
    kd.set_distribution(kd.DataParallel(devices=kd.list_devices()))
    try:
        models["keras"] = _convnet(keras)
    finally:
        kd.set_distribution(previous)
    return models


def _one_ahead(batches):
    """Yields each batch after the next one has been started (its copy is then in flight)."""
    pending = None
    for batch in batches:
        if pending is not None:
            yield pending
        pending = batch
    if pending is not None:
        yield pending


class _LookAhead:
    """Within the block, Keras's distributed JAX iterator runs one batch ahead (the probe)."""

    def __enter__(self):
        from keras.src.backend.jax import trainer

        self.cls = trainer.JAXEpochIterator
        self.original = self.cls._get_distributed_iterator
        original = self.original
        self.cls._get_distributed_iterator = lambda it, dist: _one_ahead(original(it, dist))

    def __exit__(self, *exc):
        self.cls._get_distributed_iterator = self.original


def _epoch_ms(keras, model, x, y, batch: int) -> float:
    """ms per step over one epoch, the first step (dispatch, transfer start) excluded."""
    marks = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, b, logs=None):
            marks.append(time.perf_counter())

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Clock()])
    return 1000 * (marks[-1] - marks[0]) / (len(marks) - 1)


def measure(batches, rounds: int, steps: int) -> dict:
    """Median ms/step of each variant at each global batch, alternating variants.

    Example:
        >>> measure([128], 1, 10)["rows"][0]["ms"]["none"]  # doctest: +SKIP
        0.31
    """
    import jax
    import keras
    import numpy as np

    rows = []
    for batch in batches:
        rng = np.random.default_rng(0)
        x = rng.random((batch * steps, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, size=(batch * steps,))
        models = _models(keras)
        for v, m in models.items():  # compile
            with _LookAhead() if v == "tfdist_ahead" else _nothing():
                _epoch_ms(keras, m, x[: batch * 3], y[: batch * 3], batch)
        times = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for v in harness.in_turn(VARIANTS, r):
                with _LookAhead() if v == "tfdist_ahead" else _nothing():
                    times[v].append(_epoch_ms(keras, models[v], x, y, batch))
        ms = {v: statistics.median(t) for v, t in times.items()}
        rows.append({
            "global_batch": batch, "ms": ms,
            "range": {v: [min(t), max(t)] for v, t in times.items()},
            "images_per_s": {v: batch * 1000 / ms[v] for v in VARIANTS},
            "tfdist_over_none": ms["tfdist"] / ms["none"],
            "tfdist_over_keras": ms["tfdist"] / ms["keras"],
            "tfdist_ahead_over_none": ms["tfdist_ahead"] / ms["none"],
        })  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%d"),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "keras": keras.__version__,
        "rounds": rounds,
        "steps": steps,
        "rows": rows,
    }


def format_table(f: dict) -> str:
    lines = [
        f"{f['device_kind']} ({f['platform']}), jax {f['jax']}, keras {f['keras']}, {f['date']}; "
        f"median of {f['rounds']} alternated epochs of {f['steps']} steps",
        "",
        "| global batch | none ms/step | tfdist ms/step | keras DataParallel ms/step | "
        "images/s (none) | tfdist/none | tfdist/keras | tfdist + look-ahead / none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in f["rows"]:
        ms = r["ms"]
        lines.append(
            f"| {r['global_batch']} | {ms['none']:.2f} | {ms['tfdist']:.2f} | {ms['keras']:.2f} "
            f"| {r['images_per_s']['none']:,.0f} | {r['tfdist_over_none']:.3f} "
            f"| {r['tfdist_over_keras']:.3f} | {r['tfdist_ahead_over_none']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    figures = measure(args.batches, args.rounds, args.steps)
    print(format_table(figures))
    if args.json:
        harness.write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
