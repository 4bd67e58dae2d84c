"""Custom loops on TensorFlow (``strategy.run``): a pipeline of global batches handed to
tfdist's strategy, and the loss averaged over the step's global batch.

Example:
    >>> dist_train = distribute(tfdist.data.pipeline(ds, global_batch=64, seed=0))  # doctest: +SKIP
"""

from __future__ import annotations

from tfdist import distribute as _distribute
from tfdist.core import validate

__all__ = ["distribute", "average_loss"]


def distribute(dataset, *, strategy=None):
    """``strategy.experimental_distribute_dataset`` with tfdist's strategy, for a pipeline
    of GLOBAL batches (``tfdist.data.pipeline``): each replica gets its slice of each.

    Example:
        >>> dist_train = distribute(tfdist.data.pipeline(ds, global_batch=64, seed=0))  # doctest: +SKIP
        >>> for batch in dist_train: strategy.run(step, args=(batch,))  # doctest: +SKIP
    """
    import tensorflow as tf

    what = "a tf.data.Dataset of global batches, e.g. tfdist.data.pipeline(...)"
    validate.instance(dataset, tf.data.Dataset, "dataset", "tfdist.loops.distribute", what)
    return _distribute.current(strategy).experimental_distribute_dataset(dataset)


def average_loss(per_example_loss, *, global_batch_size=None, sample_weight=None):
    """``tf.nn.compute_average_loss`` over the step's GLOBAL batch, inside ``strategy.run``.

    Without ``global_batch_size``, the global batch is the sum of every replica's batch
    (one small all-reduce), so a short last batch is averaged over its true size.

    Example:
        >>> def step_fn(x, y):                                        # doctest: +SKIP
        ...     loss = average_loss(loss_fn(y, model(x, training=True)))
    """
    import tensorflow as tf

    if global_batch_size is None:
        context = tf.distribute.get_replica_context()  # the default one without a strategy
        if context is None:  # in a strategy's scope, outside strategy.run
            raise RuntimeError(
                "tfdist.loops.average_loss: call it inside strategy.run (replica context). "
                f"Received: per_example_loss={per_example_loss!r:.80}. Or pass "
                "global_batch_size=... explicitly."
            )
        local = tf.shape(per_example_loss, out_type=tf.int64)[0]
        global_batch_size = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
    return tf.nn.compute_average_loss(
        per_example_loss, sample_weight=sample_weight, global_batch_size=global_batch_size
    )
