"""Custom metrics and losses of real users' scripts under multi-worker, vs one device.

Run as ``tfdist launch -n 2 [--no-fixes] mw_user_metrics.py``. Builds
``tf.distribute.MultiWorkerMirroredStrategy()`` itself, then fits and evaluates, in its
scope and without a strategy (one device, same global batch), a model with: a metric
whose ``result()`` returns its state variable (the Keras guide's example), a
dict-valued metric, a metric with several variables, a custom loss, and a
``train_step`` override with ``keras.metrics.Mean`` trackers.

Prints one JSON line: worker, error (None when fit/evaluate worked), largest
difference from the one-device run in history, evaluation and weights.
"""

import json

import equivalence
import numpy as np
import tensorflow as tf

from tfdist.core import cluster

mwms = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402

tf.config.experimental.enable_op_determinism()
GLOBAL_BATCH = 16
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = (x @ rng.normal(size=(4, 1)) > 0).astype("float32")


class BinaryTruePositives(keras.metrics.Metric):
    """The Keras guide's example: ``result()`` returns the state variable itself."""

    def __init__(self, name="tp", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), initializer="zeros", name="tp")

    def update_state(self, y_true, y_pred, sample_weight=None):
        hit = keras.ops.logical_and(y_true > 0.5, y_pred > 0.5)
        self.true_positives.assign_add(keras.ops.sum(keras.ops.cast(hit, "float32")))

    def result(self):
        return self.true_positives


class PositiveRate(keras.metrics.Metric):
    """Several variables, a dict result."""

    def __init__(self, name="rate", **kwargs):
        super().__init__(name=name, **kwargs)
        self.positives = self.add_variable(shape=(), initializer="zeros", name="pos")
        self.seen = self.add_variable(shape=(), initializer="zeros", name="seen")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.positives.assign_add(keras.ops.sum(keras.ops.cast(y_pred > 0.5, "float32")))
        self.seen.assign_add(keras.ops.cast(keras.ops.shape(y_pred)[0], "float32"))

    def result(self):
        return {"positive_rate": self.positives / self.seen, "seen": self.seen}


def squared_hinge(y_true, y_pred):
    """A custom loss: a plain function returning one loss per sample, as Keras asks."""
    hinge = keras.ops.relu(1.0 - (2 * y_true - 1) * y_pred)
    return keras.ops.mean(keras.ops.square(hinge), axis=-1)


class Tracked(keras.Model):
    """The Keras guide's custom ``train_step`` with ``keras.metrics.Mean`` trackers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_tracker = keras.metrics.MeanAbsoluteError(name="mae")

    def call(self, inputs):
        return self.dense(inputs)

    def train_step(self, data):
        xb, yb = data
        with tf.GradientTape() as tape:
            pred = self(xb, training=True)
            loss = self.compute_loss(y=yb, y_pred=pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        self.loss_tracker.update_state(loss)
        self.mae_tracker.update_state(yb, pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_tracker.result()}

    def test_step(self, data):
        xb, yb = data
        self.mae_tracker.update_state(yb, self(xb, training=False))
        return {"mae": self.mae_tracker.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_tracker]


def build(kind):
    keras.utils.set_random_seed(0)
    if kind == "tracked":
        model = Tracked()
        model(np.zeros((1, 4), "float32"))  # weights made now, from the seed, in any scope
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=squared_hinge)
        return model
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    metrics = [
        BinaryTruePositives(),
        PositiveRate(),
        keras.metrics.MeanMetricWrapper(lambda t, p: p, name="mean_pred"),
    ]
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=squared_hinge, metrics=metrics)
    return model


def run(model):
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    logs = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    return history.history, logs, model.get_weights()


def raveled(logs: dict) -> dict:
    """Each logged value as a 1-d array (a scalar and a 1-element list compare alike)."""
    return {k: np.ravel(np.asarray(v, dtype=float)) for k, v in logs.items()}


def compare(kind):
    with mwms.scope():
        model = build(kind)
    try:
        history, logs, weights = run(model)
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(err).__name__}: {str(err)[:400]}"}
    ref_history, ref_logs, ref_weights = run(build(kind))
    return {
        "error": None,
        "keys": sorted(history),
        # compute_loss() returns the loss scaled by 1/replicas under any strategy (for
        # the gradient), so a custom train_step's tracker records it scaled, upstream
        # too on one machine: compared as a ratio, the rest as values.
        "history": equivalence.max_difference(
            {k: v for k, v in ref_history.items() if k != "loss"},
            {k: v for k, v in history.items() if k != "loss"},
        ),
        "loss_ratio": float(np.mean(np.array(history["loss"]) / np.array(ref_history["loss"]))),
        "evaluate": equivalence.max_difference(raveled(ref_logs), raveled(logs)),
        "weights": equivalence.max_difference(ref_weights, weights),
        "tp": ref_logs.get("tp"),
    }


print(
    json.dumps(
        {
            "worker": cluster.cluster_from_env().rank,
            "compiled": compare("compiled"),
            "tracked": compare("tracked"),
        }
    ),
    flush=True,
)
