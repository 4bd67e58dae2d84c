"""Keras 3 on TensorFlow accumulates gradients over steps under a strategy (``keras_tf_gradient_accumulation``).

Every private Keras/TensorFlow name used comes from ``tfdist.core.upstream``.

Example:
    >>> [fix.name for fix in FIXES]
    ['keras_tf_gradient_accumulation']
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.cross_replica import (
    accumulate_in_replica_context,
    consolidate_accumulators,
)
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["KERAS_TF_GRADIENT_ACCUMULATION", "FIXES", "keras_tf_gradient_accumulation"]

# The fix's name, declared once (other layers import it).
KERAS_TF_GRADIENT_ACCUMULATION = "keras_tf_gradient_accumulation"


# ------------------------------------------------- fix: gradient accumulation


def keras_tf_gradient_accumulation() -> None:
    """Makes ``gradient_accumulation_steps`` work under Mirrored/MultiWorkerMirrored.

    Upstream ``BaseOptimizer._backend_apply_gradients`` wraps "update" and
    "accumulate" in ``ops.cond`` in replica context, and both branches reach
    ``merge_call`` (the TF optimizer's all-reduce and variable updates). A
    ``merge_call`` inside a ``tf.cond`` branch is not allowed ("merge_call called while
    defining a new graph"), so any strategy with more than one replica fails.

    The fix keeps the same arithmetic, moves the synchronisation out of the cond, and
    communicates once per window instead of once per micro-step (Horovod's
    ``backward_passes_per_step``, DDP's ``no_sync``):

    1. in replica context, nothing is reduced: each replica forms ``acc_r + N * g_r``
       (its copy of the accumulator plus N times this step's local gradient, N the
       replica count);
    2. one ``merge_call``; in cross-replica context, ``tf.cond(is_update_step, ...)``
       either adds ``N * g_r`` to replica r's own copy of the accumulator (no
       communication), or, on the k-th micro-step, all-reduces (MEAN) those window sums
       once, divides by k, clips (``clipnorm``/``global_clipnorm`` see the global mean
       gradient, as on one device), applies weight decay and the optimizer update
       (``update_step`` on every variable, via ``extended.update``) and zeroes the
       accumulators.

    The loss is already scaled by 1/replicas, so the MEAN over replicas of N times the
    local window sums is the sum of the k global-batch gradients, and the update equals
    accumulation on one device with the same global batch. Between updates the copies of
    an accumulator differ; ``consolidate_accumulators`` sets each to their mean before
    every save (patched ``save_own_variables``; tfdist's own checkpoints), so a
    checkpoint written mid-window holds the window's sum so far, as one device's does,
    and resumes exactly on any number of replicas. Without a strategy, in
    cross-replica context, or eagerly (where upstream's ``merge_call`` inside
    ``ops.cond`` works), upstream's code runs unchanged.
    """

    def make(original):
        def _backend_apply_gradients(self, grads, trainable_variables):
            import tensorflow as tf

            if (
                not self.gradient_accumulation_steps
                or not tf.distribute.has_strategy()
                or tf.distribute.in_cross_replica_context()
                # Eagerly (strategy.run outside a tf.function) upstream's cond is a Python
                # branch and its merge_call works: upstream stays as it is there.
                or tf.executing_eagerly()
            ):
                return original(self, grads, trainable_variables)
            accumulate_in_replica_context(self, grads, trainable_variables)
            # Unchanged from upstream: the moving average of the weights, if asked for.
            upstream.keras_optimizer_ema_step(self)

        return _backend_apply_gradients

    # Set on the TensorFlow optimizer class (the original is found through its bases), so
    # it shadows BaseOptimizer's method for every Keras optimizer on this backend only.
    tf_optimizer = upstream.keras_tf_optimizer_module()
    patch(
        tf_optimizer.TFOptimizer, "_backend_apply_gradients", KERAS_TF_GRADIENT_ACCUMULATION, make
    )

    def make_save(original):
        def save_own_variables(self, store):
            # Every save of a Keras model (``save``, ``save_weights``, the callbacks)
            # writes the optimizer through here: mid-window, the copies are made equal
            # first, so the one copy saved is the window's sum (see above).
            consolidate_accumulators(self)
            return original(self, store)

        return save_own_variables

    patch(tf_optimizer.TFOptimizer, "save_own_variables", KERAS_TF_GRADIENT_ACCUMULATION, make_save)


_KO = "keras.src.backend.tensorflow.optimizer:"
_KB = "keras.src.optimizers.base_optimizer:"

FIXES: list[Fix] = [
    Fix(
        KERAS_TF_GRADIENT_ACCUMULATION,
        "Keras 3 Optimizer(gradient_accumulation_steps=k) under Mirrored/MultiWorker"
        "MirroredStrategy: 'merge_call called while defining a new graph'",
        on_keras_backend("tensorflow"),
        keras_tf_gradient_accumulation,
        targets=targets(
            _KO + "TFOptimizer._backend_apply_gradients",
            _KB + "BaseOptimizer.save_own_variables",
            _KO + "TFOptimizer._distributed_tf_update_step",
            _KB + "BaseOptimizer._get_variable_index",
            _KB + "BaseOptimizer._clip_gradients",
            _KB + "BaseOptimizer._use_weight_decay",
            _KB + "BaseOptimizer._update_model_variables_moving_average",
            _KB + "BaseOptimizer._overwrite_model_variables_with_average_value",
            _KB + "BaseOptimizer._accumulated_gradients (instance)",
            _KB + "BaseOptimizer._iterations (instance)",
            _KB + "BaseOptimizer._trainable_variables (instance)",
            "keras.src.backend:Variable",
        ),
        acts_where=(
            "Optimizer(gradient_accumulation_steps=k) applied in a traced replica function "
            "of a strategy, and its saves mid-window on >1 replica; eagerly, no strategy: "
            "upstream's"
        ),
        no_harm=(),  # none yet
    ),
]
