"""A Keras loss object's value given to ``add_loss`` (the endpoint-layer pattern) under a strategy.

Under a ``tf.distribute`` strategy of N replicas Keras divides a loss by N twice when a
layer adds the value of a Keras loss object (``self.add_loss(self.loss_fn(y, logits))``,
the "endpoint layer" of Keras's guides): once in the loss object
(``reduce_values`` calls ``scale_loss_for_distribution``) and once more when ``fit``
gathers the added losses (``TensorFlowTrainer._aggregate_additional_loss``). The
gradients are then 1/N of one device's (Adam's updates hide it; SGD's do not) and the
logged ``loss`` is 1/N of one device's (0.351 against 0.702 on 2 replicas).

``keras_tf_added_loss_scaled_once`` notes, per replica thread, the tensors that Keras's
scaling returned; ``_aggregate_additional_loss`` leaves such a tensor as it is (scaled
once, as every other loss), and scales every other added loss (regularizers, a loss the
user computed with ``ops``) as upstream does.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import threading

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["FIXES", "KERAS_TF_ADDED_LOSS_SCALED_ONCE", "keras_tf_added_loss_scaled_once"]

KERAS_TF_ADDED_LOSS_SCALED_ONCE = "keras_tf_added_loss_scaled_once"
# Per replica thread: the tensors (by id, kept alive here for the trace) that Keras's
# scale_loss_for_distribution returned.
_SCALED = threading.local()
_KEPT = 256


def keras_tf_added_loss_scaled_once() -> None:
    """Scales an added loss for the replicas once, not twice.

    Upstream's ``TensorFlowTrainer._aggregate_additional_loss`` sums an added loss and
    divides it by N; a loss object's value was divided already. The fix keeps the
    tensors ``scale_loss_for_distribution`` returned in this thread, and for one of
    them returns the sum without the second division (``Trainer``'s own aggregation).
    Every other added loss goes through upstream's code unchanged; without a strategy
    of several replicas neither function divides, and nothing changes.
    """
    loss_module = upstream.keras_loss_module()
    patch(
        loss_module, "scale_loss_for_distribution", KERAS_TF_ADDED_LOSS_SCALED_ONCE, _noting_scaled
    )
    trainer = upstream.keras_tf_trainer_module().TensorFlowTrainer
    patch(trainer, "_aggregate_additional_loss", KERAS_TF_ADDED_LOSS_SCALED_ONCE, _scaling_once)


def _noting_scaled(original):
    def scale_loss_for_distribution(value):
        scaled = original(value)
        if scaled is not value:  # divided: several replicas
            found = getattr(_SCALED, "tensors", None)
            if found is None or len(found) > _KEPT:  # a trace needs a few; eager runs many
                found = _SCALED.tensors = {}
            found[id(scaled)] = scaled
        return scaled

    return scale_loss_for_distribution


def _scaling_once(original):
    def _aggregate_additional_loss(self, loss):
        found = getattr(_SCALED, "tensors", None) or {}
        if found.get(id(loss)) is loss:
            return upstream.keras_sum_added_loss(self, loss)
        return original(self, loss)

    return _aggregate_additional_loss


FIXES = [
    Fix(
        KERAS_TF_ADDED_LOSS_SCALED_ONCE,
        "Keras 3 under a tf.distribute strategy divides a Keras loss object's value given to "
        "add_loss (an endpoint layer) by the replicas twice: 1/N of one device's gradient "
        "and logged loss",
        on_keras_backend("tensorflow"),
        keras_tf_added_loss_scaled_once,
        targets=targets(
            "keras.src.losses.loss:scale_loss_for_distribution",
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._aggregate_additional_loss",
            "keras.src.trainers.trainer:Trainer._aggregate_additional_loss",
        ),
        acts_where=(
            "fit/evaluate's sum of added losses, for a loss object's value added on >1 "
            "replica; regularizers and other added losses: upstream's"
        ),
        no_harm=(
            "tests/compat/test_added_losses.py::test_an_endpoint_layers_loss_equals_one_device",
        ),
    ),
]
