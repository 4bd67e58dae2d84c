"""One epoch per iteration: in-memory (gathered) and streamed epochs, from a position.

Each iteration of a positioned dataset starts inside a per-epoch function: it reads the
pipeline's position (``PositionVariables.start_iteration``), shuffles by
``(seed, epoch)`` and skips the batches already done. ``FullEpochs`` then reports a
full epoch as the length, which such a dataset cannot know by itself.

Example:
    >>> ds = streamed_epochs(source, holder, seed=1, shuffle=100, skip_per_batch=32)  # doctest: +SKIP
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.core.full_epochs import FullEpochs
from tfdist.data.positions import PositionVariables
from tfdist.data.seeds import epoch_seed

__all__ = ["in_memory_epochs", "streamed_epochs", "FullEpochs"]


# Dataset functions of plain TensorFlow ops, with no Python control flow on tensors:
# traced as written, without autograph's conversion (a cost paid at every build).
_plain = tf.autograph.experimental.do_not_convert


def _per_epoch(one_epoch) -> tf.data.Dataset:
    # One element, flat-mapped: ``one_epoch`` runs (and reads the position) only when an
    # iteration starts, not when an iterator is created.
    return tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).flat_map(one_epoch)


def in_memory_epochs(
    variables,
    count: int,
    holder: PositionVariables | None,
    *,
    seed,
    shuffle,
    skip_per_batch,
    batch,
    drop_remainder,
) -> tf.data.Dataset:
    """Batches gathered from examples held in memory, in one epoch's order.

    Only example indices flow through tf.data one by one (cheap int64 scalars); the
    examples themselves are gathered a whole batch at a time. With a position, each
    iteration starts where the position says and uses the order of (seed, epoch): a
    full uniform permutation keyed by Philox on (seed, epoch), the same everywhere.

    Args:
        variables: the examples (``memory.read_into_memory``), ``count`` of them.
        holder: the position, or None for the source order (no shuffle, no position).
        skip_per_batch: examples per batch the position's ``batch`` counts.
    """

    @_plain
    def gather(idx):
        return tf.nest.map_structure(lambda v: tf.gather(v, idx), variables)

    if holder is None:
        batches = tf.data.Dataset.range(count).batch(batch, drop_remainder=drop_remainder)
        return batches.map(gather)

    seed_t = tf.constant(seed, tf.int64)

    @_plain
    def one_epoch(_):
        epoch, skip = holder.start_iteration()
        order = tf.range(count, dtype=tf.int64)
        if shuffle is not None:
            order = tf.random.experimental.stateless_shuffle(order, seed=tf.stack([seed_t, epoch]))
        order = order[skip * skip_per_batch :]
        if not drop_remainder:
            return tf.data.Dataset.from_tensor_slices(order)
        # Whole batches of indices at once: nothing flows through tf.data per example.
        full = tf.size(order, out_type=tf.int64) // batch
        return tf.data.Dataset.from_tensor_slices(tf.reshape(order[: full * batch], [-1, batch]))

    per_epoch = _per_epoch(one_epoch)
    if not drop_remainder:
        # Batched outside the per-epoch function, where tf.distribute can find the batch
        # size to split a short last batch between replicas and workers. (With full
        # batches only, the static batch dimension tells it.)
        per_epoch = per_epoch.batch(batch)
    # A gather is one memory copy: running it in parallel would only add threads.
    return per_epoch.map(gather)


def streamed_epochs(
    source: tf.data.Dataset, holder: PositionVariables, *, seed, shuffle, skip_per_batch
) -> tf.data.Dataset:
    """One epoch of ``source`` per iteration, buffer-shuffled by (seed, epoch), from the
    position (read inside the dataset graph when an iteration starts). Not batched."""
    seed_t = tf.constant(seed, tf.int64)

    @_plain
    def one_epoch(_):
        epoch, skip = holder.start_iteration()
        ds = source
        if shuffle is not None:
            # The order must come from (seed, epoch) alone: a global seed set with
            # tf.random.set_seed would otherwise enter the shuffle's seed pair.
            graph = tf.compat.v1.get_default_graph()
            saved, graph.seed = graph.seed, None
            try:
                ds = ds.shuffle(shuffle, seed=epoch_seed(seed_t, epoch))
            finally:
                graph.seed = saved
        return ds.skip(skip * skip_per_batch)

    return _per_epoch(one_epoch)
