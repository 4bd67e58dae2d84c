"""``compile(steps_per_execution=4)`` through fit, validation, evaluate, predict and a
step checkpoint, in one process per topology.

    python spe_job.py                       # 1 device (the reference)
    TFDIST_CPU_DEVICES=2 python spe_job.py  # 2 logical devices
    tfdist launch -n 2 spe_job.py           # 2 workers / 2 processes (KERAS_BACKEND=jax too)

88 training examples in global batches of 16 are 6 steps per epoch (the last batch 8):
not a multiple of K = 4, so each epoch runs one execution of 4 steps and one of 2. The
validation and evaluation data (92 examples) end with a batch of 12. Every case builds
its model from the same weights and records what one device would give: the weights,
History, the batch indices and logs every ``on_*_batch_end`` received, evaluate's results,
the predictions; the checkpoint case also lists the files ``tfdist.callbacks.checkpoint``
(``save_freq=3``) wrote. Prints one JSON line on every worker: ``SPE {"topology": {...},
"rank": r, "cases": {name: {"values": {...}, "trained_on": [...]} or {"error": "..."}}}``;
``trained_on`` is what the case's models ran on (tests/scripts/trained_on.py).
``TFDIST_TEST_FAULT`` (tests/scripts/faults.py: ``nan``, ``one_device``,
``outside_distribution``) injects a fault tests/e2e/test_checks_catch_faults.py must see
caught.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import faults  # noqa: E402

if faults.active("one_device"):
    os.environ.pop("TFDIST_CPU_DEVICES", None)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import trained_on  # noqa: E402

import tfdist  # noqa: E402

K = 4
BATCH = 16
TRAIN, VALIDATION = 88, 92
BACKEND = keras.backend.backend()


def data(examples: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 6, 6, 1)).astype("float32")
    labels = (x[:, :3].sum(axis=(1, 2, 3)) > 0).astype("int32") + (x[:, 3:].sum(axis=(1, 2, 3)) > 0)
    return x, labels.astype("int32")


def tf_data(x, y=None):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(x if y is None else (x, y)).batch(BATCH)


def _layers(kind: str) -> list:
    if kind == "conv":
        return [
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
        ]
    if kind == "bn":  # synchronized: one device's statistics on 2 TF replicas too
        return [
            keras.layers.Flatten(),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(synchronized=BACKEND == "tensorflow"),
            keras.layers.Activation("tanh"),
        ]
    return [keras.layers.Flatten(), keras.layers.Dense(8, activation="tanh")]


def _optimizer(kind: str):
    if kind == "bn":  # gradient accumulation and clipping, each fixed by tfdist.compat
        return keras.optimizers.SGD(0.1, global_clipnorm=0.5, gradient_accumulation_steps=3)
    return keras.optimizers.SGD(0.1)


def build(kind: str, steps_per_execution: int = K):
    """The same starting weights on every topology, compiled with ``steps_per_execution``."""
    with contextlib.nullcontext() if faults.active("outside_distribution") else tfdist.scope():
        layers = _layers(kind)
        model = keras.Sequential([keras.Input((6, 6, 1)), *layers, keras.layers.Dense(3)])
        local = np.random.default_rng(42)
        for w in model.weights:  # a variance must stay positive
            drawn = local.normal(scale=0.3, size=w.shape)
            w.assign((1 + abs(drawn) if "variance" in w.path else drawn).astype(w.dtype))
        model.compile(
            _optimizer(kind),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
        )
    return model


class BatchEnds(keras.callbacks.Callback):
    """Every ``on_*_batch_end`` call: its batch index and its logs (numbers only)."""

    def __init__(self):
        super().__init__()
        self.calls = {"train": [], "test": [], "predict": []}

    def _record(self, kind, batch, logs):
        numbers = {k: float(v) for k, v in (logs or {}).items() if k != "outputs"}
        self.calls[kind].append({"batch": batch, **numbers})

    def on_train_batch_end(self, batch, logs=None):
        self._record("train", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._record("test", batch, logs)

    def on_predict_batch_end(self, batch, logs=None):
        self._record("predict", batch, logs)


def _values(model, history, ends: BatchEnds, evaluate, predict) -> dict:
    values = {f"weight {i}": w.ravel().tolist() for i, w in enumerate(model.get_weights())}
    if faults.active("nan"):
        values["weight 0"][0] = float("nan")
    values.update({k: list(v) for k, v in history.history.items()})
    for kind, calls in ends.calls.items():
        values[f"{kind} batch ends"] = {str(i): call for i, call in enumerate(calls)}
    values["evaluate"] = evaluate
    values["predict"] = predict.ravel().tolist()
    return values


def case(inputs: str, kind: str) -> dict:
    x, y = data(TRAIN, 0)
    x_val, y_val = data(VALIDATION, 1)
    model, ends = build(kind), BatchEnds()
    fit = dict(epochs=2, verbose=0, shuffle=False, callbacks=[ends])
    if inputs == "tf.data unknown cardinality":  # the end is found by running out
        history = model.fit(tf_data(x, y).filter(lambda *_: True), **fit)
        evaluate = model.evaluate(tf_data(x_val, y_val), verbose=0, callbacks=[ends])
        predict = model.predict(tf_data(x_val), verbose=0, callbacks=[ends])
    elif inputs == "numpy":
        history = model.fit(x, y, batch_size=BATCH, validation_data=(x_val, y_val), **fit)
        evaluate = model.evaluate(x_val, y_val, batch_size=BATCH, verbose=0, callbacks=[ends])
        predict = model.predict(x_val, batch_size=BATCH, verbose=0, callbacks=[ends])
    else:
        history = model.fit(tf_data(x, y), validation_data=tf_data(x_val, y_val), **fit)
        evaluate = model.evaluate(tf_data(x_val, y_val), verbose=0, callbacks=[ends])
        predict = model.predict(tf_data(x_val), verbose=0, callbacks=[ends])
    FUSED[kind] = getattr(model.train_function, "__name__", None) == "multi_step_on_iterator"
    return _values(model, history, ends, evaluate, predict)


def checkpoint() -> dict:
    """``tfdist.callbacks.checkpoint(save_freq=3)`` with K = 4: the files it wrote, and the
    weights of the newest step checkpoint restored by ``make_or_restore``."""
    x, y = data(TRAIN, 0)
    directory = os.environ.get("SPE_CKPT_DIR") or tempfile.mkdtemp(prefix="spe-ckpt-")
    model = build("mlp")
    saver = tfdist.callbacks.checkpoint(directory, save_freq=3, max_to_keep=None)
    model.fit(tf_data(x, y), epochs=2, verbose=0, shuffle=False, callbacks=[saver])
    tfdist.barrier()
    files = sorted(name for name in os.listdir(directory) if name.endswith(".keras"))
    values = {f"weight {i}": w.ravel().tolist() for i, w in enumerate(model.get_weights())}
    values["files"] = {name: 1 for name in files}
    return values


def log_reductions(steps_per_execution: int) -> dict:
    """The cross-replica reductions Keras's ``reduce_per_replica`` makes for the logs in
    one ``fit`` (2 epochs of 6 steps, no validation), counted as they run."""
    import traceback as stack

    import tensorflow as tf

    extended = tfdist.strategy().extended
    counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    model = build("mlp", steps_per_execution)
    originals = {name: getattr(extended, name) for name in ("reduce_to", "batch_reduce_to")}

    def counting(name):
        def reduce(reduce_op, value, *args, **kwargs):
            # Decided where it is traced: a reduction made for the logs adds one each run.
            if any(frame.name == "reduce_per_replica" for frame in stack.extract_stack()):
                counter.assign_add(1)
            return originals[name](reduce_op, value, *args, **kwargs)

        return reduce

    for name in originals:
        setattr(extended, name, counting(name))
    try:
        x, y = data(TRAIN, 0)
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    finally:
        for name, original in originals.items():
            setattr(extended, name, original)
    return {
        "reductions": int(counter.numpy()),
        "steps": 12,
        "steps_per_execution": steps_per_execution,
    }


# Whether fit ran tfdist's K-step function (the fix) or upstream's, per model kind.
FUSED: dict[str, bool] = {}
CASES = {
    "mlp numpy": (case, ("numpy", "mlp")),
    "conv tf.data": (case, ("tf.data", "conv")),
    "mlp tf.data unknown cardinality": (case, ("tf.data unknown cardinality", "mlp")),
    "bn accumulation clipnorm tf.data": (case, ("tf.data", "bn")),
    "checkpoint save_freq 3": (checkpoint, ()),
}


def topology() -> dict:
    return {
        "backend": BACKEND,
        "replicas": tfdist.num_replicas(),
        "workers": tfdist.num_workers(),
        "steps_per_execution": K,
        "fixed": sorted(kind for kind, fused in FUSED.items() if fused),
    }


def main() -> None:
    if os.environ.get("SPE_COUNT_REDUCTIONS"):  # K = 1 against K = 4, nothing else
        counts = [log_reductions(1), log_reductions(K)]
        if tfdist.is_chief():
            print("SPE " + json.dumps({"topology": topology(), "counts": counts}), flush=True)
        return
    names = sys.argv[1:] or list(CASES)
    out = {}
    trained_on.install()
    for name in names:
        run, spec = CASES[name]
        keras.utils.set_random_seed(0)
        trained_on.NOTED.clear()
        try:
            out[name] = {"values": run(*spec), "trained_on": list(trained_on.NOTED)}
        except Exception as error:  # a failing case is a result, not a crash of the others
            traceback.print_exc()
            text = str(error)  # its head names the node, its tail says what failed
            text = text if len(text) <= 3000 else f"{text[:1500]} ... {text[-1500:]}"
            out[name] = {"error": f"{type(error).__name__}: {text}"}
    report = {"topology": topology(), "rank": tfdist.worker_index(), "cases": out}
    trained_on.emit("SPE", report)  # every worker: each is compared


if __name__ == "__main__":
    main()
