"""``evaluate`` and ``predict`` on a batch with fewer examples than replicas (TensorFlow).

One image predicted on 2 replicas, or a last batch of one example, leaves a replica with
no example. Keras runs the model on that empty batch, and TensorFlow's CPU kernels fail
on it: a Conv2D then BatchNormalization raises "Incompatible shapes: [8] vs.
[0,32,32,3]", a Conv1D "input depth must be evenly divisible by filter depth: 1 vs 32".
One device has no empty batch, so it predicts and evaluates the same data.

* ``keras_tf_evaluate_predict_empty_replicas``: in Keras's own ``test_step`` and
  ``predict_step`` on more than one replica, a replica whose batch is empty runs the
  model on one stand-in row of zeros and keeps none of its outputs (``y_pred[:0]``). The
  loss and metrics then see exactly what upstream gives them: no example. A replica with
  examples concatenates nothing and runs as upstream. Training still refuses such a batch
  (``partial_batches.tensorflow.keras_tf_fit_refuses_empty_replicas``).

The model runs in inference mode there (``training=False``): BatchNormalization uses its
moving statistics and Dropout is off, so the stand-in row changes no state.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["FIXES", "KERAS_TF_EVALUATE_PREDICT_EMPTY_REPLICAS"]

KERAS_TF_EVALUATE_PREDICT_EMPTY_REPLICAS = "keras_tf_evaluate_predict_empty_replicas"


def _replicas() -> int:
    """The replicas of the strategy whose replica context this trace runs in (else 1)."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    return 1 if context is None else int(context.num_replicas_in_sync)


def _padded(x):
    """``x`` with one row of zeros appended where its batch is empty, and the batch size.

    None when a leaf is not a dense tensor with a batch axis (ragged, sparse, scalars):
    those keep upstream's path.
    """
    import tensorflow as tf

    tree = upstream.keras_tree()
    leaves = [leaf for leaf in tree.flatten(x) if leaf is not None]
    if not leaves or not all(_dense_batched(leaf) for leaf in leaves):
        return None
    size = tf.shape(leaves[0])[0]
    missing = tf.maximum(1 - size, 0)  # 1 on an empty replica, else 0: no row added

    def pad(leaf):
        if leaf is None:
            return None
        filler = tf.zeros(tf.concat([[missing], tf.shape(leaf)[1:]], 0), leaf.dtype)
        return tf.concat([leaf, filler], 0)

    return tree.map_structure(pad, x, none_is_leaf=True), size


def _dense_batched(leaf) -> bool:
    import tensorflow as tf

    return isinstance(leaf, tf.Tensor) and leaf.shape.rank is not None and leaf.shape.rank >= 1


def _forward(model, x):
    """``model(x)`` in inference, as upstream's steps call it; on an empty replica the
    model sees one stand-in row and its outputs keep none."""
    tree = upstream.keras_tree()

    def call(inputs):
        if model._call_has_training_arg:
            return model(inputs, training=False)
        return model(inputs)

    padded = _padded(x) if _replicas() > 1 else None
    if padded is None:
        return call(x)
    inputs, size = padded
    return tree.map_structure(lambda out: out[:size], call(inputs))


def _test_step(original):
    def test_step(self, data):
        if _replicas() <= 1:
            return original(self, data)
        # Upstream's test_step (keras/src/backend/tensorflow/trainer.py), with the model's
        # call through _forward: every other line is upstream's.
        import tensorflow as tf

        tree = upstream.keras_tree()
        x, y, sample_weight = upstream.keras_unpack_x_y_sample_weight(data)
        y_pred = _forward(self, x)
        loss = self._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
        )
        self._loss_tracker.update_state(
            upstream.keras_loss_module().unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0],
        )
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return test_step


def _predict_step(original):
    def predict_step(self, data):
        if _replicas() <= 1:
            return original(self, data)
        x, _, _ = upstream.keras_unpack_x_y_sample_weight(data)
        return _forward(self, x)

    return predict_step


def keras_tf_evaluate_predict_empty_replicas() -> None:
    """Runs an empty replica's ``evaluate`` and ``predict`` step on one stand-in row.

    Upstream runs the model on a replica's share of each batch, and a batch with fewer
    examples than replicas gives some replica no example, on which TensorFlow's Conv and
    BatchNormalization kernels fail. Only Keras's own ``TensorFlowTrainer.test_step`` and
    ``predict_step`` are replaced (a model that overrides them keeps its own), and only on
    more than one replica: one device calls upstream's step unchanged. The replacement is
    upstream's step with the model's call through ``_forward``; the loss, the loss tracker
    and the metrics see the replica's real rows only, none on an empty replica.
    """
    trainer = upstream.keras_tf_trainer_module().TensorFlowTrainer
    patch(trainer, "test_step", KERAS_TF_EVALUATE_PREDICT_EMPTY_REPLICAS, _test_step)
    patch(trainer, "predict_step", KERAS_TF_EVALUATE_PREDICT_EMPTY_REPLICAS, _predict_step)


_TRAINER = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer."

FIXES = [
    Fix(
        KERAS_TF_EVALUATE_PREDICT_EMPTY_REPLICAS,
        "Keras evaluate and predict under a tf.distribute strategy on a batch with fewer "
        "examples than replicas (one image on 2 replicas, a last batch of one): the empty "
        "replica's Conv or BatchNormalization kernel fails ('Incompatible shapes: [8] vs. "
        "[0,32,32,3]')",
        on_keras_backend("tensorflow"),
        keras_tf_evaluate_predict_empty_replicas,
        targets=targets(
            _TRAINER + "test_step",
            _TRAINER + "predict_step",
            "keras.src.losses.loss:unscale_loss_for_distribution",
            "keras.src.trainers.data_adapters.data_adapter_utils:unpack_x_y_sample_weight",
        ),
        acts_where=(
            "Keras's own test_step and predict_step on >1 replica: an empty replica's model "
            "call runs on one stand-in row whose outputs are dropped; replicas with "
            "examples and one device: upstream's"
        ),
        no_harm=(
            "tests/compat/test_empty_replicas.py::test_small_batches_evaluate_and_predict_as_one_device",
        ),
    ),
]
