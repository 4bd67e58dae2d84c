"""A loss averaged on several TensorFlow replicas weighs each example as one device does
(``keras_partial_batch_loss_weights``; the cut of the batches themselves:
``partial_batches``).

Keras averages each replica's loss over its own examples (its own valid tokens, under a
mask) and scales it by ``1 / num_replicas``, so the gradient is the mean of the replicas'
means: with a partial last batch split 64 + 24, each of the 24 examples weighs 64/24 times
one of the others (measured: the TensorFlow tutorial's model 2.2e-3 away from one device
after one epoch of 7000 examples; a masked GRU 7.2e-4 after 2 epochs, full batches
included).

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["FIXES", "fix_loss_weights"]

# Keras's reductions that divide a sum by a count or a weight sum (keras.src.losses.loss).
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def _replica_context_of_several():
    """The replica context when this code runs in one of several replicas, else None."""
    import tensorflow as tf

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1:
        return None
    return context


def _count(tensor):
    ops = upstream.keras_ops()
    return ops.cast(ops.prod(ops.convert_to_tensor(ops.shape(tensor), dtype="int32")), "float32")


def _divisor(values, sample_weight, mask, reduction):
    """What upstream divides this replica's weighted sum by, in effect: its weight sum
    (``mean_with_sample_weight``), its count of valid entries (a mask: Keras rescales the
    weights by ``total / valid``, so the sum is divided by ``valid``), or its count."""
    ops = upstream.keras_ops()
    module = upstream.keras_loss_module()
    if reduction == "mean_with_sample_weight":
        weights = module.apply_mask(sample_weight, mask, dtype=values.dtype, reduction=reduction)
        return _count(values) if weights is None else ops.cast(ops.sum(weights), "float32")
    if mask is not None:  # sum(v * total_mask / valid) / total_values
        valid = ops.sum(ops.cast(mask, "float32"))
        return _count(values) * valid / _count(mask)
    return _count(values)


def fix_loss_weights() -> None:
    """Weighs each replica's mean loss by its share of the global batch, for the gradient.

    Upstream, a replica's loss is ``sum_r / d_r / N`` (``d_r`` its count of entries, of
    valid entries under a mask, or its weight sum for ``mean_with_sample_weight``; ``N``
    replicas), and the gradients are summed: right only when every ``d_r`` is equal. One
    device computes ``sum / sum_r d_r``. The fix all-reduces ``d_r`` (one scalar) and
    multiplies the gradient of the replica's loss by ``share = d_r * N / sum_r d_r``; the
    loss *value* is upstream's, so the loss and metric trackers (already weighted by each
    replica's batch size) are unchanged. So a partial last batch split unevenly, and a
    masked loss (padded sequences: each replica's valid tokens differ even in a full
    batch), train as on one device. When every replica has the same ``d_r`` the share is
    exactly 1.0 and the result is upstream's, bit for bit.

    Where it acts: a Keras loss reduced by averaging in the replica function of a
    strategy with several replicas, in that function's own graph. Reductions that do not
    average (``sum``, ``none``), one replica, and a loss called inside a ``tf.cond`` or
    ``while`` branch or a nested ``tf.function`` (where a cross-replica all-reduce cannot
    be issued, and upstream is right for full batches) are left as upstream computes them.
    """

    def make(original):
        def reduce_weighted_values(
            values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None
        ):
            loss = original(values, sample_weight, mask, reduction, dtype)
            context = _replica_context_of_several()
            if context is None or not upstream.tf_can_reduce_across_replicas_here():
                return loss
            ops = upstream.keras_ops()
            reduction = upstream.keras_loss_module().standardize_reduction(reduction)
            values = ops.convert_to_tensor(values, dtype=dtype)
            if reduction not in _MEAN_REDUCTIONS or tuple(values.shape) in ((), (0,)):
                return loss
            import tensorflow as tf

            if sample_weight is not None:
                sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
            if mask is not None:
                mask = ops.convert_to_tensor(mask, dtype=dtype)
            local = _divisor(values, sample_weight, mask, reduction)
            total = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
            share = tf.math.divide_no_nan(local * context.num_replicas_in_sync, total)
            share = tf.cast(share, loss.dtype)
            fixed = tf.stop_gradient(loss)
            return fixed + share * (loss - fixed)

        return reduce_weighted_values

    patch(
        upstream.keras_loss_module(),
        "reduce_weighted_values",
        "keras_partial_batch_loss_weights",
        make,
    )


FIXES = [
    Fix(
        "keras_partial_batch_loss_weights",
        "Keras 3 under a tf.distribute strategy averages the replicas' mean losses: a "
        "partial last batch split unevenly (64 + 24) weighs some examples more than one "
        "device does",
        on_keras_backend("tensorflow"),
        fix_loss_weights,
        targets=targets(
            "keras.src.losses.loss:reduce_values",
            "keras.src.losses.loss:reduce_weighted_values",
            "keras.src.losses.loss:apply_mask",
            "keras.src.losses.loss:standardize_reduction",
            "keras.src.losses.loss:scale_loss_for_distribution",
        ),
        acts_where=(
            "a Keras loss with a mean reduction in the replica function of a strategy with "
            ">1 replica; sum/none, one replica, a loss in tf.cond/while/nested tf.function: "
            "upstream's"
        ),
        no_harm=(
            "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes",
            "masked GRU",
            "sample weights",
            "conv, batches of 6",
            "tests/compat/test_upstream_keras.py::test_keras_tests_fail_with_the_fixes_only_where_they_fail_without[tensorflow]",
        ),
    ),
]
