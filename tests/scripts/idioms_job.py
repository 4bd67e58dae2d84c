"""The ordinary Keras idioms, each as a user's script writes it, trained in one process.

    python idioms_job.py [IDIOM ...]                       # 1 device
    TFDIST_CPU_DEVICES=2 python idioms_job.py              # 2 logical devices
    tfdist launch -n 2 idioms_job.py                       # 2 workers / 2 processes
    KERAS_BACKEND=jax ...                                  # the same on JAX

Every idiom builds its model under ``tfdist.scope()`` from the same weights (set from a
numpy generator: no framework RNG decides them), trains with the same GLOBAL batch, and
returns the numbers one device would give: final weights, plus what the idiom decides
(epochs run, learning rate, predictions, losses). Prints one JSON line on the chief:
``{idiom: {"values": {...}, "trained_on": [...]} or {"error": "Type: message"}}``, on
every worker (each prints its own line). ``IDIOMS`` is the list tests/e2e/test_idioms.py
and docs/idioms.md's idiom table are made from. ``_topology`` reports what the process ran on
(replicas, workers, processes, this process's devices); each idiom's ``trained_on`` says
what its own models ran on, read from each model after every fit / evaluate / predict /
``*_on_batch`` call (its strategy's replicas on TensorFlow, its variables' devices on
JAX), so a model that trained outside the distribution shows, whatever the process says.

``TFDIST_TEST_FAULT`` (tests/scripts/faults.py) injects a fault the tests must catch:
``nan`` (a NaN in the reported weights), ``one_device`` (runs on one device whatever
``TFDIST_CPU_DEVICES`` says), ``inert_callback`` (the callback idioms' callbacks do nothing),
``outside_distribution`` (the regression idioms build their model outside ``tfdist.scope()``).
"""

from __future__ import annotations

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

trained_on.install()

BATCH = 16  # the global batch everywhere
N = 64
EPOCHS = 2
BACKEND = keras.backend.backend()

rng = np.random.default_rng(0)
X = rng.normal(size=(N, 4)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.1).astype("float32")
LABELS = (X[:, 0] > 0).astype("int32") + (X[:, 1] > 0).astype("int32")  # 3 classes
WEIGHTS = rng.uniform(0.5, 1.5, size=N).astype("float32")


# ---------------------------------------------------------------------------- models


def _set_weights(model):
    """The same starting weights on every topology, from a numpy generator."""
    local = np.random.default_rng(42)
    model.set_weights(
        [local.normal(scale=0.3, size=w.shape).astype(w.dtype) for w in model.get_weights()]
    )
    return model


def _scope():
    """``tfdist.scope()``; nothing under the ``outside_distribution`` fault."""
    import contextlib

    return contextlib.nullcontext() if faults.active("outside_distribution") else tfdist.scope()


def regression(optimizer=None, layers=None, **compile_kwargs):
    """``optimizer``, ``layers``: functions making them, called inside the scope (as the
    guides do: a layer's seed generator is a variable of the scope it is created in)."""
    with _scope():
        model = keras.Sequential(
            [
                keras.Input((4,)),
                *(layers() if layers else [keras.layers.Dense(8, activation="tanh")]),
                keras.layers.Dense(1),
            ]
        )
        _set_weights(model)
        model.compile(
            optimizer() if optimizer else keras.optimizers.SGD(0.05), "mse", **compile_kwargs
        )
    return model


def classifier(optimizer=None):
    with tfdist.scope():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
        )
        _set_weights(model)
        model.compile(
            optimizer() if optimizer else keras.optimizers.SGD(0.1),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def weights(model) -> list[float]:
    values = [float(v) for w in model.get_weights() for v in np.ravel(w)]
    if faults.active("nan"):
        values[0] = float("nan")
    return values


def callback(made):
    """The callback the idiom uses (one that does nothing under the inert_callback fault)."""
    return keras.callbacks.Callback() if faults.active("inert_callback") else made


def losses(history) -> list[float]:
    return [float(v) for v in history.history["loss"]]


def tf_dataset(*arrays):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(arrays if len(arrays) > 1 else arrays[0]).batch(BATCH)


# ---------------------------------------------------------------------------- inputs


def numpy_batch_size():
    model = regression()
    history = model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"weights": weights(model), "loss": losses(history)}


def numpy_shuffle_seeded():
    keras.utils.set_random_seed(7)
    model = regression()
    history = model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0)
    return {"weights": weights(model), "loss": losses(history)}


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return N // BATCH

    def __getitem__(self, index):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return X[rows], Y[rows]


