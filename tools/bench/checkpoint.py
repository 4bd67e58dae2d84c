"""What a checkpoint costs against Keras's own, on a model of realistic size.

* ``save``: a one-step ``fit`` whose step is checkpointed by ``tfdist.callbacks.checkpoint``
  (a ``.keras`` with resume metadata, staged, fsynced and renamed) against the same ``fit``
  with Keras's ``ModelCheckpoint`` writing a ``.keras`` of the same model (the step itself
  is a few milliseconds: the save is most of each side);
* ``restore``: ``tfdist.make_or_restore`` (which checks the archive end to end, then
  restores weights, optimizer state and the resume position) against
  ``keras.models.load_model`` of the same file.

The model: an MLP with Adam whose weights and optimizer state total about 50 MB (``--mb``).
A and B alternate; the first pair is a warm-up.

    python -m tools.bench.checkpoint --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from tools.bench import harness


def _model(width: int):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((width,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
    return model


def _width_for(megabytes: float) -> int:
    # Two width x width kernels dominate; Adam keeps two slots: 3 x 4 bytes per weight.
    return int((megabytes * 2**20 / (3 * 4 * 2)) ** 0.5)


def _state_mb(model) -> float:
    values = [*model.weights, *model.optimizer.variables]
    return sum(int(np.prod(v.shape)) * 4 for v in values) / 2**20


def measure(pairs: int = 3, megabytes: float = 50.0) -> dict:
    """Save and restore ratios (A = tfdist, B = Keras), ``pairs`` alternated pairs each."""
    import keras

    import tfdist

    width = _width_for(megabytes)
    x = np.random.default_rng(0).normal(size=(32, width)).astype("float32")
    y = np.zeros(32, "int64")
    root = tempfile.mkdtemp(prefix="bench_checkpoint-")
    model = _model(width)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # builds the optimizer state

    def fit_once(callbacks) -> float:
        start = time.perf_counter()
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks)
        return time.perf_counter() - start

    def save_tfdist() -> float:
        folder = tempfile.mkdtemp(dir=root)
        return fit_once([tfdist.callbacks.checkpoint(folder, save_freq=1)])

    def save_keras() -> float:
        path = os.path.join(tempfile.mkdtemp(dir=root), "model.keras")
        return fit_once([keras.callbacks.ModelCheckpoint(path, save_freq=1)])

    save = _alternate(save_tfdist, save_keras, pairs)
    ckpt = tempfile.mkdtemp(dir=root)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0,
              callbacks=[tfdist.callbacks.checkpoint(ckpt, save_freq=1)])  # fmt: skip
    newest = sorted(os.listdir(ckpt))[-1]
    path = os.path.join(ckpt, newest)

    def restore_tfdist() -> float:
        start = time.perf_counter()
        tfdist.make_or_restore(lambda: _model(width), ckpt)
        return time.perf_counter() - start

    def restore_keras() -> float:
        start = time.perf_counter()
        keras.models.load_model(path)
        return time.perf_counter() - start

    restore = _alternate(restore_tfdist, restore_keras, pairs)
    figures = {
        "state_mb": round(_state_mb(model), 1),
        "file_mb": round(os.path.getsize(path) / 2**20, 1),
        "step_s": statistics.median(fit_once([]) for _ in range(3)),
        "save": save,
        "restore": restore,
    }
    shutil.rmtree(root, ignore_errors=True)
    return figures


def _alternate(a, b, pairs: int) -> dict:
    """``pairs`` alternated A/B pairs after a warm-up pair (traced functions, file cache)."""
    a_values, b_values = harness.alternate(a, b, pairs)
    ratios = harness.ratios(a_values, b_values)
    return {
        "a_s": a_values,
        "b_s": b_values,
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
    }


ROWS = {"checkpoint-save": ("save", 1.2), "checkpoint-restore": ("restore", 1.3)}


def run(name: str, pairs: int = 3, megabytes: float = 50.0) -> dict:
    """One row for tools/bench/suite.py: ``{"ratio", "range", "goal", "met", ...figures}``.

    Example:
        >>> run("checkpoint-restore", pairs=3)["ratio"]  # doctest: +SKIP
        1.05
    """
    if name not in ROWS:
        raise ValueError(f"run: name must be one of {sorted(ROWS)}. Received: name={name!r}")
    part, goal = ROWS[name]
    figures = measure(pairs, megabytes)
    row = figures[part]
    return {
        "name": name,
        "ratio": row["ratio_median"],
        "range": [min(row["ratios"]), max(row["ratios"])],
        "goal": goal,
        "met": row["ratio_median"] <= goal,
        "state_mb": figures["state_mb"],
        "a_s": row["a_s"],
        "b_s": row["b_s"],
    }


# --- the table's rows (python -m tools.bench, tools/bench/suite.py) --------------------


def _figures_checkpoint(quick: bool, pairs: int) -> dict:
    f = measure(pairs=pairs * (1 if quick else harness.REPEATS), megabytes=5.0 if quick else 50.0)
    return {**f, "repeats": 1 if quick else harness.REPEATS}


def _result_checkpoint(part: str, f: dict, quick: bool) -> harness.Result:
    row = f[part]
    goal = {"save": 1.2, "restore": 1.3}[part]
    repeats = f.get("repeats", 1)
    ratios = harness.grouped(row["ratios"], repeats)
    return harness.Result(
        ratios,
        met=None if quick else statistics.median(ratios) <= goal,
        a_values=row["a_s"],
        b_values=row["b_s"],
        notes=f"{f['state_mb']} MB of weights and Adam state, a {f['file_mb']} MB archive; "
        f"medians {statistics.median(row['a_s']):.3f} s vs {statistics.median(row['b_s']):.3f} s"
        + (f"; the training step alone {f['step_s']:.3f} s" if part == "save" else "")
        + f"; each ratio the median of {repeats} alternated pair(s)",
    )


TABLE_ROWS = [
    harness.Row(
        "checkpoint-save",
        "one-step fit + tfdist.callbacks.checkpoint (50 MB)",
        "the same with keras.callbacks.ModelCheckpoint (.keras)",
        "<= 1.2",
        _figures_checkpoint,
        lambda f, q: _result_checkpoint("save", f, q),
    ),
    harness.Row(
        "checkpoint-restore",
        "tfdist.make_or_restore (checked, resume state)",
        "keras.models.load_model of the same file",
        "<= 1.3",
        _figures_checkpoint,
        lambda f, q: _result_checkpoint("restore", f, q),
    ),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--mb", type=float, default=50.0, help="weights + optimizer state, MB")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.mb <= 0:
        parser.error(f"--pairs >= 1 and --mb > 0. Received: --pairs={args.pairs} --mb={args.mb}")
    print(json.dumps(measure(args.pairs, args.mb)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
