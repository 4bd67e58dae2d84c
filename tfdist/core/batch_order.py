"""What tf.distribute's cut of a batched dataset looks like before the first step: the
batch sizes a pipeline yields, in their order, and how the even split cuts and deals them.

``tfdist.compat.partial_batches.tensorflow`` uses it to cut known batches with tf.data's rebatch
kernel at upstream's cost (``epoch_slices``, ``rebatch_in_order``) and to record the cut
(``KnownCut``), from which ``tfdist.compat.loss_weights`` lets each replica know the global
batch of a step from its own slice, without an all-reduce.

Every private name used comes from ``tfdist.core.upstream``.

Example:
    >>> batch_sizes_of((4, 7, False))
    {3, 4}
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from tfdist.core import upstream

__all__ = [
    "KnownCut",
    "dealing_known",
    "batch_sizes",
    "batch_sizes_of",
    "dataset_batching",
    "ordered_batching",
    "epoch_slices",
    "rebatch_in_order",
]


@dataclasses.dataclass(frozen=True)
class KnownCut:
    """How ``split_balanced`` cuts every global batch of a dataset whose batch sizes are
    known before training, and which slice each replica gets: what a replica needs to
    know the global batch of a step from its own slice, without asking the others.

    Example:
        >>> cut = KnownCut(frozenset({16, 9}), replicas=2, workers=1)
        >>> cut.even, cut.telling, cut.slice_size(9, 0), cut.slice_size(9, 1)
        (False, True, 5, 4)
    """

    sizes: frozenset[int]  # every global batch size (full batches and the last one)
    replicas: int
    workers: int

    def slice_size(self, batch: int, index: int) -> int:
        """Slice ``index``'s size in a global batch of ``batch`` (the larger first)."""
        return batch // self.replicas + (1 if index < batch % self.replicas else 0)

    def slice_index(self, replica: int) -> int:
        """The slice replica ``replica`` (its id in the sync group) gets: its own on one
        worker; over workers tf.distribute's DATA sharding deals slice ``i`` to worker
        ``i % workers``, and each worker's slices to its replicas in order."""
        worker, local = divmod(replica, self.replicas // self.workers)
        return local * self.workers + worker

    @property
    def even(self) -> bool:
        """Every batch divides by the replicas: every slice of every batch is equal."""
        return all(size % self.replicas == 0 for size in self.sizes)

    @property
    def telling(self) -> bool:
        """Each slice's size tells which batch size it was cut from, for every slice."""
        return all(
            len({self.slice_size(size, i) for size in self.sizes}) == len(self.sizes)
            for i in range(self.replicas)
        )


def dealing_known(dataset, workers: int) -> bool:
    """Whether tf.distribute deals the cut's slices to workers as ``KnownCut`` says: one
    worker, or sharding by DATA (set, or AUTO on a pipeline that reads no file)."""
    import tensorflow as tf

    from tfdist.core import shard_policy

    if workers == 1:
        return True
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy == tf.data.experimental.AutoShardPolicy.DATA:
        return True
    return policy == tf.data.experimental.AutoShardPolicy.AUTO and (
        shard_policy.reads_files(dataset) is False
    )


def batch_sizes(dataset) -> set[int] | None:
    """Every batch size ``dataset`` yields (its full batches and its last one), read from
    the pipeline without reading data; None when it cannot tell (a ``filter``, an
    unknown or infinite input, a batch size only the data knows).

    Example:
        >>> import tensorflow as tf
        >>> sorted(batch_sizes(tf.data.Dataset.range(5).batch(2).prefetch(1)))  # doctest: +SKIP
        [1, 2]
    """
    batching = dataset_batching(dataset)
    return None if batching is None else batch_sizes_of(batching)


def batch_sizes_of(batching: tuple[int, int, bool]) -> set[int]:
    """Every batch size of ``count`` examples batched by ``size`` (``drop``: full only).

    Example:
        >>> sorted(batch_sizes_of((4, 7, False)))
        [3, 4]
    """
    size, count, drop = batching
    last = count % size
    if count < size:
        return {last} if last and not drop else set()
    return {size} | ({last} if last and not drop else set())


def dataset_batching(dataset) -> tuple[int, int, bool] | None:
    """(batch size, examples batched, drop_remainder) of the ``batch`` that makes
    ``dataset``'s elements, read from the pipeline; None when it cannot tell."""
    node = dataset
    while True:
        batching = upstream.tf_dataset_batching(node)
        inputs = upstream.tf_dataset_inputs(node)
        if batching is not None and len(inputs) == 1:
            size, drop = batching
            count = int(inputs[0].cardinality())
            if count < 0:  # tf.data.INFINITE_CARDINALITY or UNKNOWN_CARDINALITY
                return None
            return size, count, drop
        # Walk back only through ops that keep the number (and so the sizes) of elements.
        if len(inputs) != 1 or int(inputs[0].cardinality()) != int(node.cardinality()):
            return None
        node = inputs[0]


# Ops between a ``batch`` and the pipeline's end that keep its elements and their order
# (a ``map`` may change a batch's size, a ``shuffle`` moves the last batch).
_ORDER_KEEPING = frozenset(
    {"_PrefetchDataset", "CacheDataset", "_OptionsDataset", "_AssertCardinalityDataset"}
)
# The longest per-epoch list of slice sizes handed to tf.data's rebatch (8 MiB of int64).
_MAX_SLICES = 1 << 20


def ordered_batching(dataset) -> tuple[int, int, bool] | None:
    """(batch size, examples batched, drop_remainder) of the ``batch`` whose elements
    ``dataset`` yields as they are, in their order (only prefetch, cache, options or a
    cardinality assertion after it); None otherwise.

    Example:
        >>> import tensorflow as tf
        >>> ordered_batching(tf.data.Dataset.range(7).batch(4).prefetch(1))  # doctest: +SKIP
        (4, 7, False)
    """
    if dataset.options().deterministic is False:
        return None
    node = dataset
    while True:
        batching = upstream.tf_dataset_batching(node)
        inputs = upstream.tf_dataset_inputs(node)
        if batching is not None and len(inputs) == 1:
            count = int(inputs[0].cardinality())
            return None if count < 0 else (batching[0], count, batching[1])
        if type(node).__name__ not in _ORDER_KEEPING or len(inputs) != 1:
            return None
        node = inputs[0]


def epoch_slices(batching: tuple[int, int, bool], replicas: int) -> list[int] | None:
    """The size of every slice of one pass over the data, in order, as ``split_balanced``
    cuts it (for tf.data's ``rebatch``, which cycles through them); None when too long.

    Example:
        >>> epoch_slices((4, 7, False), 2)
        [2, 2, 2, 1]
    """
    size, count, drop = batching
    full, last = divmod(count, size)
    if last == 0 or drop:  # every batch alike: one batch's slices, cycled
        batches = [size] if full else []
    else:
        batches = [size] * full + [last]
    if not batches or len(batches) * replicas > _MAX_SLICES:
        return None
    return [
        b // replicas + (1 if i < b % replicas else 0) for b in batches for i in range(replicas)
    ]


def rebatch_in_order(dataset, slices: list[int], workers: int, worker: int, per_worker: int):
    """``dataset`` cut into ``slices`` (one pass's slice sizes, ``epoch_slices``) by
    tf.data's rebatch kernel, at upstream's cost, and this worker's share of them kept
    as DATA sharding keeps it (slice ``i`` to worker ``i % workers``). tf.distribute's
    auto-sharding is switched off for the result: it would rewrite the rebatch into its
    legacy ``ceil`` cut (9 on 4 replicas -> 3 + 3 + 3 + 0) and shard again."""
    import tensorflow as tf

    cut = dataset.rebatch(slices)
    if workers > 1:
        cut = cut.shard(workers, worker)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    with _quiet_policy_change():
        cut = cut.with_options(options)
    return cut.prefetch(per_worker)


class _PolicyChangeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Changing the value of option auto_shard")


@contextlib.contextmanager
def _quiet_policy_change():
    """Without tf.data's warning that the auto-shard policy changes (DATA, set for the
    pipeline, to OFF for the cut that shards itself): the sharding stays DATA's."""
    absl_logger = logging.getLogger("absl")
    quiet = _PolicyChangeFilter()
    absl_logger.addFilter(quiet)
    try:
        yield
    finally:
        absl_logger.removeFilter(quiet)
