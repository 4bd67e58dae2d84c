"""A partial last batch on several replicas: the part the TensorFlow fixes
(``partial_batches.tensorflow``) and the JAX fixes (``partial_batches.jax``) share, the
tf.data steps both cut batches with. The batch sizes a pipeline tells, and how the even
split deals them, are in ``tfdist.core.batch_order``.

Example:
    >>> from tfdist.compat import partial_batches
    >>> partial_batches.splittable.__name__
    'splittable'
"""

from __future__ import annotations

__all__ = ["map_elements", "splittable"]


def map_elements(dataset, fn):
    """``dataset.map(fn)`` with ``fn`` given each element whole: tf.data passes a tuple's
    items as separate arguments, so a 1-tuple (``predict``'s ``(x,)`` with ``x`` a list of
    inputs) must be packed again, not taken for its one item."""
    if isinstance(dataset.element_spec, tuple):
        return dataset.map(lambda *element: fn(element))
    return dataset.map(fn)


def splittable(dataset) -> bool:
    """Every component a dense tensor with a leading (batch) dimension."""
    import tensorflow as tf

    specs = tf.nest.flatten(dataset.element_spec)
    return bool(specs) and all(
        type(spec) is tf.TensorSpec and spec.shape.rank not in (None, 0) for spec in specs
    )
