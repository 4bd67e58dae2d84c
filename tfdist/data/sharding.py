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

from tfdist import _private

__all__ = ["source_file_count", "shard_policy"]

logger = logging.getLogger(__name__)

_FILE_READER_OPS = frozenset(
    {
        "TFRecordDataset",
        "TFRecordDatasetV2",
        "TextLineDataset",
        "FixedLengthRecordDataset",
        "FixedLengthRecordDatasetV2",
    }
)


def _graph_def(dataset: tf.data.Dataset):
    """The dataset's GraphDef, or None when it cannot be serialised."""
    try:
        serialized = _private.tf_dataset_graph_def(
            dataset, external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN
        )
        return tf.compat.v1.GraphDef.FromString(serialized.numpy())
    except Exception as err:  # noqa: BLE001 - any failure means "unknown", not an error
        logger.debug("tfdist.data: could not inspect the dataset graph: %s", err)
        return None


def source_file_count(dataset: tf.data.Dataset) -> int | None:
    """How many files the dataset reads, when its graph shows a reader over a file list.

    TensorFlow's FILE auto-shard needs a file reader fed by a list of file names, and
    at least one file per worker (with fewer it fails); this mirrors that check on the
    serialised graph. Any doubt (no reader, names computed at run time, a graph too
    large to serialise) answers None, and the caller shards by DATA, which is always
    correct.

    Example:
        >>> source_file_count(tf.data.TFRecordDataset(["a", "b"]))  # doctest: +SKIP
        2
    """
    graph = _graph_def(dataset)
    if graph is None:
        return None
    ops = {n.op for n in graph.node}
    for function in graph.library.function:
        ops.update(n.op for n in function.node_def)
    if not ops & _FILE_READER_OPS:
        return None
    consts = {n.name: n for n in graph.node if n.op == "Const"}
    counts = []
    for node in graph.node:
        if node.op != "TensorSliceDataset" or not node.input:
            continue
        const = consts.get(node.input[0].split(":")[0])
        if const is None:
            continue
        tensor = const.attr["value"].tensor
        if tensor.dtype == tf.string.as_datatype_enum and len(tensor.tensor_shape.dim) == 1:
            counts.append(int(tensor.tensor_shape.dim[0].size))
    return counts[0] if len(counts) == 1 else None


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
