"""Keras 3 on TensorFlow reduces fit's and evaluate's step results across the workers of MultiWorkerMirroredStrategy (``keras_tf_multi_worker_mean``).

Every private Keras/TensorFlow name used comes from ``tfdist.core.upstream``.

Example:
    >>> [fix.name for fix in FIXES]
    ['keras_tf_multi_worker_mean']
"""

from __future__ import annotations

from typing import Any

from tfdist.core import upstream
from tfdist.core.cross_replica import (
    tf_var,
)
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["KERAS_TF_MULTI_WORKER_MEAN", "FIXES", "keras_tf_multi_worker_mean"]

# The fix's name, declared once (other layers import it).
KERAS_TF_MULTI_WORKER_MEAN = "keras_tf_multi_worker_mean"


# ------------------------------------------------- fix: multi-worker metric reduction


def _multi_worker_mean(strategy, value):
    """The mean of ``value`` over all replicas of all workers (see ``keras_tf_multi_worker_mean``)."""
    if upstream.tf_is_distributed_variable(tf_var(value)):
        # A metric whose result() returns its variable: reading it in cross-replica
        # context already gives the value every replica agrees on (a SyncOnRead
        # variable aggregates all replicas of all workers), as upstream's
        # single-worker branch returns it.
        return value
    return strategy.reduce("MEAN", value, axis=None)


def _multi_worker_means(strategy, values, tree) -> Any:
    """Every value's mean over all replicas of all workers, the scalars of each dtype
    stacked into one all-reduce (a step's loss and metrics: one collective, not one each).

    The mean of a stacked vector is the mean of each element, computed alike: the
    results are those of one reduction per value.
    """
    import tensorflow as tf

    leaves = tree.flatten(values)
    reduced: list = [None] * len(leaves)
    by_dtype: dict = {}
    for index, value in enumerate(leaves):
        local = strategy.experimental_local_results(value)
        if upstream.tf_is_distributed_variable(tf_var(value)) or not all(
            isinstance(t, tf.Tensor) and t.shape.rank == 0 for t in local
        ):
            reduced[index] = _multi_worker_mean(strategy, value)
        else:
            by_dtype.setdefault(local[0].dtype, []).append(index)
    for indexes in by_dtype.values():
        if len(indexes) == 1:
            reduced[indexes[0]] = _multi_worker_mean(strategy, leaves[indexes[0]])
            continue
        stacked = strategy.run(
            lambda *scalars: tf.stack(scalars), args=[leaves[i] for i in indexes]
        )
        means = strategy.reduce("MEAN", stacked, axis=None)
        for position, index in enumerate(indexes):
            reduced[index] = means[position]
    return tree.pack_sequence_as(values, reduced)


def keras_tf_multi_worker_mean() -> None:
    """Averages per-replica step results across workers with ``axis=None``.

    ``train_function``/``test_function`` return each replica's metric results and
    upstream ``reduce_per_replica(..., reduction="auto")`` averages them. On one
    worker it stacks the local results and takes ``tf.reduce_mean(..., axis=0)``: the
    mean across replicas. Under multi-worker it instead calls
    ``strategy.reduce("MEAN", v, axis=0)``, which also reduces along the value's own
    first axis; metric results are scalars, so it fails ("Invalid reduction dimension
    0 for input with 0 dimensions"), and for a non-scalar it would average the wrong
    axis. ``axis=None`` is the cross-worker form of the single-worker branch: the
    mean across all replicas of all workers. A metric whose ``result()`` returns its
    state variable (the Keras guide's example) hands back the variable itself; upstream
    fails on it ("Cannot convert `input_tensor` to a `PerReplica` object"), while the
    single-worker branch returns it unchanged: so does the fix (read in cross-replica
    context, a metric variable already holds the value of all replicas of all
    workers). Other reductions (``sum``, ``concat`` for ``predict``, ``first``) are left
    to upstream.
    """
    import tensorflow as tf

    tree = upstream.keras_tree()
    tf_trainer = upstream.keras_tf_trainer_module()

    def make(original):
        def reduce_per_replica(values, strategy, reduction):
            tpu = isinstance(strategy, tf.distribute.TPUStrategy)
            if (
                reduction in ("auto", "mean")
                and not tpu
                and upstream.tf_in_multi_worker_mode(strategy)
            ):
                return _multi_worker_means(strategy, values, tree)
            return original(values, strategy, reduction)

        return reduce_per_replica

    patch(tf_trainer, "reduce_per_replica", KERAS_TF_MULTI_WORKER_MEAN, make)


_KT = "keras.src.backend.tensorflow.trainer:"
_CARS = "tensorflow.python.distribute.collective_all_reduce_strategy:"

FIXES: list[Fix] = [
    Fix(
        KERAS_TF_MULTI_WORKER_MEAN,
        "Keras 3 fit/evaluate under MultiWorkerMirroredStrategy: 'Invalid reduction "
        "dimension 0 for input with 0 dimensions' in reduce_per_replica",
        on_keras_backend("tensorflow"),
        keras_tf_multi_worker_mean,
        targets=targets(
            _KT + "reduce_per_replica",
            "keras.src.tree:flatten",
            "keras.src.tree:pack_sequence_as",
            "keras.src.backend:Variable",
            _CARS + "CollectiveAllReduceExtended._in_multi_worker_mode",
            "tensorflow.python.distribute.distribute_utils:is_distributed_variable",
        ),
        acts_where=(
            "fit/evaluate step results (reduction auto/mean) under "
            "MultiWorkerMirroredStrategy with >1 worker; one worker, TPU, predict: "
            "upstream's path"
        ),
        no_harm=(
            "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes[2 workers]",
        ),
    ),
]
