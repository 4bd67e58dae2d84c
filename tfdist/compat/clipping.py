"""Gradient clipping under Mirrored/MultiWorkerMirrored: the global gradient, clipped once.

Keras 3 on TensorFlow clips (``clipnorm``, ``clipvalue``, ``global_clipnorm``) in replica
context, before its optimizer all-reduces: each replica clips its own part of the batch's
gradient, so N replicas sum N clipped parts where one device clips the sum. Training runs
and silently ends elsewhere (``Adam(1e-2, global_clipnorm=0.5)``: ~1e-2 after 2 epochs on
2 replicas). The fix ``keras_tf_clip_after_all_reduce`` all-reduces first, clips once, and
updates without a second reduction; without clipping, with one replica, or with gradient
accumulation (``keras_tf_gradient_accumulation`` already reduces before it clips) upstream's
code runs unchanged.

Example:
    >>> from tfdist.compat import clipping
    >>> [fix.name for fix in clipping.FIXES]
    ['keras_tf_clip_after_all_reduce']
"""

from __future__ import annotations

from tfdist.core import cross_replica, upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "FIXES",
    "KERAS_TF_CLIP_AFTER_ALL_REDUCE",
    "keras_tf_clip_after_all_reduce",
    "clips_per_replica_upstream",
]

KERAS_TF_CLIP_AFTER_ALL_REDUCE = "keras_tf_clip_after_all_reduce"
_PATCHED = "_backend_apply_gradients"


def _clipping(optimizer) -> bool:
    """Whether upstream's ``_clip_gradients`` changes anything (its own three tests)."""
    limits = (optimizer.clipnorm, optimizer.global_clipnorm, optimizer.clipvalue)
    return any(limit and limit > 0 for limit in limits)


def clips_per_replica_upstream(optimizer) -> bool:
    """Whether upstream would clip one replica's part of the gradient in this ``apply``.

    True in the replica context of a ``MirroredStrategy`` or
    ``MultiWorkerMirroredStrategy`` with more than one replica, for an optimizer that
    clips and does not accumulate gradients.

    Example:
        >>> clips_per_replica_upstream(keras.optimizers.Adam(global_clipnorm=1.0))  # doctest: +SKIP
        False
    """
    import tensorflow as tf

    if not _clipping(optimizer) or optimizer.gradient_accumulation_steps:
        return False
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return False
    # The strategies verified; others (TPU, parameter servers) keep upstream's code.
    verified = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
    if not isinstance(tf.distribute.get_strategy(), verified):
        return False
    return tf.distribute.get_replica_context().num_replicas_in_sync > 1


def _apply_global_clipped(optimizer, grads, variables) -> None:
    """All-reduce, clip, then weight decay and update in cross-replica context."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    # The loss is scaled by 1/replicas, so the sum is the global batch's gradient (what
    # upstream's own all-reduce computes, one step later).
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))
    clipped = upstream.keras_optimizer_clip(optimizer, summed)

    def update(distribution, clipped):
        cross_replica.cross_replica_apply(optimizer, distribution, clipped, variables)

    upstream.tf_maybe_merge_call(update, tf.distribute.get_strategy(), clipped)


def keras_tf_clip_after_all_reduce() -> None:
    """Clips the all-reduced gradient under Mirrored/MultiWorkerMirrored, as on one device.

    Upstream ``BaseOptimizer._backend_apply_gradients`` runs in replica context: it
    clips (``_clip_gradients``), applies weight decay, then ``_backend_update_step``
    all-reduces (SUM) and updates. Under more than one replica each replica clips its
    own part of the gradient, and the sum of clipped parts is not the clipped sum: a
    norm limit reached by the batch's gradient may not be reached by its halves, and
    ``clipvalue`` caps each part instead of the total. No error; different weights.

    The fix replaces that method on ``keras.optimizers.Optimizer`` (the base of every
    Keras optimizer) for the case ``clips_per_replica_upstream`` names: in replica
    context it all-reduces (SUM) the gradients, the value upstream's update would have
    used, then clips it once with the optimizer's own ``_clip_gradients``, then in one
    ``merge_call`` applies weight decay and the optimizer's update to every variable
    (``cross_replica.cross_replica_apply``, no second reduction), then the moving
    average (``use_ema``) as upstream. Unscaling (``loss_scale_factor``, and
    ``LossScaleOptimizer`` before it calls its inner optimizer) happens in ``apply``
    before this method, so the clip sees unscaled gradients, as on one device. The
    loss is scaled by 1/replicas, so the sum is the global batch's gradient and the
    clip, decay and update are the ones one device computes.

    Without clipping, with one replica, with gradient accumulation (handled by
    ``keras_tf_gradient_accumulation``, which also reduces before clipping) or under
    another strategy, the next implementation in line runs unchanged.
    """
    import keras

    owner = keras.optimizers.Optimizer
    owned = _PATCHED in vars(owner)  # Keras 3.15: inherited from TFOptimizer/BaseOptimizer

    def make(original):
        def inherited(self, grads, trainable_variables):
            if owned:
                return original(self, grads, trainable_variables)
            # Looked up at call time: keras_tf_gradient_accumulation's patch of TFOptimizer is
            # found whichever of the two fixes was applied first.
            return getattr(super(owner, self), _PATCHED)(grads, trainable_variables)

        def _backend_apply_gradients(self, grads, trainable_variables):
            if not clips_per_replica_upstream(self):
                return inherited(self, grads, trainable_variables)
            _apply_global_clipped(self, grads, trainable_variables)
            upstream.keras_optimizer_ema_step(self)

        return _backend_apply_gradients

    patch(owner, _PATCHED, KERAS_TF_CLIP_AFTER_ALL_REDUCE, make)


_KOPT = "keras.src.optimizers."
_KO = "keras.src.backend.tensorflow.optimizer:TFOptimizer."
_KB = _KOPT + "base_optimizer:BaseOptimizer."

FIXES: list[Fix] = [
    Fix(
        KERAS_TF_CLIP_AFTER_ALL_REDUCE,
        "Keras 3 under Mirrored/MultiWorkerMirroredStrategy clips (clipnorm, clipvalue, "
        "global_clipnorm) each replica's gradient before the all-reduce: weights differ "
        "from one device's, silently",
        on_keras_backend("tensorflow"),
        keras_tf_clip_after_all_reduce,
        targets=targets(
            # First (tests/core/test_fix_guards.py removes each fix's first target): the upstream
            # step whose all-reduce comes after the clip; keras_tf_gradient_accumulation's
            # first target is the method both fixes replace.
            _KO + "_backend_update_step",
            _KOPT + "optimizer:Optimizer._backend_apply_gradients",
            _KB + "_backend_apply_gradients",
            _KB + "apply",
            _KB + "_clip_gradients",
            _KB + "_use_weight_decay",
            _KB + "_update_model_variables_moving_average",
            _KB + "_overwrite_model_variables_with_average_value",
            _KB + "_trainable_variables (instance)",
            _KO + "_apply_weight_decay",
            _KO + "_distributed_tf_update_step",
            _KOPT + "loss_scale_optimizer:LossScaleOptimizer._stateful_handle_finite_grads",
            "keras.src.backend:Variable",
            "tensorflow.python.distribute.merge_call_interim:maybe_merge_call",
        ),
        acts_where=(
            "clipnorm/clipvalue/global_clipnorm, no gradient accumulation, in the replica "
            "context of (MultiWorker)MirroredStrategy with >1 replica; otherwise upstream's "
            "path"
        ),
        no_harm=(),  # none yet
    ),
]
