"""A partial last batch on several replicas: each example weighs what it weighs on one
device (TensorFlow and JAX), and tf.distribute hands no replica an empty share it can avoid.

Real datasets leave a partial last global batch (MNIST's 60000 examples at 128: 96).
``tf.distribute`` splits it between the replicas unevenly (64 + 24 of 88 on 2 replicas
when it finds the dataset's batch size: a replica's share is filled first) and hands a
replica no example at all when the batch is at most one replica's share (56 -> 56 + 0).
Two upstream defects follow, each fixed here:

* ``keras_partial_batch_loss_weights``: Keras averages each replica's loss over its own
  examples (its own valid tokens, under a mask) and scales it by ``1 / num_replicas``,
  so the gradient is the mean of the replicas' means: with 64 + 24, each of the 24
  examples weighs 64/24 times one of the others (measured: the TensorFlow tutorial's
  model 2.2e-3 away from one device after one epoch of 7000 examples; a masked GRU
  7.2e-4 after 2 epochs, full batches included).
* ``tf_distribute_partial_batch_evenly``: a replica handed no example aborts the process
  in oneDNN's MaxPool gradient (``Check failed: dtype() == expected_dtype``; an empty
  batch does so on one device too) and, with a Conv2D + ReLU before it, fails in oneDNN's
  fused kernels. The fix cuts every batch into ``ceil(B / N)``-sized slices (TF's own
  legacy rebatch), so on 2 replicas a replica is empty only for a batch of 1 (then a
  model whose kernels cannot take an empty batch still fails there: see docs/data.md).

On JAX a global batch is one array over every device, so one process computes one
device's loss; with several processes Keras feeds each its part of a ``tf.data`` batch by
``rebatch(global / processes)`` then ``shard``, which cuts the partial last batch into
one full part and a short one (40 of 64 -> 32 + 8): the processes then assemble arrays of
different global shapes and train apart, silently (measured: 2e-2 from one device).

* ``keras_jax_partial_batch_share``: each process takes its equal, contiguous part of
  every global batch, the partial one too; a batch that cannot be split evenly between
  the data-parallel replicas stops the job with an error naming its size. The parts are
  cut from each batch as it comes, so a dataset whose batch size only the data knows
  (batch then ``map``, ``class_weight``, ``padded_batch``, a generator), which upstream
  refuses ("The batch size of the input dataset is unknown"), is fed too.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import math

from tfdist.compat import jax_inputs
from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, on_tensorflow_backend, patch, targets

__all__ = [
    "FIXES",
    "fix_loss_weights",
    "fix_even_split",
    "fix_jax_process_share",
    "split_evenly",
    "split_balanced",
    "process_share",
]

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


def split_evenly(dataset, pieces: int):
    """Each batch of ``dataset`` as ``pieces`` consecutive slices of ``ceil(size /
    pieces)`` examples, the last ones shorter (88 in 2 -> 44 + 44, 89 -> 45 + 44): TF's own
    legacy rebatch, which its auto-sharding between workers knows.

    Example:
        >>> import tensorflow as tf
        >>> ds = split_evenly(tf.data.Dataset.range(5).batch(5), 2)
        >>> [len(piece) for piece in ds]  # doctest: +SKIP
        [3, 2]
    """
    return upstream.tf_legacy_rebatch(dataset, pieces)


def split_balanced(dataset, pieces: int):
    """Each batch of ``dataset`` as ``pieces`` consecutive slices whose sizes differ by at
    most one, the larger first (6 in 4 -> 2 + 2 + 1 + 1, 9 -> 3 + 2 + 2 + 2): a replica is
    empty only when the batch has fewer examples than there are replicas.

    Example:
        >>> import tensorflow as tf
        >>> ds = split_balanced(tf.data.Dataset.range(6).batch(6), 4)
        >>> [len(piece) for piece in ds]  # doctest: +SKIP
        [2, 2, 1, 1]
    """
    import tensorflow as tf

    def cut(*batch):
        element = batch[0] if len(batch) == 1 else batch
        size = tf.shape(tf.nest.flatten(element)[0], out_type=tf.int64)[0]
        base, extra = size // pieces, size % pieces

        def piece(i):
            start = i * base + tf.minimum(i, extra)
            length = base + tf.cast(i < extra, tf.int64)
            return tf.nest.map_structure(lambda t: t[start : start + length], element)

        return tf.data.Dataset.range(pieces).map(piece)

    return dataset.flat_map(cut)


def _splittable(dataset) -> bool:
    """Every component a dense tensor with a leading (batch) dimension."""
    import tensorflow as tf

    specs = tf.nest.flatten(dataset.element_spec)
    return bool(specs) and all(
        type(spec) is tf.TensorSpec and spec.shape.rank not in (None, 0) for spec in specs
    )


def fix_even_split() -> None:
    """Splits each global batch between the replicas as evenly as possible.

    Where ``tf.distribute`` finds the dataset's batch size it rebatches with fixed
    per-replica sizes, so a partial last batch fills the first replicas' shares and
    leaves the last ones short or empty (56 of 128 on 2 replicas -> 56 + 0), and an empty
    replica aborts oneDNN's MaxPool gradient. Where it does not find the batch size it
    uses its legacy rebatch, which cuts every batch into ``N`` slices of ``ceil(B / N)``
    (56 -> 28 + 28; on 2 replicas a slice is empty only for a batch of 1; on 4, 6 ->
    2 + 2 + 2 + 0, an empty replica in a full batch). The fix takes that path always
    (``split_evenly``) on 2 replicas and between workers (the sharding between workers
    that follows is upstream's, which knows this rebatch), and on more replicas of one
    process cuts sizes that differ by at most one (``split_balanced``: 6 -> 2 + 2 + 1 +
    1). Full batches that divide by ``N`` are cut exactly as before (``B / N`` each, in
    order). Datasets whose elements are not dense batched tensors keep upstream's choice.
    """

    def make(original):
        def _make_rebatch_fn(self, dataset, num_workers, num_replicas_in_sync):
            upstream_fn = original(self, dataset, num_workers, num_replicas_in_sync)
            if not _splittable(dataset):
                return upstream_fn
            per_worker = num_replicas_in_sync // num_workers
            # ceil(B / N) slices differ by at most one on 2 replicas; on more, in one
            # process, the balanced cut (workers keep the rebatch their sharding knows).
            balanced = num_workers == 1 and num_replicas_in_sync > 2
            split = split_balanced if balanced else split_evenly

            def rebatch_fn(dataset, worker_index):
                return split(dataset, num_replicas_in_sync).prefetch(per_worker)

            return rebatch_fn

        return _make_rebatch_fn

    patch(
        upstream.tf_distributed_dataset_class(),
        "_make_rebatch_fn",
        "tf_distribute_partial_batch_evenly",
        make,
    )


def process_share(dataset, index: int, parts: int, replicas: int):
    """Part ``index`` of ``parts`` equal, contiguous parts of every batch of ``dataset``;
    a batch whose size does not divide by ``replicas`` (or ``parts``) fails with a message
    naming its size.

    Example:
        >>> import tensorflow as tf
        >>> ds = process_share(tf.data.Dataset.range(6).batch(6), 1, 2, 2)
        >>> [p.numpy().tolist() for p in ds]  # doctest: +SKIP
        [[3, 4, 5]]
    """
    import tensorflow as tf

    unit = math.lcm(replicas, parts)

    def part_of(*batch):
        element = batch[0] if len(batch) == 1 else batch
        size = tf.shape(tf.nest.flatten(element)[0], out_type=tf.int64)[0]
        message = tf.strings.format(
            "tfdist: a batch of {} examples cannot be split evenly between "
            + f"{replicas} data-parallel replicas ({parts} processes feed one part each): "
            + "Keras on JAX gives every replica the same number of examples. A partial "
            + f"last batch must be a multiple of {unit}: batch with drop_remainder=True, "
            + f"or choose a dataset size whose last batch divides by {unit}.",
            [size],
        )
        with tf.control_dependencies([tf.debugging.Assert(tf.equal(size % unit, 0), [message])]):
            length = size // parts
        return tf.nest.map_structure(lambda t: t[index * length : (index + 1) * length], element)

    return dataset.map(part_of)


def _refuse_uneven_batch_size(dataset, share) -> None:
    """A batch size tf.data knows from the pipeline (as upstream computes it) that cannot
    be split evenly: refused now, before the first step, as upstream does."""
    batch = upstream.tf_static_batch_size(dataset)
    unit = math.lcm(share.replicas, share.parts)
    if batch is not None and batch % unit:
        raise ValueError(
            "Global batch size must be divisible by the number of data-parallel replicas "
            f"and of the processes that feed them: tfdist cuts every batch into {unit} "
            f"equal parts ({share.replicas} replicas, {share.parts} processes). Received: "
            f"global_batch_size={batch}. Batch the dataset with a multiple of {unit}."
        )


def fix_jax_process_share() -> None:
    """Feeds each JAX process an equal, contiguous part of every global batch.

    Upstream's ``distribute_tf_dataset`` rebatches a ``tf.data.Dataset`` into
    ``global / processes`` examples and deals the pieces out (``shard``); a partial last
    batch then becomes one full piece and a short one, and each process builds its global
    array from its own piece's shape. The fix cuts every batch into the same ``parts``
    Keras uses (``Distribution.data_shard_id`` of ``min(processes, replicas)``) by
    slicing it: for full batches these are exactly upstream's pieces, in the same order,
    and for the partial batch every process gets ``size / parts`` examples. A batch size
    tf.data knows from the pipeline that cannot be split evenly is refused before the
    first step, as upstream refuses it (Keras's own ``distribution_lib_test`` checks the
    message); a partial batch only the data reveals fails when it comes. One process,
    a distribution that does not shard its data, or elements that are not dense batched
    tensors keep upstream's path.
    """

    def make(original):
        def distribute_tf_dataset(self, dataset):
            share = jax_inputs._share_of(self)
            if share is None or not _splittable(dataset):
                return original(self, dataset)
            _refuse_uneven_batch_size(dataset, share)
            import tensorflow as tf

            from tfdist.core.full_epochs import keep_epoch_length

            parts = process_share(dataset, share.index, share.parts, share.replicas)
            # A length the dataset declared (tfdist.data.pipeline's) stays declared.
            return keep_epoch_length(dataset, parts.prefetch(tf.data.AUTOTUNE))

        return distribute_tf_dataset

    patch(
        upstream.keras_distribution_class(),
        "distribute_tf_dataset",
        "keras_jax_partial_batch_share",
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
    Fix(
        "tf_distribute_partial_batch_evenly",
        "tf.distribute splits a partial last batch by fixed per-replica sizes (56 of 128 "
        "-> 56 + 0 on 2 replicas): an empty replica aborts oneDNN's MaxPool gradient",
        on_tensorflow_backend(),
        fix_even_split,
        package="tensorflow",
        targets=targets(
            "tensorflow.python.distribute.input_lib:DistributedDataset._make_rebatch_fn",
            "tensorflow.python.distribute.input_lib:DistributedDataset."
            "_create_cloned_datasets_from_dataset",
        ),
        acts_where=(
            "every tf.distribute dataset of dense batched tensors on >1 replica (batches "
            "that divide evenly are cut as upstream); other elements, one replica: "
            "upstream's"
        ),
        no_harm=(
            "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes",
            "tests/compat/test_upstream_keras.py::test_keras_tests_fail_with_the_fixes_only_where_they_fail_without[tensorflow]",
        ),
    ),
    Fix(
        "keras_jax_partial_batch_share",
        "Keras on JAX, several processes: a partial last tf.data batch is dealt out as one "
        "full part and a short one (the processes train apart, silently), and a batch "
        "size only the data knows is refused",
        on_keras_backend("jax"),
        fix_jax_process_share,
        targets=targets(
            "keras.src.distribution.distribution_lib:Distribution.distribute_tf_dataset",
            "keras.src.distribution.distribution_lib:Distribution.data_shard_id",
            "keras.src.distribution.distribution_lib:Distribution.num_model_replicas",
        ),
        acts_where=(
            "Distribution.distribute_tf_dataset over >1 process (auto_shard_dataset, dense "
            "batched tensors); one process, other elements: upstream's path"
        ),
        no_harm=(
            "tests/compat/test_upstream_keras.py::test_keras_tests_fail_with_the_fixes_only_where_they_fail_without[jax]",
        ),
    ),
]
