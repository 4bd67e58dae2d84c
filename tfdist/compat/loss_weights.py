"""A loss averaged on several TensorFlow replicas weighs each example as one device does
(``keras_tf_partial_batch_loss_weights``; the cut of the batches themselves:
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

import collections
import inspect
import weakref

from tfdist.compat.partial_batches import tensorflow as partial_batches
from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["KERAS_TF_PARTIAL_BATCH_LOSS_WEIGHTS", "FIXES", "keras_tf_partial_batch_loss_weights"]

# The fixes' names, declared once (other layers import them).
KERAS_TF_PARTIAL_BATCH_LOSS_WEIGHTS = "keras_tf_partial_batch_loss_weights"

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


# The fits running now, by strategy: a replica thread (MirroredStrategy runs the replica
# function in threads of its own, which do not see the fit's context variables) finds
# its fit's cut here. A stack per strategy: a callback may fit another model.
_FITS: collections.defaultdict[int, list] = collections.defaultdict(list)
# Models whose train function was made while their fit's data was cut as recorded here.
_TRAINED_WITH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _known_cut(strategy):
    """How the training data of the fit running now under ``strategy`` was cut, when its
    sizes and the dealing of its slices are known; else None."""
    fits = _FITS.get(id(strategy))
    return fits[-1].known if fits else None


def _local_share(cut, values, context):
    """The replica's share of the global batch, ``n_r * N / B``, from its own slice's size
    (no all-reduce); None when the cut does not tell, from a slice's size, which batch it
    was cut from (then the all-reduce decides)."""
    import tensorflow as tf

    replica = tf.get_static_value(context.replica_id_in_sync_group)
    if not cut.telling or replica is None:
        return None
    index = cut.slice_index(int(replica))
    local = tf.cast(tf.shape(values)[0], tf.int64)
    matches = [
        tf.where(tf.equal(local, cut.slice_size(size, index)), tf.constant(size, tf.int64), 0)
        for size in sorted(cut.sizes)
    ]
    batch = tf.add_n(matches)
    share = tf.math.divide_no_nan(
        tf.cast(local * cut.replicas, tf.float64), tf.cast(batch, tf.float64)
    )
    # A loss whose first axis is not this replica's slice (no size matches): upstream's.
    return tf.where(batch > 0, share, 1.0)


def _shared(loss, share):
    """``loss`` with its gradient scaled by ``share`` and its value unchanged."""
    import tensorflow as tf

    share = tf.cast(share, loss.dtype)
    fixed = tf.stop_gradient(loss)
    return fixed + share * (loss - fixed)


def keras_tf_partial_batch_loss_weights() -> None:
    """Weighs each replica's mean loss by its share of the global batch, for the gradient.

    Upstream, a replica's loss is ``sum_r / d_r / N`` (``d_r`` its count of entries, of
    valid entries under a mask, or its weight sum for ``mean_with_sample_weight``; ``N``
    replicas), and the gradients are summed: right only when every ``d_r`` is equal. One
    device computes ``sum / sum_r d_r``. The fix multiplies the gradient of the replica's
    loss by ``share = d_r * N / sum_r d_r``; the loss *value* is upstream's, so the loss
    and metric trackers (already weighted by each replica's batch size) are unchanged. So
    a partial last batch split unevenly, and a masked loss (padded sequences: each
    replica's valid tokens differ even in a full batch), train as on one device. When
    every replica has the same ``d_r`` the share is exactly 1.0 and the result is
    upstream's, bit for bit.

    What it costs: in ``fit``, an unweighted, unmasked loss on data whose batch sizes
    and order are known before training (arrays; a ``tf.data`` ``batch`` of known
    cardinality followed only by prefetch, cache or options) costs nothing more than
    upstream. The even-split fix cuts that data with tf.data's rebatch kernel and
    records how (``tfdist.core.batch_order.KnownCut``): when every batch divides by ``N`` the
    loss is upstream's, untouched; otherwise each replica reads the global batch ``B``
    from its own slice's size (slice sizes differ between batch sizes: 64 -> 128, 45 or
    44 -> 89) and scales by ``n_r * N / B``, with no communication. A masked or
    weighted loss (whose ``d_r`` the data decides), data whose sizes are not known (a
    ``map`` or ``filter`` after the batch, a generator), files sharded between workers,
    sizes a slice cannot tell apart (6 and 5 on 4 replicas: both give a first slice of
    2), a custom loop: the fix all-reduces ``d_r``, one scalar per loss per step.

    Where it acts: a Keras loss reduced by averaging in the replica function of a
    strategy with several replicas, in that function's own graph. Reductions that do not
    average (``sum``, ``none``), one replica, and a loss called inside a ``tf.cond`` or
    ``while`` branch or a nested ``tf.function`` (where a cross-replica all-reduce cannot
    be issued, and upstream is right for full batches) are left as upstream computes them,
    unless the share is known without an all-reduce (above), which holds there too.
    """

    def make(original):
        def reduce_weighted_values(
            values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None
        ):
            loss = original(values, sample_weight, mask, reduction, dtype)
            context = _replica_context_of_several()
            if context is None:
                return loss
            ops = upstream.keras_ops()
            reduction = upstream.keras_loss_module().standardize_reduction(reduction)
            values = ops.convert_to_tensor(values, dtype=dtype)
            if reduction not in _MEAN_REDUCTIONS or tuple(values.shape) in ((), (0,)):
                return loss
            cut = _known_cut(context.strategy)
            if (
                cut is not None
                and sample_weight is None
                and mask is None
                and None not in tuple(values.shape)[1:]
            ):
                if cut.even:  # every slice of every batch equal: upstream's is one device's
                    return loss
                share = _local_share(cut, values, context)
                if share is not None:
                    return _shared(loss, share)
            if not upstream.tf_can_reduce_across_replicas_here():
                return loss
            import tensorflow as tf

            if sample_weight is not None:
                sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
            if mask is not None:
                mask = ops.convert_to_tensor(mask, dtype=dtype)
            local = _divisor(values, sample_weight, mask, reduction)
            total = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
            return _shared(loss, tf.math.divide_no_nan(local * context.num_replicas_in_sync, total))

        return reduce_weighted_values

    patch(
        upstream.keras_loss_module(),
        "reduce_weighted_values",
        KERAS_TF_PARTIAL_BATCH_LOSS_WEIGHTS,
        make,
    )
    trainer = upstream.keras_tf_trainer_module().TensorFlowTrainer
    patch(trainer, "fit", KERAS_TF_PARTIAL_BATCH_LOSS_WEIGHTS, _make_fit)
    patch(trainer, "make_train_function", KERAS_TF_PARTIAL_BATCH_LOSS_WEIGHTS, _make_train_function)


def _make_fit(original):
    """``fit`` that lets the even-split fix record how it cuts the training data, and the
    loss fix find that record from the replica threads."""
    signature = inspect.signature(original)

    def fit(self, *args, **kwargs):
        training = partial_batches.training_input_of(signature, self, args, kwargs)
        fits = _FITS[id(self.distribute_strategy)]
        fits.append(training)
        try:
            with partial_batches.fit_cut(training):
                return original(self, *args, **kwargs)
        finally:
            fits.pop()
            if not fits:
                _FITS.pop(id(self.distribute_strategy), None)

    return fit


def _make_train_function(original):
    """``make_train_function`` that makes a new one when the training data is cut
    otherwise than when the last was made (its shares were traced for that cut)."""

    def make_train_function(self, force=False):
        known = _known_cut(self.distribute_strategy)
        if self.train_function is not None and _TRAINED_WITH.get(self) != known:
            force = True
        result = original(self, force)
        _TRAINED_WITH[self] = known
        return result

    return make_train_function


FIXES = [
    Fix(
        KERAS_TF_PARTIAL_BATCH_LOSS_WEIGHTS,
        "Keras 3 under a tf.distribute strategy averages the replicas' mean losses: a "
        "partial last batch split unevenly (64 + 24) weighs some examples more than one "
        "device does",
        on_keras_backend("tensorflow"),
        keras_tf_partial_batch_loss_weights,
        targets=targets(
            "keras.src.losses.loss:reduce_values",
            "keras.src.losses.loss:reduce_weighted_values",
            "keras.src.losses.loss:apply_mask",
            "keras.src.losses.loss:standardize_reduction",
            "keras.src.losses.loss:scale_loss_for_distribution",
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.fit",
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.make_train_function",
        ),
        acts_where=(
            "a mean-reduced Keras loss on >1 replica: in fit on known sizes unmasked, "
            "unweighted, uneven batches only, no all-reduce; else 1 all-reduce a step. "
            "sum/none, 1 replica: upstream's"
        ),
        no_harm=(
            "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes",
            "masked GRU",
            "sample weights",
            "conv, batches of 6",
            "conv, 74 at 16",
            "conv, 64 then 41 at 16",
            "tests/compat/test_no_harm.py::test_the_loss_fix_all_reduces_only_where_the_data_decides",
            "tests/compat/test_upstream_keras.py::test_keras_tests_fail_with_the_fixes_only_where_they_fail_without[tensorflow]",
        ),
    ),
]
