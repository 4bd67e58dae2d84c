"""How a pipeline is split between workers: the auto-shard policy, always set explicitly.

DATA (each worker keeps its slice of every global batch) is always correct; FILE (each
worker reads its own files) is cheaper but needs a file reader over a list of at least
one file per worker, and a source read outside any per-epoch function.

Example:
    >>> shard_policy(tf.data.TFRecordDataset(files), 2,           # doctest: +SKIP
    ...              in_memory=False, positioned=False)
    (<AutoShardPolicy.FILE: 1>, '3 files for 2 workers')
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfdist.core.shard_policy import source_file_count

__all__ = ["source_file_count", "shard_policy"]

logger = logging.getLogger(__name__)


def shard_policy(dataset, num_workers: int, *, in_memory: bool, positioned: bool):
    """The auto-shard policy and why: set explicitly so TensorFlow never guesses.

    Args:
        in_memory: the pipeline reads its source into memory (every worker holds all).
        positioned: the pipeline reads its source inside a per-epoch function.

    Example:
        >>> shard_policy(tf.data.Dataset.range(9), 1, in_memory=True, positioned=False)  # doctest: +SKIP
        (<AutoShardPolicy.DATA: 2>, 'one worker')
    """
    Policy = tf.data.experimental.AutoShardPolicy
    explicit = dataset.options().experimental_distribute.auto_shard_policy
    if explicit != Policy.AUTO:
        return explicit, "set on the dataset"
    if num_workers == 1:
        return Policy.DATA, "one worker"
    if in_memory:
        return Policy.DATA, "data in memory"
    if positioned:
        # A positioned stream reads its source inside a per-epoch function, where
        # TensorFlow's FILE rewrite cannot find the reader.
        return Policy.DATA, "seeded stream"
    files = source_file_count(dataset)
    if files is not None and files >= num_workers:
        return Policy.FILE, f"{files} files for {num_workers} workers"
    return Policy.DATA, f"{files or 'no'} file(s) for {num_workers} workers"
