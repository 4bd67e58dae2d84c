"""A dataset that declares its epoch's length, and keeping that length through Keras's
per-process sharding on JAX.

Example:
    >>> FullEpochs(ds, 10).cardinality()  # doctest: +SKIP
    <tf.Tensor: shape=(), dtype=int64, numpy=10>
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.core import upstream

__all__ = ["FullEpochs", "keep_epoch_length"]


class FullEpochs(tf.data.Dataset):
    """A dataset whose ``cardinality()`` is a full epoch's batches.

    A positioned pipeline starts each iteration inside a per-epoch function, so
    tf.data cannot know its length. Keras 3 then takes the length of the first epoch it
    runs for every later epoch; after a resume that skips batches, the first epoch is
    short and every later one would be cut short too. Reporting a full epoch instead
    makes Keras run full epochs and end the short one where its data ends.

    Example:
        >>> FullEpochs(ds, 10).cardinality()  # doctest: +SKIP
        <tf.Tensor: shape=(), dtype=int64, numpy=10>
    """

    def __init__(self, dataset: tf.data.Dataset, batches: int):
        self._dataset = dataset
        self._batches = batches
        # The same graph; only the length differs.
        super().__init__(upstream.tf_dataset_variant(dataset))

    def _inputs(self):  # tf.data.Dataset's abstract method: the datasets this one reads
        return [self._dataset]

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def cardinality(self):
        return tf.constant(self._batches, tf.int64)


def _full_batches(dataset: tf.data.Dataset) -> bool:
    """Whether every batch has the same static size (no partial last batch)."""
    specs = tf.nest.flatten(dataset.element_spec)
    return bool(specs) and all(
        getattr(spec, "shape", None) is not None and spec.shape.rank and spec.shape[0] is not None
        for spec in specs
    )


def keep_epoch_length(source: tf.data.Dataset, sharded: tf.data.Dataset) -> tf.data.Dataset:
    """``sharded`` declaring ``source``'s length when the sharding lost it.

    Each process's share of a global batch is one batch, so a process sees exactly as
    many batches as there are global batches, as long as none is partial (a static
    batch size). Otherwise, or when the length is unknown or kept, ``sharded`` as is.

    Example:
        >>> keep_epoch_length(FullEpochs(ds, 8), ds.rebatch(4).shard(2, 0)).cardinality()  # doctest: +SKIP
        <tf.Tensor: shape=(), dtype=int64, numpy=8>
    """
    batches = int(source.cardinality())
    if batches <= 0 or int(sharded.cardinality()) >= 0 or not _full_batches(source):
        return sharded
    return FullEpochs(sharded, batches)
