"""The argument checks of ``pipeline()``, and its source turned into a ``tf.data.Dataset``.

Every message has the shape of ``tfdist.core.validate``: it names the argument, echoes what
was received (shortened) and says what to do.

Example:
    >>> check_options(64, None, "auto", True, 10_000, 0, None)  # doctest: +SKIP
    >>> as_dataset(np.arange(10)).cardinality()                  # doctest: +SKIP
    10
    >>> check_not_batched(tf.data.Dataset.range(8).batch(4), "ds")  # doctest: +SKIP
    Traceback (most recent call last):
    ValueError: pipeline: dataset must be a dataset of single examples, ...
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from tfdist.core import upstream, validate

__all__ = [
    "MAP_ON",
    "short",
    "check_options",
    "as_dataset",
    "check_finite",
    "check_not_batched",
]

MAP_ON = ("auto", "example", "batch")
_WHERE = "pipeline"
_MAX_SEED = 2**63


class _Short:
    def __init__(self, value):
        text = repr(value)
        self.text = text if len(text) <= 200 else text[:200] + "..."

    def __repr__(self) -> str:
        return self.text


def short(value) -> _Short:
    """``value`` with its ``repr`` cut to 200 characters, for messages that echo it
    (a dataset's or an array's repr can be long).

    Example:
        >>> repr(short("x" * 500))[-3:]
        '...'
    """
    return _Short(value)


def global_batch(value, replicas: int) -> int:
    """``global_batch=`` checked: a positive int that divides between ``replicas``."""
    value = validate.positive_int(
        value,
        "global_batch",
        _WHERE,
        "Pass the examples of one training step across the whole job, e.g. 128.",
    )
    if value % replicas:
        counts = [n for n in range(1, min(value, 64) + 1) if value % n == 0]
        raise ValueError(
            f"{_WHERE}: global_batch must divide evenly between the {replicas} replicas. "
            f"Received: global_batch={value}. Pass a multiple of {replicas}, e.g. "
            f"{value - value % replicas or replicas}. A job resumed from a checkpoint on "
            "another number of replicas (an elastic job that lost or got back a node) "
            f"trains the same model only with the same global batch: run it on a number "
            f"of replicas that divides {value} ({', '.join(map(str, counts))}), e.g. "
            "bound Ray's ScalingConfig(num_workers=(min, max)) to such counts."
        )
    return value


def _check_batch_and_map(per_replica_batch, map_fn, map_on) -> None:
    if per_replica_batch is None:  # sized by global_batch=, checked by global_batch()
        return
    validate.positive_int(
        per_replica_batch,
        "per_replica_batch",
        _WHERE,
        "Pass the batch one replica processes per step, e.g. 64; the pipeline batches with "
        "64 x replicas.",
    )
    if map_fn is not None and not callable(map_fn):
        raise TypeError(
            validate.message(
                _WHERE,
                "map_fn",
                "callable or None",
                short(map_fn),
                "Pass a function of one example, e.g. lambda image, label: (image / 255, label).",
            )
        )
    validate.one_of(
        map_on,
        MAP_ON,
        "map_on",
        _WHERE,
        "'auto' (the default) is right unless map_fn is random augmentation ('batch', if it "
        "handles batches) or must see examples one by one ('example').",
    )


def _check_cache(cache) -> None:
    if isinstance(cache, bool):
        return
    what = "True (in memory), False, or a file path prefix"
    if not isinstance(cache, (str, os.PathLike)):
        raise TypeError(validate.message(_WHERE, "cache", what, cache))
    if not str(cache):
        raise ValueError(validate.message(_WHERE, "cache", what, cache))


def _check_order(shuffle, seed, drop_remainder) -> None:
    if shuffle is not None:
        validate.integer(
            shuffle,
            "shuffle",
            _WHERE,
            "The default is 10_000.",
            low=1,
            what="a positive int (the shuffle buffer, in examples) or None to keep the order",
        )
    if seed is not None:
        what, hint = (
            "None or an int in [0, 2**63)",
            "Any fixed int makes every epoch's order reproducible.",
        )
        validate.integer(seed, "seed", _WHERE, hint, low=0, what=what)
        if seed >= _MAX_SEED:
            raise ValueError(validate.message(_WHERE, "seed", what, seed, hint))
    if drop_remainder is not None:
        validate.instance(
            drop_remainder,
            bool,
            "drop_remainder",
            _WHERE,
            "True, False or None (None: drop the partial last batch when shuffling, keep it "
            "otherwise)",
        )


def check_options(per_replica_batch, map_fn, map_on, cache, shuffle, seed, drop_remainder):
    """Raises TypeError (wrong type) or ValueError (bad value) for a bad option of
    ``pipeline()``; the dataset and the strategy are checked where they are used."""
    _check_batch_and_map(per_replica_batch, map_fn, map_on)
    _check_cache(cache)
    _check_order(shuffle, seed, drop_remainder)


def as_dataset(dataset) -> tf.data.Dataset:
    """The source as a Dataset (in-memory arrays are sliced into examples).

    Example:
        >>> as_dataset((np.zeros((4, 2)), np.arange(4))).cardinality()  # doctest: +SKIP
        4
    """
    if isinstance(dataset, tf.data.Dataset):
        return dataset
    if isinstance(dataset, tf.distribute.DistributedDataset):
        raise TypeError(
            validate.message(
                _WHERE,
                "dataset",
                "a tf.data.Dataset, not one already distributed",
                short(dataset),
                "Pass the dataset itself; Keras (or strategy.experimental_distribute_dataset) "
                "distributes the pipeline.",
            )
        )
    structure = tuple(dataset) if isinstance(dataset, list) else dataset
    leaves = tf.nest.flatten(structure)
    ok = (
        isinstance(structure, (np.ndarray, tf.Tensor, tuple, Mapping))
        and leaves
        and all(isinstance(x, (np.ndarray, tf.Tensor)) and len(x.shape) >= 1 for x in leaves)
    )
    if not ok:
        raise TypeError(
            validate.message(
                _WHERE,
                "dataset",
                "a tf.data.Dataset, a numpy array, or a tuple/list/dict of numpy arrays "
                "(features, labels) with a leading example axis",
                short(dataset),
                "Build a Dataset with tf.data.Dataset.from_tensor_slices(...) or load one with "
                "tfdist.data.mnist().",
            )
        )
    lengths = {int(x.shape[0]) for x in leaves}
    if len(lengths) != 1:
        raise ValueError(
            "pipeline: the arrays in dataset must have the same number of examples (first "
            f"axis). Received lengths {sorted(lengths)}. Pass features and labels that match."
        )
    return tf.data.Dataset.from_tensor_slices(structure)


def check_finite(source: tf.data.Dataset, dataset) -> None:
    """ValueError when ``source`` (made from ``dataset``) repeats forever."""
    if int(source.cardinality()) == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            validate.message(
                _WHERE,
                "dataset",
                "finite, but it repeats forever",
                short(dataset),
                "Remove .repeat(): the pipeline yields one epoch per iteration, and "
                "model.fit(epochs=...) iterates it once per epoch.",
            )
        )


def _unknown_leading_axis(spec) -> bool:
    """Every leaf has a first axis of unknown size: how a batch's spec looks."""
    leaves = tf.nest.flatten(spec)
    return bool(leaves) and all(
        isinstance(leaf, tf.TensorSpec) and leaf.shape.rank and leaf.shape[0] is None
        for leaf in leaves
    )


