"""A partial last batch on several JAX processes or devices: each process feeds its equal
part, and a batch that cannot be split evenly is refused before the first step.

On JAX a global batch is one array over every device, so one process computes one
device's loss; with several processes Keras feeds each its part of a ``tf.data`` batch by
``rebatch(global / processes)`` then ``shard``, which cuts the partial last batch into
one full part and a short one (40 of 64 -> 32 + 8): the processes then assemble arrays of
different global shapes and train apart, silently (measured: 2e-2 from one device).

* ``keras_jax_partial_batch_share``: each process takes its equal, contiguous part of
  every global batch, the partial one too; a batch that cannot be split evenly between
  the data-parallel replicas stops the job with an error naming its size. The parts are
  cut from each batch as it comes, so a dataset whose batch size only the data knows
  (batch then ``map``, ``class_weight``, ``padded_batch``, a generator), which upstream
  refuses ("The batch size of the input dataset is unknown"), is fed too.

* ``keras_jax_evaluate_predict_uneven_batches``: ``evaluate`` and ``predict`` (and their
  ``*_on_batch``) take a batch that the replicas cannot split evenly (one image on 2
  devices, a last batch of one): that batch is placed whole on every device, so each
  computes one device's result for it. Over several processes each feeds it whole
  (numpy arrays, ``PyDataset``, generators: ``jax_inputs.WholeBatch``); a ``tf.data``
  batch there is still refused. Training refuses it everywhere (above).

The batch sizes a pipeline tells come from ``batch_order.batch_sizes``. Every private
name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import math

from tfdist.compat.inputs import jax as jax_inputs
from tfdist.compat.partial_batches import map_elements, splittable
from tfdist.core import roles, upstream
from tfdist.core.batch_order import batch_sizes
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "KERAS_JAX_EVALUATE_PREDICT_UNEVEN_BATCHES",
    "KERAS_JAX_PARTIAL_BATCH_SHARE",
    "KERAS_JAX_UNEVEN_BATCH_REFUSED_FIRST",
    "FIXES",
    "keras_jax_evaluate_predict_uneven_batches",
    "keras_jax_partial_batch_share",
    "keras_jax_uneven_batch_refused_first",
    "process_share",
]

# The fixes' names, declared once (other layers import them).
KERAS_JAX_UNEVEN_BATCH_REFUSED_FIRST = "keras_jax_uneven_batch_refused_first"
KERAS_JAX_PARTIAL_BATCH_SHARE = "keras_jax_partial_batch_share"
KERAS_JAX_EVALUATE_PREDICT_UNEVEN_BATCHES = "keras_jax_evaluate_predict_uneven_batches"

_INFERENCE_CALLS = ("evaluate", "predict", "test_on_batch", "predict_on_batch")


def process_share(dataset, index: int, parts: int, replicas: int):
    """Part ``index`` of ``parts`` equal, contiguous parts of every batch of ``dataset``;
    a batch whose size does not divide by ``replicas`` (or ``parts``) fails with a message
    naming its size.

    Example:
        >>> import tensorflow as tf
        >>> ds = process_share(tf.data.Dataset.range(6).batch(6), 1, 2, 2)
        >>> [p.numpy().tolist() for p in ds]  # doctest: +SKIP
        [[3, 4, 5]]
    """
    import tensorflow as tf

    unit = math.lcm(replicas, parts)

    def part_of(element):
        size = tf.shape(tf.nest.flatten(element)[0], out_type=tf.int64)[0]
        message = tf.strings.format(
            "tfdist: a batch of {} examples cannot be split evenly between "
            + f"{replicas} data-parallel replicas ({parts} processes feed one part each): "
            + "Keras on JAX gives every replica the same number of examples. A partial "
            + f"last batch must be a multiple of {unit}: batch with drop_remainder=True, "
            + f"or choose a dataset size whose last batch divides by {unit}.",
            [size],
        )
        with tf.control_dependencies([tf.debugging.Assert(tf.equal(size % unit, 0), [message])]):
            length = size // parts
        return tf.nest.map_structure(lambda t: t[index * length : (index + 1) * length], element)

    return map_elements(dataset, part_of)


def _refuse_uneven_batch_size(dataset, share) -> None:
    """A batch size the pipeline tells without reading data (the full batches, as upstream
    computes it, and the last one where ``batch_sizes`` can tell) that cannot be split
    evenly: refused now, before the first step (upstream refuses only the full size)."""
    unit = math.lcm(share.replicas, share.parts)
    full = upstream.tf_static_batch_size(dataset)
    every = batch_sizes(dataset) or set()
    uneven = sorted({s for s in every | {full} if s is not None and s % unit})
    if not uneven:
        return
    full_uneven = full is not None and full % unit
    received = full if full_uneven else uneven[0]
    last = "" if full_uneven else " (the dataset's last batch)"
    raise ValueError(
        "Global batch size must be divisible by the number of data-parallel replicas "
        f"and of the processes that feed them: tfdist cuts every batch into {unit} "
        f"equal parts ({share.replicas} replicas, {share.parts} processes). Received: "
        f"global_batch_size={received}{last}. Batch the "
        f"dataset with a multiple of {unit}, and give it a size whose last batch is one "
        "too (or drop_remainder=True)."
    )


def keras_jax_partial_batch_share() -> None:
    """Feeds each JAX process an equal, contiguous part of every global batch.

    Upstream's ``distribute_tf_dataset`` rebatches a ``tf.data.Dataset`` into
    ``global / processes`` examples and deals the pieces out (``shard``); a partial last
    batch then becomes one full piece and a short one, and each process builds its global
    array from its own piece's shape. The fix cuts every batch into the same ``parts``
    Keras uses (``Distribution.data_shard_id`` of ``min(processes, replicas)``) by
    slicing it: for full batches these are exactly upstream's pieces, in the same order,
    and for the partial batch every process gets ``size / parts`` examples. A batch size
    tf.data knows from the pipeline that cannot be split evenly is refused before the
    first step, as upstream refuses it (Keras's own ``distribution_lib_test`` checks the
    message), and so is a last batch the pipeline tells (``batch_sizes``: a ``batch``
    whose input has a known cardinality); a partial batch only the data reveals fails
    when it comes. One process,
    a distribution that does not shard its data, or elements that are not dense batched
    tensors keep upstream's path.
    """

    def make(original):
        def distribute_tf_dataset(self, dataset):
            share = jax_inputs._share_of(self)
            if share is None or not splittable(dataset):
                return original(self, dataset)
            _refuse_uneven_batch_size(dataset, share)
            import tensorflow as tf

            from tfdist.core.full_epochs import keep_epoch_length

            parts = process_share(dataset, share.index, share.parts, share.replicas)
            # A length the dataset declared (tfdist.data.pipeline's) stays declared.
            return keep_epoch_length(dataset, parts.prefetch(tf.data.AUTOTUNE))

        return distribute_tf_dataset

    patch(
        upstream.keras_distribution_class(),
        "distribute_tf_dataset",
        KERAS_JAX_PARTIAL_BATCH_SHARE,
        make,
    )


def _one_process_replicas() -> int:
    """The data-parallel replicas of this one process's ``keras.distribution``; 1
    without one, or when several processes feed it (``keras_jax_partial_batch_share``
    and ``keras_jax_multi_process_inputs`` check those)."""
    from keras import distribution as kd

    distribution = kd.distribution()
    if distribution is None or int(distribution.num_processes) != 1:
        return 1
    return int(distribution.num_model_replicas)


def keras_jax_uneven_batch_refused_first() -> None:
    """Refuses, before the first step, a batch that one JAX process cannot split evenly
    between its devices, when the batch sizes are known.

    Under a ``keras.distribution`` over several devices of one process, every batch is
    one array split evenly between them; upstream finds a batch that cannot be (a last
    batch of 89 at 128 on 2 devices) only when it comes, with jax's ``IndivisibleError``,
    after a whole epoch of training (measured: 41 examples at 8 on 2 devices, 5 steps
    trained first). The fix reads the sizes before the first step: arrays from Keras's
    own adapter (its batch size and last partial batch), a ``tf.data`` pipeline where
    ``batch_sizes`` can tell; and raises with the sizes and what to do. Sizes only the
    data reveals, other inputs, one device, several processes: upstream's path.
    """
    module = upstream.keras_data_adapters_module()

    def make(original):
        def get_data_adapter(x, *args, **kwargs):
            adapter = original(x, *args, **kwargs)
            replicas = _one_process_replicas()
            if replicas > 1 and not _uneven_batches_taken():
                sizes = _adapter_batch_sizes(adapter, x)
                uneven = sorted(size for size in sizes or () if size % replicas)
                if uneven:
                    raise ValueError(
                        f"tfdist: a batch of {uneven[0]} examples cannot be split evenly "
                        f"between the {replicas} devices of the keras.distribution (batch "
                        f"sizes {sorted(sizes)}): Keras on JAX gives every device the same "
                        f"number of examples, and jax would fail when that batch comes. "
                        f"Use a batch size and a dataset size whose every batch is a "
                        f"multiple of {replicas} (or drop_remainder=True)."
                    )
            return adapter

        return get_data_adapter

    patch(module, "get_data_adapter", KERAS_JAX_UNEVEN_BATCH_REFUSED_FIRST, make)


def _uneven_batches_taken() -> bool:
    """Whether an uneven batch is taken here: in evaluate or predict, which set the flag
    only where ``keras_jax_evaluate_predict_uneven_batches`` is applied."""
    return jax_inputs.INFERENCE.get()


def keras_jax_evaluate_predict_uneven_batches() -> None:
    """Places a batch the devices cannot split evenly whole on every device, in
    ``evaluate`` and ``predict`` of one process.

    Upstream shards every batch along its first axis over the distribution's devices,
    and jax refuses a batch whose size does not divide by their number (one image on 2
    devices: ``IndivisibleError``). One device computes any batch. In ``evaluate``,
    ``predict``, ``test_on_batch`` and ``predict_on_batch`` of a one-process job, such a
    batch gets a replicated placement instead: every device holds it whole and computes
    exactly one device's result, and jit compiles the step once more for that placement.
    Batches that divide evenly, training, and several processes keep upstream's path.
    """

    def make_call(original):
        def call(self, *args, **kwargs):
            token = jax_inputs.INFERENCE.set(True)
            try:
                return original(self, *args, **kwargs)
            finally:
                jax_inputs.INFERENCE.reset(token)

        return call

    trainer = upstream.keras_jax_trainer_class()
    for name in _INFERENCE_CALLS:
        patch(trainer, name, KERAS_JAX_EVALUATE_PREDICT_UNEVEN_BATCHES, make_call)

    def make_input(original):
        def distribute_data_input(per_process_batch, layout, batch_dim_name):
            whole = _replicated_if_uneven(per_process_batch, layout)
            if whole is not None:
                return whole
            return original(per_process_batch, layout, batch_dim_name)

        return distribute_data_input

    patch(
        upstream.keras_jax_distribution_lib(),
        "distribute_data_input",
        KERAS_JAX_EVALUATE_PREDICT_UNEVEN_BATCHES,
        make_input,
    )


def _replicated_if_uneven(batch, layout):
    """``batch`` on every device of ``layout``'s mesh when it is an inference batch the
    layout cannot split evenly (one process), or one every process feeds whole (several:
    ``jax_inputs.WholeBatch``); else None (upstream's placement)."""
    import jax
    import numpy as np

    if not jax_inputs.INFERENCE.get():
        return None
    sharding = getattr(layout, "backend_layout", layout)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    shape = getattr(batch, "shape", None)
    if mesh is None or spec is None or not shape or not len(spec) or spec[0] is None:
        return None
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if roles.jax_process().count > 1:
        if not isinstance(batch, jax_inputs.whole_batch_class()):
            return None  # this process's part of an even batch
        return jax.make_array_from_process_local_data(whole, np.asarray(batch))
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    parts = math.prod(int(mesh.shape[axis]) for axis in axes)
    if shape[0] % parts == 0:
        return None
    return jax.device_put(batch, whole)


def _adapter_batch_sizes(adapter, x) -> set[int] | None:
    """The batch sizes an adapter will yield, when known before any data is read."""
    import sys

    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(x, tf.data.Dataset):
        return batch_sizes(x)
    batch = getattr(adapter, "batch_size", None)
    count = getattr(adapter, "num_batches", None)
    if not isinstance(adapter, upstream.keras_array_data_adapter_class()) or not batch:
        return None
    partial = adapter.partial_batch_size or 0
    full = {batch} if count and count > (1 if partial else 0) else set()
    return full | ({partial} if partial else set())


FIXES = [
    Fix(
        KERAS_JAX_EVALUATE_PREDICT_UNEVEN_BATCHES,
        "Keras on JAX: evaluate and predict of a batch the devices cannot split evenly "
        "(one image on 2 devices) fail with jax's IndivisibleError",
        on_keras_backend("jax"),
        keras_jax_evaluate_predict_uneven_batches,
        targets=targets(
            "keras.src.backend.jax.trainer:JAXTrainer.evaluate",
            "keras.src.backend.jax.trainer:JAXTrainer.predict",
            "keras.src.backend.jax.trainer:JAXTrainer.test_on_batch",
            "keras.src.backend.jax.trainer:JAXTrainer.predict_on_batch",
            "keras.src.backend.jax.distribution_lib:distribute_data_input",
        ),
        acts_where=(
            "evaluate, predict (*_on_batch) on >1 device, a batch the replicas cannot split "
            "(several processes: not tf.data): placed whole on every device; else upstream's"
        ),
        no_harm=(
            "tests/compat/test_empty_replicas.py::test_jax_evaluates_and_predicts_uneven_batches_as_one_device",
        ),
    ),
    Fix(
        KERAS_JAX_UNEVEN_BATCH_REFUSED_FIRST,
        "Keras on JAX, one process, several devices: a batch that cannot be split evenly "
        "between them fails only when it comes, with jax's IndivisibleError, after "
        "an epoch of training",
        on_keras_backend("jax"),
        keras_jax_uneven_batch_refused_first,
        targets=targets(
            "keras.src.trainers.data_adapters:get_data_adapter",
            "keras.src.trainers.data_adapters.array_data_adapter:ArrayDataAdapter.partial_batch_size",
            "keras.src.distribution.distribution_lib:Distribution.num_model_replicas",
        ),
        acts_where=(
            "get_data_adapter under a keras.distribution over >1 device of one process, "
            "arrays or tf.data with known batch sizes; other inputs, several processes: "
            "upstream's"
        ),
        no_harm=(
            "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes[jax 2 devices]",
        ),
    ),
    Fix(
        KERAS_JAX_PARTIAL_BATCH_SHARE,
        "Keras on JAX, several processes: a partial last tf.data batch is dealt out as one "
        "full part and a short one (the processes train apart, silently), and a batch "
        "size only the data knows is refused",
        on_keras_backend("jax"),
        keras_jax_partial_batch_share,
        targets=targets(
            "keras.src.distribution.distribution_lib:Distribution.distribute_tf_dataset",
            "keras.src.distribution.distribution_lib:Distribution.data_shard_id",
            "keras.src.distribution.distribution_lib:Distribution.num_model_replicas",
        ),
        acts_where=(
            "Distribution.distribute_tf_dataset over >1 process (auto_shard_dataset, dense "
            "batched tensors); one process, other elements: upstream's path"
        ),
        no_harm=(
            "tests/compat/test_upstream_keras.py::test_keras_tests_fail_with_the_fixes_only_where_they_fail_without[jax]",
        ),
    ),
]
