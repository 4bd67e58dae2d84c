"""A ``PyDataset`` or a Python generator on several TensorFlow replicas: one shuffle
order on every worker, and the user's arrays left as they are.

Keras's ``fit(PyDataset)`` shuffles the batch order of each epoch with Python's global
``random``, drawn when tf.data's generator thread starts the epoch. Under
``MultiWorkerMirroredStrategy`` every worker runs the whole ``PyDataset`` and keeps its
share of each global batch, so workers whose ``random`` states differ (a script that does
not seed it, or draws from it a different number of times) take their shares of
different batches: each step trains on halves of two unrelated batches (every example
is still seen once an epoch), a result no single device gives. The
fix ``keras_tf_workers_agree_shuffle`` sets every worker's Python random state to the
chief's right before each shuffled epoch's draw (in tf.data's generator thread, or in
the enqueuer's thread for ``workers > 1`` / ``use_multiprocessing``), as
``tfdist.compat.inputs.jax`` does for JAX processes, for models that train across the
workers only. One worker, a local model, or ``shuffle=False``, is left as upstream has it.

``tf.data.Dataset.from_generator``, which Keras's ``fit`` builds from a ``PyDataset`` or a
generator, hands TensorFlow the yielded numpy arrays without a copy when they start on a
64-byte boundary. Under a strategy with several replicas each global batch is cut into
per-replica slices; the slice that starts at the array's first byte reaches the step as
a tensor TensorFlow treats as its own, and the step's ops, which may write their result
into an input's memory, overwrite the user's array in place (the labels, here): a script that yields views of its training arrays
(``Y[start:end]``) trains its next epoch, and any later ``fit``, on overwritten labels.
Whether it happens depends on where the array lies in memory, so it came and went between
runs of the same job. The fix ``keras_tf_generator_batches_copied`` copies every numpy
array a ``PyDataset`` or a generator yields before TensorFlow sees it (one copy of a batch
per step).

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import functools
import itertools
import json
import random

from tfdist.core import config, exit_hold, roles, upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "KERAS_TF_WORKERS_AGREE_SHUFFLE",
    "KERAS_TF_GENERATOR_BATCHES_COPIED",
    "FIXES",
    "keras_tf_workers_agree_shuffle",
    "agree_python_random",
    "keras_tf_generator_batches_copied",
]

# The fixes' names, declared once (other layers import them).
KERAS_TF_WORKERS_AGREE_SHUFFLE = "keras_tf_workers_agree_shuffle"
KERAS_TF_GENERATOR_BATCHES_COPIED = "keras_tf_generator_batches_copied"

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
        >>> agree_python_random(chief=roles.is_chief())  # doctest: +SKIP
    """
    import tensorflow as tf

    key = f"tfdist/tf_inputs/python_random/{next(_AGREEMENTS)}"
    exit_hold.arm_tensorflow()  # the chief must not leave before the others have read it
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


def _spans_workers(strategy) -> bool:
    """Whether ``strategy`` trains with collectives across several workers."""
    extended = getattr(strategy, "extended", None)
    if not isinstance(extended, upstream.tf_collective_extended_class()):
        return False
    return upstream.tf_extended_num_workers(extended) > 1 and _cluster() is not None


def keras_tf_workers_agree_shuffle() -> None:
    """Agrees the chief's Python random state right before each shuffled epoch's draw of
    a model that trains across the workers.

    Keras draws the order once an epoch with Python's global ``random``: in
    ``PyDatasetAdapter._finite_generator``, which tf.data starts in its own thread, or,
    for a ``PyDataset`` with ``workers > 1`` or ``use_multiprocessing``, in
    ``OrderedEnqueuer._run``, the enqueuer's thread. The fix runs the agreement at the
    start of both, before upstream's ``random.shuffle``: the chief publishes its state,
    the others take it. It marks the adapter when a ``TFEpochIterator`` is made for a
    strategy spanning the workers, so a model trained on one worker alone (a probe, a
    helper model outside the scope) draws as upstream does and shifts no later agreement.
    The chief's own draws are untouched, so one worker's job is as upstream has it; an
    unshuffled ``PyDataset`` draws nothing and agrees nothing.
    """

    def agree_if_marked(holder) -> None:
        if getattr(holder, "shuffle", False) and getattr(holder, "tfdist_agree_shuffle", False):
            cluster = _cluster()
            if cluster is not None:
                agree_python_random(chief=roles.of_cluster(cluster).is_chief)

    def make_generator(original):
        def _finite_generator(self):
            agree_if_marked(self)
            yield from original(self)

        return _finite_generator

    def make_run(original):
        def _run(self):
            try:
                agree_if_marked(self)
            except Exception as error:  # noqa: BLE001 - upstream's _run reports through the queue
                self.future_queue.put(error)
                return
            original(self)

        return _run

    def make_epoch_iterator(original):
        def __init__(self, distribute_strategy=None, *args, **kwargs):
            original(self, distribute_strategy, *args, **kwargs)
            adapter = self.data_adapter
            if isinstance(adapter, upstream.keras_py_dataset_adapter_class()):
                agree = _spans_workers(distribute_strategy)
                adapter.tfdist_agree_shuffle = agree
                if adapter.enqueuer is not None:
                    adapter.enqueuer.tfdist_agree_shuffle = agree

        return __init__

    patch(
        upstream.keras_py_dataset_adapter_class(),
        "_finite_generator",
        KERAS_TF_WORKERS_AGREE_SHUFFLE,
        make_generator,
    )
    patch(upstream.keras_ordered_enqueuer_class(), "_run", KERAS_TF_WORKERS_AGREE_SHUFFLE, make_run)
    patch(
        upstream.keras_tf_trainer_module().TFEpochIterator,
        "__init__",
        KERAS_TF_WORKERS_AGREE_SHUFFLE,
        make_epoch_iterator,
    )


