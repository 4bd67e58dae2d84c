"""Fixes to Keras 3 on the JAX backend.

Every private Keras name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import logging

from tfdist.core import roles, upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "KERAS_JAX_SHARDED_EPOCH_LENGTH",
    "KERAS_JAX_DISTRIBUTED_LOOKAHEAD",
    "KERAS_JAX_MODEL_KEEPS_DISTRIBUTION",
    "KERAS_JAX_INITIALIZE_ONCE",
    "keras_jax_initialize_once",
    "keras_jax_model_keeps_distribution",
    "keras_jax_distributed_lookahead",
    "keras_jax_sharded_epoch_length",
]

# The fixes' names, declared once (other layers import them).
KERAS_JAX_INITIALIZE_ONCE = "keras_jax_initialize_once"
KERAS_JAX_MODEL_KEEPS_DISTRIBUTION = "keras_jax_model_keeps_distribution"
KERAS_JAX_DISTRIBUTED_LOOKAHEAD = "keras_jax_distributed_lookahead"
KERAS_JAX_SHARDED_EPOCH_LENGTH = "keras_jax_sharded_epoch_length"

_ENTRY_POINTS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)

logger = logging.getLogger(__name__)


def keras_jax_initialize_once() -> None:
    """Lets ``keras.distribution.initialize()`` join a job jax was already initialised for.

    ``tfdist launch`` (and any script importing tfdist in a multi-process job) calls
    ``jax.distributed.initialize`` once, right after jax is imported, with tfdist's
    timeouts: upstream exposes none, so a dead or never-started peer hangs every process
    for jax's defaults (300 s to register, 100 s without heartbeat, 300 s at shutdown).
    A script written for upstream then calls ``keras.distribution.initialize()`` itself,
    and jax refuses a second initialisation ("distributed.initialize should only be
    called once"). The fix skips only the jax call when jax is already initialised (for
    the same job: process count and index are checked against what the script asked
    for) and keeps the rest of upstream's function: the random seed agreed across
    processes (``initialize_rng``), so every process builds the same initial weights.
    Without an earlier initialisation, upstream's function runs unchanged.
    """
    module = upstream.keras_jax_distribution_lib()

    def make(original):
        def initialize(job_addresses, num_processes, process_id):
            import jax

            if not jax.distributed.is_initialized():
                return original(job_addresses, num_processes, process_id)
            _check_same_job(num_processes, process_id)
            logger.debug("tfdist.compat: jax already initialised; agreeing on the seed only")
            module.initialize_rng()

        return initialize

    patch(module, "initialize", KERAS_JAX_INITIALIZE_ONCE, make)


def _check_same_job(num_processes, process_id) -> None:
    role = roles.jax_process()
    have = (role.count, role.rank)
    asked = (num_processes, process_id)
    if any(a is not None and int(a) != h for a, h in zip(asked, have, strict=True)):
        raise RuntimeError(
            "keras.distribution.initialize: jax is already initialised as process "
            f"{have[1]} of {have[0]}, but this call asks for num_processes={num_processes}, "
            f"process_id={process_id}. Remove the call (tfdist launch initialises the job) "
            "or make its arguments match."
        )


def keras_jax_model_keeps_distribution() -> None:
    """Runs ``fit``/``evaluate``/``predict`` under the distribution a model was built in.

    On TensorFlow a model remembers the strategy it was built under, so the guides'
    order works: build and compile inside ``with strategy.scope():``, call ``fit``
    after the block. On JAX, Keras reads only the distribution set *now*: after the
    block, ``fit`` feeds every batch whole to one device and, in a multi-process job,
    each process its whole dataset, so the step is no longer data parallel (a
    multi-process job then trains on the wrong batches). The fix records
    ``keras.distribution.distribution()`` when a model is created and, when a
    ``fit``/``evaluate``/``predict`` (or ``*_on_batch``) call finds no distribution
    set, runs it inside the recorded one's ``scope()``. When a distribution is set,
    or the model was created without one, upstream runs unchanged.
    """
    trainer_class = upstream.keras_jax_trainer_class()
    from keras import distribution as kd

    def make_init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.__dict__["_tfdist_distribution"] = kd.distribution()

        return __init__

    def make_entry(original):
        def entry(self, *args, **kwargs):
            recorded = self.__dict__.get("_tfdist_distribution")
            if recorded is None or kd.distribution() is not None:
                return original(self, *args, **kwargs)
            with recorded.scope():
                return original(self, *args, **kwargs)

        return entry

    patch(upstream.keras_trainer_class(), "__init__", KERAS_JAX_MODEL_KEEPS_DISTRIBUTION, make_init)
    for name in _ENTRY_POINTS:
        patch(trainer_class, name, KERAS_JAX_MODEL_KEEPS_DISTRIBUTION, make_entry)


def keras_jax_distributed_lookahead() -> None:
    """Copies the next batch to the accelerators while the current step runs, as without
    a distribution.

    Upstream's JAX epoch iterator starts each batch's host-to-device copy one step ahead
    only when no distribution is set (``_one_batch_ahead_iterator``); under any
    ``keras.distribution`` (``DataParallel``, ``ModelParallel``: tfdist's or hand-written)
    each batch is copied just before its step, so the copy is never overlapped with
    compute. Measured on one H100 (MNIST convnet): a step under ``DataParallel`` took
    1.29-1.76x the undistributed one at global batch 1024-8192; with one batch of
    look-ahead, 0.98-1.05. The fix yields the same batches in the same order, one
    ``_distribute_data`` call earlier (the copy is asynchronous). On the CPU backend
    upstream deliberately does no look-ahead ("no benefit on CPU"), and the fix keeps that:
    upstream runs unchanged there.
    """

    def make(original):
        def _get_distributed_iterator(self, distribution):
            import jax

            batches = original(self, distribution)
            if jax.default_backend() == "cpu":
                return batches
            return _one_ahead(batches)

        return _get_distributed_iterator

    patch(
        upstream.keras_jax_epoch_iterator_class(),
        "_get_distributed_iterator",
        KERAS_JAX_DISTRIBUTED_LOOKAHEAD,
        make,
    )


def _one_ahead(batches):
    """Yields each item once the next one has been produced (started its copy)."""
    pending = None
    for batch in batches:
        if pending is not None:
            yield pending
        pending = batch
    if pending is not None:
        yield pending


def keras_jax_sharded_epoch_length() -> None:
    """Keeps a dataset's declared epoch length through Keras's per-process sharding.

    In a multi-process job ``Distribution.distribute_tf_dataset`` gives each process its
    share of every global batch (``rebatch`` then ``shard``, or ``prefetch``), and the
    result's length is recomputed from the graph: a length the dataset declared (as
    ``tfdist.data.pipeline`` does for a seeded or shuffled pipeline, whose epochs start
    inside a per-epoch function) becomes unknown. Keras then takes the first epoch's
    length for every epoch, so a job resumed in the middle of an epoch runs every later
    epoch short (measured: 2 processes x 2 devices, 8 batches an epoch, resumed at batch
    6 of epoch 0: epoch 1 ran 3 batches instead of 8). The fix declares the source's
    length on the sharded dataset when upstream lost it and every batch is full (a
    process then sees exactly one batch per global batch); otherwise upstream's dataset
    is returned unchanged.
    """

    def make(original):
        def distribute_tf_dataset(self, dataset):
            from tfdist.core.full_epochs import keep_epoch_length

            return keep_epoch_length(dataset, original(self, dataset))

        return distribute_tf_dataset

    patch(
        upstream.keras_distribution_class(),
        "distribute_tf_dataset",
        KERAS_JAX_SHARDED_EPOCH_LENGTH,
        make,
    )


# Module prefixes of the targets below.
_KJ = "keras.src.backend.jax.trainer:"
_DS = "tensorflow.python.data.ops.dataset_ops:"

FIXES: list[Fix] = [
    Fix(
        KERAS_JAX_INITIALIZE_ONCE,
        "Keras 3 on JAX: keras.distribution.initialize() after jax was initialised (by "
        "tfdist, with timeouts) fails: 'distributed.initialize should only be called once'",
        on_keras_backend("jax"),
        keras_jax_initialize_once,
        targets=targets(
            "keras.src.backend.jax.distribution_lib:initialize",
            "keras.src.backend.jax.distribution_lib:initialize_rng",
        ),
        acts_where=(
            "keras.distribution.initialize() when jax.distributed is already initialised "
            "(tfdist launch); otherwise upstream's call"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_JAX_MODEL_KEEPS_DISTRIBUTION,
        "Keras 3 on JAX: fit after `with distribution.scope():` is no longer data "
        "parallel (the model does not remember its distribution, as it does on TensorFlow)",
        on_keras_backend("jax"),
        keras_jax_model_keeps_distribution,
        targets=targets(
            "keras.src.trainers.trainer:Trainer.__init__",
            _KJ + "JAXTrainer.fit",
            _KJ + "JAXTrainer.evaluate",
            _KJ + "JAXTrainer.predict",
            _KJ + "JAXTrainer.train_on_batch",
            _KJ + "JAXTrainer.test_on_batch",
            _KJ + "JAXTrainer.predict_on_batch",
        ),
        acts_where=(
            "fit/evaluate/predict and `*_on_batch` of a model created under a keras.distribution, "
            "called with none set; otherwise upstream's (the model only records it)"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_JAX_DISTRIBUTED_LOOKAHEAD,
        "Keras 3 on JAX: under a keras.distribution each batch is copied to the devices "
        "just before its step (no look-ahead): up to 1.76x slower per step on one H100",
        on_keras_backend("jax"),
        keras_jax_distributed_lookahead,
        targets=targets(
            _KJ + "JAXEpochIterator._get_distributed_iterator",
        ),
        acts_where=(
            "the JAX epoch iterator under a keras.distribution on GPU/TPU; CPU backend: "
            "upstream's path"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_JAX_SHARDED_EPOCH_LENGTH,
        "Keras 3 on JAX, multi-process: sharding a dataset per process loses its declared "
        "length, so after a mid-epoch resume every later epoch is cut short",
        on_keras_backend("jax"),
        keras_jax_sharded_epoch_length,
        targets=targets(
            "keras.src.distribution.distribution_lib:Distribution.distribute_tf_dataset",
            _DS + "DatasetV2._variant_tensor",
        ),
        acts_where=(
            "Distribution.distribute_tf_dataset when upstream's sharding loses a known "
            "length of full batches (datasets keras_jax_partial_batch_share leaves); else "
            "upstream's"
        ),
        no_harm=(),  # none yet
    ),
]