def _batching_op(source: tf.data.Dataset):
    """The batch transformation whose batches ``source`` yields, or None.

    Walks back from ``source`` through the transformations that keep the element spec
    (prefetch, cache, shuffle, repeat, take, a map that keeps the shape...) and through
    maps between batches of unknown size (tfds's ``as_supervised`` after its
    ``batch_size``). The first other change of spec decides: a ``.batch()`` or
    ``padded_batch()`` means the elements are batches; anything else (``unbatch``, a
    map to fixed-size ``(features, label)``, a source) means they are examples. So
    ``ids.batch(seq_len + 1, drop_remainder=True).map(split_input_target)``, the
    sequence-building step of TensorFlow's text tutorial, is not mistaken for batching.
    """
    current = source
    for _ in range(100):  # a pipeline is a short chain; never loop on a strange graph
        name = type(current).__name__.lstrip("_")
        if name.endswith("BatchDataset") and not name.endswith(
            ("UnbatchDataset", "RebatchDataset")
        ):
            return current
        inputs = upstream.tf_dataset_inputs(current)
        if len(inputs) != 1:
            return None
        spec, before = current.element_spec, inputs[0].element_spec
        if spec != before and not (_unknown_leading_axis(spec) and _unknown_leading_axis(before)):
            return None
        current = inputs[0]
    return None


def check_not_batched(source: tf.data.Dataset, dataset) -> None:
    """ValueError when the user's dataset already yields batches (pipeline() batches)."""
    if not isinstance(dataset, tf.data.Dataset):
        return  # arrays in memory are sliced into examples by as_dataset
    op = _batching_op(source)
    if op is None:
        return
    raise ValueError(
        validate.message(
            _WHERE,
            "dataset",
            "a dataset of single examples, but its elements are batches (made by "
            f"{type(op).__name__.lstrip('_')}; element spec {short(source.element_spec)})",
            short(dataset),
            "Pass the dataset before its .batch() (pipeline() batches with the global "
            "batch size, then prefetches), or call .unbatch() on it. If each element is "
            "one example built with .batch() (a window of a sequence), map it to its final "
            "(features, label) form first.",
        )
    )
