"""A shuffled ``PyDataset`` on several TensorFlow workers: one order, every example once.

Keras's ``fit(PyDataset)`` shuffles the batch order of each epoch with Python's global
``random``, drawn when tf.data's generator thread starts the epoch. Under
``MultiWorkerMirroredStrategy`` every worker runs the whole ``PyDataset`` and keeps its
share of each global batch, so workers whose ``random`` states differ (a script that does
not seed it, or draws from it a different number of times) take their shares of
different batches: each step trains on halves of two unrelated batches (every example
is still seen once an epoch), a result no single device gives. The
fix ``keras_tf_workers_agree_shuffle`` sets every worker's Python random state to the
chief's right before each shuffled epoch's draw, as ``tfdist.compat.jax_inputs`` does for
JAX processes. One worker, or ``shuffle=False``, is left as upstream has it.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import itertools
import json
import random

from tfdist.core import config, upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["FIXES", "fix_workers_agree_shuffle", "agree_python_random"]

_AGREEMENTS = itertools.count()


def _cluster():
    """This worker's cluster when it trains with collectives across workers, else None."""
    from tfdist.core.cluster import cluster_from_env

    cluster = cluster_from_env()
    if not cluster.is_multi_worker or not upstream.tf_collectives_configured():
        return None
    return cluster


def agree_python_random(chief: bool, timeout: float = config.SEED_AGREEMENT_TIMEOUT_S) -> None:
    """Sets Python's global random state to the chief's on every worker.

    Every worker must call it at the same point: the n-th call of each reads the n-th
    state the chief published in the coordination service's store, waiting up to
    ``timeout`` seconds.

    Example:
        >>> agree_python_random(chief=cluster_from_env().is_chief)  # doctest: +SKIP
    """
    import tensorflow as tf

    key = f"tfdist/tf_inputs/python_random/{next(_AGREEMENTS)}"
    if chief:
        version, internal, gauss_next = random.getstate()
        upstream.tf_key_value_set(key, json.dumps([version, list(internal), gauss_next]))
        return
    try:
        text = upstream.tf_key_value_get(key, round(timeout * 1000))
    except tf.errors.OpError as err:
        raise TimeoutError(
            "tfdist: this worker did not receive the chief's random state for a shuffled "
            f"PyDataset epoch within {timeout:.0f} s ({type(err).__name__}). Every worker "
            "must call fit/evaluate/predict with the same inputs in the same order."
        ) from None
    version, internal, gauss_next = json.loads(text)
    random.setstate((version, tuple(internal), gauss_next))


def fix_workers_agree_shuffle() -> None:
    """Agrees the chief's Python random state right before each shuffled epoch's draw.

    Keras draws the order in ``PyDatasetAdapter._finite_generator``, which tf.data starts
    in its own thread, once an epoch (the next epoch's iterator is made, and may start,
    at the end of the previous one). The fix runs the agreement at the start of that
    generator, before upstream's ``random.shuffle``: the chief publishes its state, the
    others take it. The chief's own draws are untouched, so one worker's job is as
    upstream has it; an unshuffled ``PyDataset`` draws nothing and agrees nothing.
    """

    def make(original):
        def _finite_generator(self):
            cluster = _cluster() if self.shuffle else None
            if cluster is not None:
                agree_python_random(chief=cluster.is_chief)
            yield from original(self)

        return _finite_generator

    patch(
        upstream.keras_py_dataset_adapter_class(),
        "_finite_generator",
        "keras_tf_workers_agree_shuffle",
        make,
    )


FIXES = [
    Fix(
        "keras_tf_workers_agree_shuffle",
        "Keras 3 fit(PyDataset) under MultiWorkerMirroredStrategy shuffles each worker's "
        "batch order with its own Python random state: examples trained twice or never",
        on_keras_backend("tensorflow"),
        fix_workers_agree_shuffle,
        targets=targets(
            "keras.src.trainers.data_adapters.py_dataset_adapter:PyDatasetAdapter._finite_generator",
        ),
    ),
]
