"""``LossScaleOptimizer`` (mixed_float16) under a tf.distribute strategy: one skip decision.

Every private Keras name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "KERAS_TF_LOSS_SCALE_FINITE_EVERYWHERE",
    "FIXES",
    "keras_tf_loss_scale_finite_everywhere",
]

# The fixes' names, declared once (other layers import them).
KERAS_TF_LOSS_SCALE_FINITE_EVERYWHERE = "keras_tf_loss_scale_finite_everywhere"


def _several_replicas(context) -> bool:
    return context is not None and context.num_replicas_in_sync > 1


def keras_tf_loss_scale_finite_everywhere() -> None:
    """Makes every replica of every worker take the same loss-scale decision.

    ``LossScaleOptimizer`` (what Keras wraps the optimizer in under ``mixed_float16``)
    skips a step and halves its loss scale when a gradient is not finite. On the
    TensorFlow backend it decides from ``check_finite`` of each replica's own gradient,
    before any all-reduce (its comment assumes the gradients are already all-reduced;
    in Keras 3 they are not), and under MirroredStrategy takes the first replica's
    answer. So a replica whose part of the batch overflowed float16 while the first did
    not puts inf into the all-reduced update (the weights become NaN), and under
    MultiWorkerMirroredStrategy two workers that decide differently stop in different
    collectives: the job hangs (measured: 2 workers, mixed_float16, the default loss
    scale 32768: both wait forever in the first step). One device skips when the whole
    batch's gradient is not finite, and a sum is not finite when a part is not. The fix
    keeps upstream's check on each replica and all-reduces the count of replicas that
    found a non-finite gradient: every replica of every worker then skips, or applies,
    together. With one replica, or without a strategy, upstream's check stands unchanged.
    """

    def make(original):
        def check_finite(self, grads):
            import tensorflow as tf

            finite = original(self, grads)
            if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
                return finite
            context = tf.distribute.get_replica_context()
            if not _several_replicas(context):
                return finite
            bad = tf.cast(tf.logical_not(tf.convert_to_tensor(finite)), tf.float32)
            return tf.equal(context.all_reduce(tf.distribute.ReduceOp.SUM, bad), 0.0)

        return check_finite

    patch(
        upstream.keras_loss_scale_optimizer_class(),
        "check_finite",
        KERAS_TF_LOSS_SCALE_FINITE_EVERYWHERE,
        make,
    )


FIXES = [
    Fix(
        KERAS_TF_LOSS_SCALE_FINITE_EVERYWHERE,
        "Keras 3 LossScaleOptimizer (mixed_float16) under a tf.distribute strategy decides "
        "to skip a step from one replica's own gradient: inf reaches the weights, and two "
        "workers that decide differently hang",
        on_keras_backend("tensorflow"),
        keras_tf_loss_scale_finite_everywhere,
        targets=targets(
            "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer.check_finite",
            "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer._tf_apply",
        ),
        acts_where=(
            "LossScaleOptimizer.check_finite in the replica context of a strategy with >1 "
            "replica; otherwise upstream's check"
        ),
        no_harm=(),  # none yet
    ),
]