def pydataset():
    model = regression()
    # fit shuffles a PyDataset's batch order with Python's global `random`, drawn in a
    # background thread: seeded here, as scripts do, so every process draws the same order.
    keras.utils.set_random_seed(11)
    history = model.fit(Batches(), epochs=EPOCHS, verbose=0)
    return {"weights": weights(model), "loss": losses(history)}


def generator():
    def batches():
        while True:
            for start in range(0, N, BATCH):
                yield X[start : start + BATCH], Y[start : start + BATCH]

    model = regression()
    history = model.fit(batches(), steps_per_epoch=N // BATCH, epochs=EPOCHS, verbose=0)
    return {"weights": weights(model), "loss": losses(history)}


def tf_data_tuples():
    model = regression()
    history = model.fit(tf_dataset(X, Y), epochs=EPOCHS, verbose=0)
    return {"weights": weights(model), "loss": losses(history)}


def tf_data_dict():
    with tfdist.scope():
        a, b = keras.Input((2,), name="a"), keras.Input((2,), name="b")
        hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([a, b]))
        model = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(hidden))
        _set_weights(model)
        model.compile(keras.optimizers.SGD(0.05), "mse")
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices(({"a": X[:, :2], "b": X[:, 2:]}, Y)).batch(BATCH)
    history = model.fit(data, epochs=EPOCHS, verbose=0)
    return {"weights": weights(model), "loss": losses(history)}


def sample_weight():
    model = regression()
    history = model.fit(
        X, Y, sample_weight=WEIGHTS, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    )
    return {"weights": weights(model), "loss": losses(history)}


def class_weight():
    model = classifier()
    history = model.fit(
        X,
        LABELS,
        class_weight={0: 1.0, 1: 2.0, 2: 0.5},
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
    )
    return {"weights": weights(model), "loss": losses(history)}


def validation_data_numpy():
    model = regression()
    history = model.fit(
        X,
        Y,
        validation_data=(X[:32], Y[:32]),
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
    )
    return {"weights": weights(model), "val_loss": [float(v) for v in history.history["val_loss"]]}


def validation_data_dataset():
    model = regression()
    history = model.fit(
        tf_dataset(X, Y), validation_data=tf_dataset(X[:32], Y[:32]), epochs=EPOCHS, verbose=0
    )
    return {"weights": weights(model), "val_loss": [float(v) for v in history.history["val_loss"]]}


def validation_split():
    model = regression()
    history = model.fit(
        X, Y, validation_split=0.25, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    )
    return {"weights": weights(model), "val_loss": [float(v) for v in history.history["val_loss"]]}


def evaluate_predict_numpy():
    model = regression()
    loss = model.evaluate(X, Y, batch_size=BATCH, verbose=0)
    predictions = model.predict(X, batch_size=BATCH, verbose=0)
    return {"loss": [float(loss)], "predictions": [float(v) for v in np.ravel(predictions)]}


def on_batch():
    model = regression()
    for start in range(0, N, BATCH):
        model.train_on_batch(X[start : start + BATCH], Y[start : start + BATCH])
    test = model.test_on_batch(X[:BATCH], Y[:BATCH])
    predicted = model.predict_on_batch(X[:BATCH])
    return {
        "weights": weights(model),
        "test_loss": [float(np.ravel(test)[0])],
        "predictions": [float(v) for v in np.ravel(predicted)],
    }


# ---------------------------------------------------------------------------- callbacks


def early_stopping():
    model = regression(lambda: keras.optimizers.SGD(0.2))
    stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1)
    history = model.fit(
        X, Y, batch_size=BATCH, epochs=6, shuffle=False, verbose=0, callbacks=[callback(stop)]
    )
    return {"weights": weights(model), "epochs_run": [len(history.history["loss"])]}


def reduce_lr_on_plateau():
    model = regression(lambda: keras.optimizers.SGD(0.05))
    plateau = keras.callbacks.ReduceLROnPlateau(
        monitor="loss", min_delta=10.0, patience=1, factor=0.5
    )
    model.fit(
        X, Y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[callback(plateau)]
    )
    return {
        "weights": weights(model),
        "lr": [float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))],
    }


def terminate_on_nan():
    model = regression(lambda: keras.optimizers.SGD(1e6))  # diverges to NaN within the first epoch
    history = model.fit(
        X,
        Y,
        batch_size=BATCH,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[callback(keras.callbacks.TerminateOnNaN())],
    )
    return {"epochs_run": [len(history.history["loss"])]}


def learning_rate_scheduler():
    model = regression()
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)
    model.fit(
        X,
        Y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[callback(schedule)],
    )
    return {
        "weights": weights(model),
        "lr": [float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))],
    }


# ---------------------------------------------------------------------------- optimizers