def _owned(batch):
    """``batch`` with each numpy array replaced by a copy only TensorFlow holds."""
    import numpy as np

    return upstream.keras_tree().map_structure(
        lambda value: value.copy() if isinstance(value, np.ndarray) else value, batch
    )


def _copying(generator_function):
    @functools.wraps(generator_function)
    def batches(*args, **kwargs):
        for batch in generator_function(*args, **kwargs):
            yield _owned(batch)

    batches.tfdist_copies = True
    return batches


def keras_tf_generator_batches_copied() -> None:
    """Copies the numpy arrays a ``PyDataset`` or a generator yields to TensorFlow.

    Both adapters hand their batches to ``tf.data.Dataset.from_generator``, whose
    conversion keeps a 64-byte-aligned array's memory as the tensor's; once a strategy
    cuts the batch into replicas' slices, the first slice's memory can be reused in place
    by the step's ops, writing into the user's array (2 replicas, ``Y[0:16]`` yielded:
    rows 0-7 change). A copy per batch leaves that memory to TensorFlow alone.
    Keras's ``PyDatasetAdapter._get_iterator`` (what ``from_generator`` iterates) and the
    generator adapter's ``generator`` (read by ``get_tf_dataset``'s iterator) are wrapped.
    """
    adapters = upstream.keras_shareable_adapter_classes()
    py_dataset, generator = adapters[1], adapters[2]
    patch(py_dataset, "_get_iterator", KERAS_TF_GENERATOR_BATCHES_COPIED, _copying)

    def make(original):
        def get_tf_dataset(self):
            if not getattr(self.generator, "tfdist_copies", False):
                self.generator = _copying(self.generator)
            return original(self)

        return get_tf_dataset

    patch(generator, "get_tf_dataset", KERAS_TF_GENERATOR_BATCHES_COPIED, make)


FIXES = [
    Fix(
        KERAS_TF_WORKERS_AGREE_SHUFFLE,
        "Keras 3 fit(PyDataset) under MultiWorkerMirroredStrategy shuffles each worker's "
        "batch order with its own Python random state: examples trained twice or never",
        on_keras_backend("tensorflow"),
        keras_tf_workers_agree_shuffle,
        targets=targets(
            "keras.src.trainers.data_adapters.py_dataset_adapter:PyDatasetAdapter._finite_generator",
            "keras.src.trainers.data_adapters.py_dataset_adapter:OrderedEnqueuer._run",
            "keras.src.backend.tensorflow.trainer:TFEpochIterator.__init__",
        ),
        acts_where=(
            "a shuffled PyDataset (any workers, multiprocessing) of a model trained across "
            "TensorFlow workers; one worker, a local model, shuffle=False: upstream's path"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_TF_GENERATOR_BATCHES_COPIED,
        "Keras 3 fit(PyDataset or generator) on TensorFlow with several replicas: the "
        "step's ops overwrite the numpy arrays the generator yields (when 64-byte "
        "aligned), so later epochs train on corrupted labels",
        on_keras_backend("tensorflow"),
        keras_tf_generator_batches_copied,
        targets=targets(
            "keras.src.trainers.data_adapters.py_dataset_adapter:PyDatasetAdapter._get_iterator",
            "keras.src.trainers.data_adapters.generator_data_adapter:GeneratorDataAdapter.get_tf_dataset",
            "keras.src.trainers.data_adapters.generator_data_adapter:GeneratorDataAdapter.generator (instance)",
        ),
        acts_where=(
            "every PyDataset or generator input on TensorFlow, any replica count (one copy "
            "of each numpy batch); arrays, tf.data: untouched"
        ),
        no_harm=(),  # none yet
    ),
]
