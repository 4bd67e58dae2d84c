"""Keras 3 on TensorFlow overwrites a model's weights with their moving average under a strategy (``keras_tf_ema_overwrite_under_strategy``).

Every private Keras/TensorFlow name used comes from ``tfdist.core.upstream``.

Example:
    >>> [fix.name for fix in FIXES]
    ['keras_tf_ema_overwrite_under_strategy']
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "KERAS_TF_EMA_OVERWRITE_UNDER_STRATEGY",
    "FIXES",
    "keras_tf_ema_overwrite_under_strategy",
]

# The fix's name, declared once (other layers import it).
KERAS_TF_EMA_OVERWRITE_UNDER_STRATEGY = "keras_tf_ema_overwrite_under_strategy"


# ------------------------------------------------- fix: EMA overwrite under a strategy


def _in_replica_context_of_a_strategy() -> bool:
    import tensorflow as tf

    return (
        tf.distribute.has_strategy()
        and not tf.distribute.in_cross_replica_context()
        and not tf.executing_eagerly()
    )


def keras_tf_ema_overwrite_under_strategy() -> None:
    """Makes ``use_ema`` with ``ema_overwrite_frequency`` work under a tf.distribute strategy.

    Upstream ``BaseOptimizer._backend_apply_gradients`` ends with the moving average of
    the weights and, every ``ema_overwrite_frequency`` updates, an ``ops.cond`` that
    overwrites the weights with that average. Under MirroredStrategy or
    MultiWorkerMirroredStrategy the step runs in replica context, where assigning a
    mirrored variable is a ``merge_call``, which is not allowed inside a cond branch:
    ``fit`` fails ("merge_call called while defining a new graph"). In that case only
    (replica context of a strategy, an overwrite frequency, no gradient accumulation,
    which ``keras_tf_gradient_accumulation`` handles), the fix runs upstream's own steps of
    the non-accumulating branch (clip, weight decay, ``_backend_update_step``, the moving
    average) and then the same condition and overwrite in one ``merge_call``, in
    cross-replica context, where each assignment updates every replica's copy with the
    same mirrored average: the weights one device gets. (Upstream's attribute cannot be
    switched off for the call: MirroredStrategy runs the replicas in threads that share
    the optimizer.) Otherwise upstream's code runs unchanged.
    """

    def make(original):
        def _backend_apply_gradients(self, grads, trainable_variables):
            if (
                not (self.use_ema and self.ema_overwrite_frequency)
                or self.gradient_accumulation_steps
                or not _in_replica_context_of_a_strategy()
            ):
                return original(self, grads, trainable_variables)
            # Upstream's non-accumulating branch, step for step.
            grads = upstream.keras_optimizer_clip(self, grads)
            upstream.keras_optimizer_apply_weight_decay(self, trainable_variables)
            upstream.keras_optimizer_update_step(self, grads, trainable_variables)
            upstream.keras_optimizer_ema_step(self)  # the overwrite in cross-replica context

        return _backend_apply_gradients

    patch(
        upstream.keras_base_optimizer_class(),
        "_backend_apply_gradients",
        KERAS_TF_EMA_OVERWRITE_UNDER_STRATEGY,
        make,
    )


# Module prefixes of the targets below.


_KB = "keras.src.optimizers.base_optimizer:"

FIXES: list[Fix] = [
    Fix(
        KERAS_TF_EMA_OVERWRITE_UNDER_STRATEGY,
        "Keras 3 Optimizer(use_ema=True, ema_overwrite_frequency=k) under Mirrored/Multi"
        "WorkerMirroredStrategy: 'merge_call called while defining a new graph'",
        on_keras_backend("tensorflow"),
        keras_tf_ema_overwrite_under_strategy,
        targets=targets(
            _KB + "BaseOptimizer._backend_apply_gradients",
            _KB + "BaseOptimizer._clip_gradients",
            _KB + "BaseOptimizer._apply_weight_decay",
            _KB + "BaseOptimizer._backend_update_step",
            _KB + "BaseOptimizer._update_model_variables_moving_average",
            _KB + "BaseOptimizer._overwrite_model_variables_with_average_value",
            _KB + "BaseOptimizer._trainable_variables (instance)",
            "keras.src.ops:cond",
        ),
        acts_where=(
            "Optimizer(use_ema=True, ema_overwrite_frequency=k), no gradient accumulation, "
            "applied in a traced replica function of a strategy; eagerly, no strategy: "
            "upstream's"
        ),
        no_harm=(),  # none yet
    ),
]