def _fit_regression(optimizer, **kwargs):
    model = regression(optimizer, **kwargs)
    model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"weights": weights(model)}


def clipnorm():
    return _fit_regression(lambda: keras.optimizers.Adam(1e-2, clipnorm=0.5))


def clipvalue():
    return _fit_regression(lambda: keras.optimizers.Adam(1e-2, clipvalue=0.05))


def global_clipnorm():
    return _fit_regression(lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.5))


def weight_decay():
    return _fit_regression(lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1))


def use_ema():
    return _fit_regression(lambda: keras.optimizers.Adam(1e-2, use_ema=True))


def use_ema_overwrite():
    return _fit_regression(
        lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=2)
    )


def gradient_accumulation():
    return _fit_regression(lambda: keras.optimizers.SGD(0.05, gradient_accumulation_steps=2))


def loss_scale_optimizer():
    return _fit_regression(lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)))


def _mixed(policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        return _fit_regression(lambda: keras.optimizers.SGD(0.05))
    finally:
        keras.mixed_precision.set_global_policy("float32")


def mixed_float16():
    return _mixed("mixed_float16")


def mixed_bfloat16():
    return _mixed("mixed_bfloat16")


def mixed_float16_settled():
    """mixed_float16 with a loss scale that does not overflow float16 on any batch split."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return _fit_regression(
            lambda: keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.05), initial_scale=128.0
            )
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")


def l2_regularizer():
    def layers():
        return [
            keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01))
        ]

    return _fit_regression(lambda: keras.optimizers.SGD(0.05), layers=layers)


# ---------------------------------------------------------------------------- layers


def embedding():
    with tfdist.scope():
        model = keras.Sequential(
            [
                keras.Input((3,), dtype="int32"),
                keras.layers.Embedding(10, 4),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        _set_weights(model)
        model.compile(keras.optimizers.SGD(0.05), "mse")
    ids = (np.abs(X[:, :3]) * 3).astype("int32") % 10
    model.fit(ids, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"weights": weights(model)}


def batch_norm():
    return _fit_regression(
        None, layers=lambda: [keras.layers.Dense(8), keras.layers.BatchNormalization()]
    )


def batch_norm_synchronized():
    return _fit_regression(
        None,
        layers=lambda: [keras.layers.Dense(8), keras.layers.BatchNormalization(synchronized=True)],
    )


def dropout_seeded():
    return _fit_regression(
        None,
        layers=lambda: [
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dropout(0.5, seed=3),
        ],
    )


# ---------------------------------------------------------------------------- models


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def subclassed_model():
    with tfdist.scope():
        model = Subclassed()
        model.build((None, 4))
        _set_weights(model)
        model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"weights": weights(model)}


def _custom_train_step_class():
    """The "Customizing what happens in fit()" guide's model, for this backend."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        class Custom(keras.Sequential):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.compute_loss(y=y, y_pred=y_pred)
                gradients = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(gradients, self.trainable_variables)
                return {"loss": loss}

        return Custom
    import jax

    class Custom(keras.Sequential):
        def compute_loss_and_updates(self, trainable, non_trainable, x, y, training=False):
            y_pred, non_trainable = self.stateless_call(
                trainable, non_trainable, x, training=training
            )
            loss = self.compute_loss(x, y, y_pred)
            return loss, (y_pred, non_trainable)

        def train_step(self, state, data):
            trainable, non_trainable, optimizer_vars, metrics_vars = state
            x, y = data
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, argnums=0, has_aux=True)
            (loss, (_, non_trainable)), grads = grad_fn(
                trainable, non_trainable, x, y, training=True
            )
            trainable, optimizer_vars = self.optimizer.stateless_apply(
                optimizer_vars, grads, trainable
            )
            return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)

    return Custom


def custom_train_step():
    custom = _custom_train_step_class()
    with tfdist.scope():
        model = custom(
            [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
        )
        _set_weights(model)
        model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"weights": weights(model)}


# ---------------------------------------------------------------------------- the list

