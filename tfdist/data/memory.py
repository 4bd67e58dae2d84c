"""Reading a whole source into host memory once, with ``map_fn`` applied (vectorised).

Example:
    >>> variables, count, how = read_into_memory(tf.data.Dataset.range(10), None, "auto")  # doctest: +SKIP
    >>> count  # doctest: +SKIP
    10
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import tensorflow as tf

from tfdist.data.host import on_host

__all__ = ["read_into_memory"]

logger = logging.getLogger(__name__)

# "All of them", as a batch size: reads a whole dataset into one batch.
_ALL = 2**62


def _call(map_fn: Callable, element, is_tuple: bool):
    # tf.data's convention: a tuple element is passed as positional arguments.
    return map_fn(*element) if is_tuple else map_fn(element)


def _vectorised(source: tf.data.Dataset, map_fn: Callable, size: int, unfused):
    """The whole source as one batch mapped by ``tf.vectorized_map``, or None when
    ``map_fn`` cannot be vectorised."""
    is_tuple = isinstance(source.element_spec, tuple)

    def vectorized(*examples):
        return tf.vectorized_map(
            lambda e: _call(map_fn, e, is_tuple),
            examples if is_tuple else examples[0],
            fallback_to_while_loop=False,
        )

    if getattr(map_fn, "batch_safe", False):  # e.g. tfdist.data.scale: one call does it
        return (
            source.batch(size)
            .with_options(unfused)
            .map(lambda *examples: _call(map_fn, examples if is_tuple else examples[0], is_tuple))
        )
    try:
        return source.batch(size).with_options(unfused).map(vectorized)
    except (ValueError, TypeError, NotImplementedError) as err:
        logger.info("tfdist.data: map_fn runs per example (cannot vectorise it: %s)", err)
        return None


def _one_batch(source: tf.data.Dataset, map_fn, map_on: str):
    """(a dataset whose one element is every mapped example, how ``map_fn`` is applied)."""
    cardinality = int(source.cardinality())
    size = cardinality if cardinality > 0 else _ALL
    # A map followed by batch(size) fuses into an op that allocates the whole batch up
    # front: with an unknown length (size=_ALL) that aborts the process.
    unfused = tf.data.Options()
    unfused.experimental_optimization.map_and_batch_fusion = False
    if map_fn is not None and map_on == "auto":
        everything = _vectorised(source, map_fn, size, unfused)
        if everything is not None:
            return everything, "vectorised"
    how = None
    if map_fn is not None and map_on != "batch":
        source = source.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        how = "per example"
    return source.batch(size).with_options(unfused), how


def read_into_memory(source: tf.data.Dataset, map_fn, map_on: str):
    """Reads the whole dataset into host variables, applying ``map_fn`` to each example.

    With ``map_on='auto'`` the per-example function runs vectorised over all examples
    at once (``tf.vectorized_map``: the results of one call per example, many times
    faster); a function it cannot vectorise runs per example, in parallel, instead.

    Returns:
        (variables with the structure of an example, number of examples, how
        ``map_fn`` was applied: ``"vectorised"``, ``"per example"`` or None).

    Raises:
        ValueError: the dataset is empty.
    """
    everything, how = _one_batch(source, map_fn, map_on)
    whole = next(iter(everything), None)
    if whole is None:
        raise ValueError(
            "pipeline: dataset is empty, so there is nothing to train on. Check the split or "
            "the filter that produced it."
        )
    count = int(tf.nest.flatten(whole)[0].shape[0])
    variables = on_host(
        lambda: tf.nest.map_structure(lambda t: tf.Variable(t, trainable=False), whole),
        "copying the dataset into memory",
    )
    return variables, count, how
