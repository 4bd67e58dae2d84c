"""How many files a tf.data pipeline reads, and the auto-shard policy that follows.

Shared by the ``tf_multi_worker_auto_shard`` fix (pipelines users hand to
``fit``/``evaluate``/``predict``) and ``tfdist.data`` (pipelines tfdist builds).

Example:
    >>> source_file_count(tf.data.TFRecordDataset(["a", "b"]))  # doctest: +SKIP
    2
    >>> auto_shard_policy(tf.data.TFRecordDataset(["a"]), 2)  # doctest: +SKIP
    (<AutoShardPolicy.DATA: 2>, '1 file(s) for 2 workers')
"""

from __future__ import annotations

import logging

from tfdist.core import upstream, validate

__all__ = ["source_file_count", "reads_files", "unseeded_shuffle", "auto_shard_policy"]

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


def _graph_def(dataset):
    """The dataset's GraphDef, or None when it cannot be serialised."""
    import tensorflow as tf

    try:
        serialized = upstream.tf_dataset_graph_def(
            dataset, external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN
        )
        return tf.compat.v1.GraphDef.FromString(serialized.numpy())
    except Exception as err:  # noqa: BLE001 - any failure means "unknown", not an error
        logger.debug("tfdist: could not inspect the dataset graph: %s", err)
        return None


def _ops(graph) -> set[str]:
    ops = {n.op for n in graph.node}
    for function in graph.library.function:
        ops.update(n.op for n in function.node_def)
    return ops


def reads_files(dataset) -> bool | None:
    """Whether the pipeline has a file reader (TFRecord, text line, fixed length); None
    when its graph cannot be inspected.

    Example:
        >>> reads_files(tf.data.Dataset.range(3))  # doctest: +SKIP
        False
    """
    graph = _graph_def(dataset)
    return None if graph is None else bool(_ops(graph) & _FILE_READER_OPS)


def _file_list_sizes(graph) -> list[int]:
    """Sizes of the 1-D string constants sliced into a dataset: the candidate file lists."""
    import tensorflow as tf

    consts = {n.name: n for n in graph.node if n.op == "Const"}
    sizes = []
    for node in graph.node:
        if node.op != "TensorSliceDataset" or not node.input:
            continue
        const = consts.get(node.input[0].split(":")[0])
        if const is None:
            continue
        tensor = const.attr["value"].tensor
        if tensor.dtype == tf.string.as_datatype_enum and len(tensor.tensor_shape.dim) == 1:
            sizes.append(int(tensor.tensor_shape.dim[0].size))
    return sizes


def source_file_count(dataset) -> int | None:
    """How many files the dataset reads, when its graph shows a reader over a file list.

    TensorFlow's FILE auto-shard needs a file reader fed by a list of file names, and
    at least one file per worker (with fewer it fails); this mirrors that check on the
    serialised graph. Any doubt (no reader, names computed at run time, a graph too
    large to serialise) answers None.

    Example:
        >>> source_file_count(tf.data.TFRecordDataset(["a", "b"]))  # doctest: +SKIP
        2
    """
    graph = _graph_def(dataset)
    if graph is None or not _ops(graph) & _FILE_READER_OPS:
        return None
    sizes = _file_list_sizes(graph)
    return sizes[0] if len(sizes) == 1 else None


def _const_int(consts, name: str) -> int | None:
    node = consts.get(name.split(":")[0])
    values = None if node is None else node.attr["value"].tensor.int64_val
    return int(values[0]) if values else None


def unseeded_shuffle(dataset) -> bool:
    """Whether the pipeline shuffles with seeds chosen at run time (no ``seed=`` and no
    ``tf.random.set_seed``): each worker then shuffles differently.

    Example:
        >>> unseeded_shuffle(tf.data.Dataset.range(4).shuffle(4))  # doctest: +SKIP
        True
    """
    graph = _graph_def(dataset)
    if graph is None:
        return False
    consts = {n.name: n for n in graph.node if n.op == "Const"}
    for node in graph.node:
        if node.op.startswith("Shuffle") and len(node.input) >= 4:
            seeds = (_const_int(consts, node.input[2]), _const_int(consts, node.input[3]))
            if seeds == (0, 0):
                return True
    return False


def auto_shard_policy(dataset, num_workers: int):
    """The policy TensorFlow's AUTO should pick for ``num_workers``, and why; None when
    upstream's own choice stands (set explicitly by the user, or files not countable).

    FILE with at least one file per worker, DATA with fewer files or no file reader.

    Example:
        >>> auto_shard_policy(tf.data.Dataset.range(8), 2)  # doctest: +SKIP
        (<AutoShardPolicy.DATA: 2>, 'no file reader')
    """
    import tensorflow as tf

    validate.positive_int(
        num_workers, "num_workers", "auto_shard_policy", "Pass the number of workers."
    )
    Policy = tf.data.experimental.AutoShardPolicy
    if dataset.options().experimental_distribute.auto_shard_policy != Policy.AUTO:
        return None, "set on the dataset"
    files = source_file_count(dataset)
    if files is not None:
        policy = Policy.FILE if files >= num_workers else Policy.DATA
        return policy, f"{files} file(s) for {num_workers} workers"
    if reads_files(dataset) is False:
        return Policy.DATA, "no file reader"
    return None, "file count unknown"