# name -> (group, the idiom as the user writes it, function)
IDIOMS = {
    "numpy_batch_size": ("inputs", "fit(x, y, batch_size=16, shuffle=False)", numpy_batch_size),
    "numpy_shuffle_seeded": (
        "inputs",
        "set_random_seed, then fit(x, y, shuffle=True)",
        numpy_shuffle_seeded,
    ),
    "pydataset": ("inputs", "fit(keras.utils.PyDataset)", pydataset),
    "generator": ("inputs", "fit(generator, steps_per_epoch=...)", generator),
    "tf_data_tuples": ("inputs", "fit(tf.data of (x, y) batches)", tf_data_tuples),
    "tf_data_dict": ("inputs", "fit(tf.data of ({'a', 'b'}, y)), named inputs", tf_data_dict),
    "sample_weight": ("inputs", "fit(x, y, sample_weight=w)", sample_weight),
    "class_weight": ("inputs", "fit(x, y, class_weight={...})", class_weight),
    "validation_data_numpy": ("inputs", "fit(..., validation_data=(x, y))", validation_data_numpy),
    "validation_data_dataset": (
        "inputs",
        "fit(..., validation_data=tf.data)",
        validation_data_dataset,
    ),
    "validation_split": ("inputs", "fit(..., validation_split=0.25)", validation_split),
    "evaluate_predict_numpy": ("inputs", "evaluate(x, y), predict(x)", evaluate_predict_numpy),
    "on_batch": ("inputs", "train_on_batch / test_on_batch / predict_on_batch", on_batch),
    "early_stopping": ("callbacks", "EarlyStopping", early_stopping),
    "reduce_lr_on_plateau": ("callbacks", "ReduceLROnPlateau", reduce_lr_on_plateau),
    "terminate_on_nan": ("callbacks", "TerminateOnNaN", terminate_on_nan),
    "learning_rate_scheduler": ("callbacks", "LearningRateScheduler", learning_rate_scheduler),
    "clipnorm": ("optimizer", "Adam(clipnorm=0.5)", clipnorm),
    "clipvalue": ("optimizer", "Adam(clipvalue=0.05)", clipvalue),
    "global_clipnorm": ("optimizer", "Adam(global_clipnorm=0.5)", global_clipnorm),
    "weight_decay": ("optimizer", "AdamW(weight_decay=0.1)", weight_decay),
    "use_ema": ("optimizer", "Adam(use_ema=True)", use_ema),
    "use_ema_overwrite": (
        "optimizer",
        "Adam(use_ema=True, ema_overwrite_frequency=2)",
        use_ema_overwrite,
    ),
    "gradient_accumulation": (
        "optimizer",
        "SGD(gradient_accumulation_steps=2)",
        gradient_accumulation,
    ),
    "loss_scale_optimizer": ("optimizer", "LossScaleOptimizer(SGD)", loss_scale_optimizer),
    "mixed_float16": ("optimizer", "mixed_precision policy mixed_float16", mixed_float16),
    "mixed_float16_settled": (
        "optimizer",
        "mixed_float16 with LossScaleOptimizer(initial_scale=128)",
        mixed_float16_settled,
    ),
    "mixed_bfloat16": ("optimizer", "mixed_precision policy mixed_bfloat16", mixed_bfloat16),
    "l2_regularizer": ("optimizer", "Dense(kernel_regularizer=L2(0.01))", l2_regularizer),
    "embedding": ("layers", "Embedding", embedding),
    "batch_norm": ("layers", "BatchNormalization()", batch_norm),
    "batch_norm_synchronized": (
        "layers",
        "BatchNormalization(synchronized=True)",
        batch_norm_synchronized,
    ),
    "dropout_seeded": ("layers", "Dropout(0.5, seed=3)", dropout_seeded),
    "subclassed_model": ("models", "a subclassed keras.Model", subclassed_model),
    "custom_train_step": (
        "models",
        "a custom train_step (the guide's, per backend)",
        custom_train_step,
    ),
}


def topology() -> dict:
    """What this run trained on: replicas, workers, processes and this process's devices."""
    if BACKEND == "jax":
        import jax

        processes, local = jax.process_count(), jax.local_device_count()
    else:
        processes = tfdist.num_workers()
        try:
            local = len(tfdist.strategy().extended.worker_devices)
        except RuntimeError:  # the default strategy: one device
            local = 1
    return {
        "replicas": tfdist.num_replicas(),
        "workers": tfdist.num_workers(),
        "processes": processes,
        "local_devices": local,
    }


def run(names) -> dict:
    results = {}
    for name in names:
        trained_on.NOTED.clear()
        try:
            values = IDIOMS[name][2]()
            bad = [k for k, v in values.items() if not all(math.isfinite(x) for x in v)]
            results[name] = {
                "values": values,
                "nonfinite": bad,
                "trained_on": list(trained_on.NOTED),
            }
        except Exception as err:  # noqa: BLE001 - the test reports each idiom's error
            message = str(err).strip().splitlines()
            results[name] = {
                "error": f"{type(err).__name__}: {message[0] if message else ''}",
                "trace": traceback.format_exc()[-1500:],
            }
    return results


if __name__ == "__main__":
    chosen = sys.argv[1:] or list(IDIOMS)
    out = run(chosen)
    out["_topology"] = topology()
    out["_rank"] = tfdist.worker_index()
    trained_on.emit("IDIOMS", out)
