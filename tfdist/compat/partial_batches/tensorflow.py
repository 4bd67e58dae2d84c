"""A partial last batch on several replicas: each example weighs what it weighs on one
device, and tf.distribute hands no replica an empty share it can avoid (TensorFlow; JAX's
fixes: ``partial_batches.jax``).

Real datasets leave a partial last global batch (MNIST's 60000 examples at 128: 96).
``tf.distribute`` splits it between the replicas unevenly (64 + 24 of 88 on 2 replicas
when it finds the dataset's batch size: a replica's share is filled first) and hands a
replica no example at all when the batch is at most one replica's share (56 -> 56 + 0).
Two upstream defects follow, each fixed here (a third, each example's weight in the
loss, in ``loss_weights``):

* ``tf_distribute_partial_batch_evenly``: a replica handed no example aborts the process
  in oneDNN's MaxPool gradient (``Check failed: dtype() == expected_dtype``; an empty
  batch does so on one device too) and, with a Conv2D + ReLU before it, fails in oneDNN's
  fused kernels. The fix cuts every batch into slices whose sizes differ by at most one
  (6 on 4 replicas -> 2 + 2 + 1 + 1, in one process or over workers), so a replica is
  empty only for a batch with fewer examples than replicas.
* ``keras_tf_fit_refuses_empty_replicas``: training on a batch that still leaves a
  replica empty makes BatchNormalization's statistics NaN, silently, and aborts oneDNN's
  MaxPool gradient; ``fit`` refuses it, before the first step where the sizes are known
  (a model of Dense-like layers takes it and trains as before; see docs/data.md).

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math

from tfdist.compat.partial_batches import map_elements, splittable
from tfdist.core import upstream
from tfdist.core.batch_order import (
    KnownCut,
    batch_sizes,
    batch_sizes_of,
    dataset_batching,
    dealing_known,
    epoch_slices,
    ordered_batching,
    rebatch_in_order,
)
from tfdist.core.fix_registry import Fix, on_keras_backend, on_tensorflow_backend, patch, targets

__all__ = [
    "KERAS_TF_FIT_REFUSES_EMPTY_REPLICAS",
    "TF_DISTRIBUTE_PARTIAL_BATCH_EVENLY",
    "FIXES",
    "tf_distribute_partial_batch_evenly",
    "keras_tf_fit_refuses_empty_replicas",
    "split_balanced",
    "map_elements",
    "KnownCut",
    "fit_cut",
    "training_input_of",
    "leaves_a_replica_empty",
    "takes_empty_replicas",
    "batch_sizes",
    "batch_sizes_of",
    "ordered_batching",
    "epoch_slices",
]

# The fixes' names, declared once (other layers import them).
TF_DISTRIBUTE_PARTIAL_BATCH_EVENLY = "tf_distribute_partial_batch_evenly"
KERAS_TF_FIT_REFUSES_EMPTY_REPLICAS = "keras_tf_fit_refuses_empty_replicas"


def split_balanced(dataset, pieces: int):
    """Each batch of ``dataset`` as ``pieces`` consecutive slices whose sizes differ by at
    most one, the larger first (6 in 4 -> 2 + 2 + 1 + 1, 9 -> 3 + 2 + 2 + 2; in 2, TF's
    legacy ``ceil`` cut: 89 -> 45 + 44): a replica is empty only when the batch has
    fewer examples than there are replicas.

    Example:
        >>> import tensorflow as tf
        >>> ds = split_balanced(tf.data.Dataset.range(6).batch(6), 4)
        >>> [len(piece) for piece in ds]  # doctest: +SKIP
        [2, 2, 1, 1]
    """
    import tensorflow as tf

    # map -> unbatch -> map, ops tf.data's auto-sharding passes through: a file-based
    # pipeline over several workers keeps its sharding by file (a flat_map here makes it
    # shard records instead, and every worker reads every file).
    def spread(element):
        """The batch as ``pieces`` rows of equal width (gathered, the last index repeated
        where a slice is shorter), with each slice's length."""
        size = tf.shape(tf.nest.flatten(element)[0], out_type=tf.int64)[0]
        base, extra = size // pieces, size % pieces
        i = tf.range(pieces, dtype=tf.int64)
        starts = i * base + tf.minimum(i, extra)
        width = base + tf.cast(extra > 0, tf.int64)
        rows = starts[:, None] + tf.range(width, dtype=tf.int64)[None, :]
        rows = tf.minimum(rows, tf.maximum(size - 1, 0))
        lengths = base + tf.cast(i < extra, tf.int64)
        return tf.nest.map_structure(lambda t: tf.gather(t, rows), element), lengths

    def trim(element, length):
        return tf.nest.map_structure(lambda t: t[:length], element)

    return map_elements(dataset, spread).unbatch().map(trim)


def leaves_a_replica_empty(batch: int, replicas: int) -> bool:
    """Whether the fix's cut of a global batch of ``batch`` examples hands some replica
    no example: only a batch with fewer examples than replicas (1 on 2; 3 on 4, in one
    process or over several workers).

    Example:
        >>> leaves_a_replica_empty(1, 2), leaves_a_replica_empty(6, 4)
        (True, False)
    """
    return batch < replicas


class _TrainingInput:
    """``fit``'s training data, until tf.distribute cuts it (the first cut of that call)."""

    def __init__(
        self,
        sizes: set[int] | None,
        examples: int | None = None,
        batching: tuple[int, int, bool] | None = None,
    ):
        self.sizes = sizes  # of arrays, known from their length; None: ask the pipeline
        self.examples = examples
        self.batching = batching  # of arrays: (batch size, examples, False), in order
        self.cut = False
        self.known: KnownCut | None = None  # set by the cut, where the sizes are known

    def batches(self, dataset) -> tuple[set[int] | None, int | None]:
        """The batch sizes and number of examples of the training data, ``dataset``."""
        if self.sizes is not None:
            return self.sizes, self.examples
        batching = dataset_batching(dataset)  # one walk of the pipeline for both
        if batching is None:
            return None, None
        return batch_sizes_of(batching), batching[1]

    def ordered(self, dataset) -> tuple[int, int, bool] | None:
        """The training data's batching, when its batches come in order (``ordered_batching``)."""
        return self.batching if self.sizes is not None else ordered_batching(dataset)


_TRAINING_INPUT: contextvars.ContextVar[_TrainingInput | None] = contextvars.ContextVar(
    "tfdist_training_input", default=None
)
# The same, for the loss-weight fix: how fit's training data was cut (``fit_cut``).
_FIT_CUT: contextvars.ContextVar[_TrainingInput | None] = contextvars.ContextVar(
    "tfdist_fit_cut", default=None
)


@contextlib.contextmanager
def fit_cut(training: _TrainingInput):
    """Within this context the first dataset tf.distribute cuts is ``training``'s, and the
    cut records how it cut it in ``training.known`` (where the sizes are known)."""
    token = _FIT_CUT.set(training)
    try:
        yield training
    finally:
        _FIT_CUT.reset(token)


def training_input_of(signature: inspect.Signature, model, args, kwargs) -> _TrainingInput:
    """What ``fit(*args, **kwargs)`` trains on, as far as known before it starts."""
    try:
        return _array_batches(signature.bind(model, *args, **kwargs))
    except TypeError:  # upstream reports the bad call
        return _TrainingInput(None)


def _array_batches(bound: inspect.BoundArguments) -> _TrainingInput:
    """The batch sizes ``fit`` will train on when ``x`` holds arrays, as Keras's array
    adapter cuts them (``batch_size`` 32 by default, after ``validation_split``), and the
    number of examples; unknown (None) for other inputs."""
    import tensorflow as tf

    args = bound.arguments
    x = args.get("x")
    leaves = tf.nest.flatten(x)
    if x is None or not leaves or not all(hasattr(leaf, "shape") for leaf in leaves):
        return _TrainingInput(None)
    if isinstance(x, tf.data.Dataset) or not leaves[0].shape or leaves[0].shape[0] is None:
        return _TrainingInput(None)
    count = int(leaves[0].shape[0])
    if args.get("validation_split"):
        count = int(math.floor(count * (1.0 - args["validation_split"])))
    size = args.get("batch_size") or 32
    last = count % size
    sizes = ({size} if count >= size else set()) | ({last} if last else set())
    # Keras's array adapter yields the full batches, then the partial one.
    return _TrainingInput(sizes, count, (size, count, False))


def _empty_replica_guard(
    sizes: set[int] | None, replicas: int, workers: int, examples: int | None = None
):
    """Refuses a training batch the cut would leave a replica empty on: now (ValueError)
    when the batch sizes are known; otherwise returns a ``map`` function that fails in
    the input pipeline when such a batch comes, before any kernel sees an empty batch.
    None when every known size is safe."""
    import tensorflow as tf

    advice = (
        f"Give every global batch at least one example per replica: drop the last batch "
        f"(drop_remainder=True), or change the dataset or batch size so that the last "
        f"batch holds at least {replicas} examples."
    )
    if sizes is not None:
        empty = sorted(s for s in sizes if leaves_a_replica_empty(s, replicas))
        of = "" if examples is None else f" of {examples} examples"
        if empty:
            raise ValueError(
                f"tfdist: fit's training data has a batch of {empty[0]} example(s) "
                f"(batch sizes {sorted(sizes)}{of}), which leaves a replica of {replicas} "
                f"({workers} worker(s)) with no example; an empty replica makes "
                f"BatchNormalization's statistics NaN and aborts oneDNN's pooling "
                f"gradients. {advice}"
            )
        return None
    message = f"tfdist: a training batch leaves a replica of {replicas} with no example. "

    def guard(element):
        size = tf.shape(tf.nest.flatten(element)[0], out_type=tf.int64)[0]
        assertion = tf.debugging.Assert(size >= replicas, [message + advice + " Batch size:", size])
        with tf.control_dependencies([assertion]):
            return tf.nest.map_structure(tf.identity, element)

    return guard


def tf_distribute_partial_batch_evenly() -> None:
    """Splits each global batch between the replicas as evenly as possible, and refuses a
    training batch that would still leave a replica empty.

    Where ``tf.distribute`` finds the dataset's batch size it rebatches with fixed
    per-replica sizes, so a partial last batch fills the first replicas' shares and
    leaves the last ones short or empty (56 of 128 on 2 replicas -> 56 + 0), and an empty
    replica aborts oneDNN's MaxPool gradient. Where it does not find the batch size it
    uses its legacy rebatch, which cuts every batch into ``N`` slices of ``ceil(B / N)``
    (on 4 replicas, 6 -> 2 + 2 + 2 + 0: an empty replica in a full batch). The fix cuts
    every batch, on every topology, into ``N`` consecutive slices whose sizes differ by
    at most one (``split_balanced``: 6 -> 2 + 2 + 1 + 1; on 2 replicas this is the
    ``ceil`` cut, 89 -> 45 + 44), so a replica is empty only for a batch with fewer
    examples than replicas. Between workers, tf.distribute's sharding that follows deals
    the slices out in turn (DATA or AUTO sharding of an in-memory dataset: slice ``i``
    of each batch to worker ``i % W``, and a worker's slices to its replicas in order),
    so every replica of every worker sees each example of the batch once (measured: 4
    replicas over 2 workers, a batch of 6 -> worker 0 [0, 1] + [4], worker 1 [2, 3] +
    [5]); sharded by file, each worker reads its own files and cuts its own batches
    alike. Full batches that divide by ``N`` are cut exactly as before (``B / N`` each,
    in order). Datasets whose elements are not dense batched tensors keep upstream's
    choice.

    What it costs: where the batches' sizes and order are known before the first step
    (``fit``'s arrays; a ``batch`` followed only by prefetch, cache or options, its
    input's cardinality known) and the slices are dealt as above (one worker, or DATA
    sharding), a pipeline whose batches all have one size that divides by ``N`` keeps
    upstream's cut, and otherwise the cut is tf.data's own ``rebatch`` kernel given every slice's size for
    one pass (``epoch_slices``), and this worker's slices are kept by a ``shard`` (the
    auto-sharding that would follow is switched off for this dataset: it rewrites
    that kernel into its legacy ``ceil`` cut), the kernel upstream cuts with itself
    where it knows the batch size. Elsewhere it is ``split_balanced`` (a gather,
    an unbatch and a slice per replica, in the input pipeline: dearer than the kernel).

    A training batch that still leaves a replica empty (1 example on 2 replicas) would
    make BatchNormalization's moving statistics NaN or abort the process in oneDNN, so
    ``fit`` refuses it: before the first step when the batch sizes are known (arrays;
    a ``tf.data`` pipeline whose ``batch`` input has a known cardinality), otherwise
    with an error from the input pipeline when that batch comes. ``evaluate`` and
    ``predict`` take empty replicas as upstream does (no gradient, no statistics).
    """

    def make(original):
        def _make_rebatch_fn(self, dataset, num_workers, num_replicas_in_sync):
            upstream_fn = original(self, dataset, num_workers, num_replicas_in_sync)
            # fit's first cut is its training data: the fit knows its arrays' batches.
            fits = [h for h in (_FIT_CUT.get(), _TRAINING_INPUT.get()) if h and not h.cut]
            batching = fits[0].ordered(dataset) if fits else ordered_batching(dataset)
            slices = known = None
            if batching is not None and splittable(dataset) and dealing_known(dataset, num_workers):
                slices = epoch_slices(batching, num_replicas_in_sync)
            if slices is not None:
                known = KnownCut(
                    frozenset(batch_sizes_of(batching)), num_replicas_in_sync, num_workers
                )
            cutting = _FIT_CUT.get()
            if cutting is not None and not cutting.cut:
                cutting.cut = True
                cutting.known = known
            if not splittable(dataset):
                return upstream_fn
            per_worker = num_replicas_in_sync // num_workers
            guard = None
            training = _TRAINING_INPUT.get()
            if training is not None and not training.cut:
                training.cut = True
                sizes, examples = training.batches(dataset)
                guard = _empty_replica_guard(sizes, num_replicas_in_sync, num_workers, examples)
            if known is not None and known.even and len(known.sizes) == 1 and guard is None:
                # One batch size, dividing by N: upstream cuts B / N each, in order. (With a
                # partial batch, even one that divides, its fixed shares may give 56 + 0.)
                return upstream_fn

            def rebatch_fn(dataset, worker_index):
                if guard is not None:
                    dataset = map_elements(dataset, guard)
                if slices is not None:
                    return rebatch_in_order(dataset, slices, num_workers, worker_index, per_worker)
                return split_balanced(dataset, num_replicas_in_sync).prefetch(per_worker)

            return rebatch_fn

        return _make_rebatch_fn

    patch(
        upstream.tf_distributed_dataset_class(),
        "_make_rebatch_fn",
        TF_DISTRIBUTE_PARTIAL_BATCH_EVENLY,
        make,
    )


# Layers that train on an empty batch as on none: each example's output depends on that
# example alone (no batch statistic, no oneDNN pooling or convolution gradient).
_EMPTY_BATCH_SAFE = (
    "InputLayer", "Dense", "EinsumDense", "Embedding", "Flatten", "Reshape", "Permute",
    "RepeatVector", "Dropout", "SpatialDropout1D", "GaussianNoise", "Activation", "ReLU",
    "LeakyReLU", "ELU", "PReLU", "Softmax", "LayerNormalization", "Rescaling", "Identity",
    "Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum", "Concatenate", "Dot",
    "Sequential", "Functional",
)  # fmt: skip


def takes_empty_replicas(model) -> bool:
    """Whether every layer of ``model`` is one whose training takes an empty batch (a
    replica handed no example): Dense, Embedding, Dropout, reshapes, merges,
    LayerNormalization, ... A model with any other layer (BatchNormalization: NaN
    statistics; Conv2D, pooling: oneDNN aborts; a custom layer: unknown) does not.

    Example:
        >>> import keras
        >>> takes_empty_replicas(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
        True
    """
    layers = [model]
    while layers:
        layer = layers.pop()
        if (
            type(layer).__name__ not in _EMPTY_BATCH_SAFE
            or type(layer).__module__.split(".")[0] != "keras"
        ):
            return False
        layers.extend(getattr(layer, "layers", ()))
    return True


def keras_tf_fit_refuses_empty_replicas() -> None:
    """Tells the even-split fix which dataset ``fit`` trains on (and, for arrays, its
    batch sizes), so that a training batch leaving a replica empty is refused (see
    ``tf_distribute_partial_batch_evenly``) when the model cannot train on an empty batch
    (``takes_empty_replicas``: a model of Dense, Embedding, Dropout, ... layers can, and
    trains as before). ``fit`` itself runs unchanged; without this fix the even split
    guards nothing and an empty replica reaches the kernels as upstream lets it.
    """

    def make_fit(original):
        signature = inspect.signature(original)

        def fit(self, *args, **kwargs):
            if takes_empty_replicas(self):
                return original(self, *args, **kwargs)
            training = training_input_of(signature, self, args, kwargs)
            token = _TRAINING_INPUT.set(training)
            try:
                return original(self, *args, **kwargs)
            finally:
                _TRAINING_INPUT.reset(token)

        return fit

    patch(
        upstream.keras_tf_trainer_module().TensorFlowTrainer,
        "fit",
        KERAS_TF_FIT_REFUSES_EMPTY_REPLICAS,
        make_fit,
    )


FIXES = [
    Fix(
        TF_DISTRIBUTE_PARTIAL_BATCH_EVENLY,
        "tf.distribute splits a partial last batch by fixed per-replica sizes (56 of 128 "
        "-> 56 + 0 on 2 replicas) and, over workers, full batches too (6 -> 2 + 2 + 2 + 0 on "
        "4 replicas of 2 workers): an empty replica aborts oneDNN's MaxPool gradient",
        on_tensorflow_backend(),
        tf_distribute_partial_batch_evenly,
        package="tensorflow",
        targets=targets(
            "tensorflow.python.distribute.input_lib:DistributedDataset._make_rebatch_fn",
            "tensorflow.python.distribute.input_lib:DistributedDataset."
            "_create_cloned_datasets_from_dataset",
        ),
        acts_where=(
            "every tf.distribute dataset of dense batched tensors on >1 replica (batches "
            "that divide evenly are cut as upstream); other elements, one replica: "
            "upstream's"
        ),
        no_harm=(
            "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes",
            "conv, batches of 6",
            "conv, 65 at 6",
            "conv + BN, 65 at 6",
            "tests/compat/test_no_harm.py::test_each_example_reaches_one_replica_in_slices_that_differ_by_at_most_one",
            "tests/compat/test_upstream_keras.py::test_keras_tests_fail_with_the_fixes_only_where_they_fail_without[tensorflow]",
        ),
    ),
    Fix(
        KERAS_TF_FIT_REFUSES_EMPTY_REPLICAS,
        "Keras on several TensorFlow replicas trains on a batch with fewer examples than "
        "replicas (1 on 2): an empty replica makes BatchNormalization's moving statistics "
        "NaN, silently, and aborts oneDNN's pooling gradients",
        on_keras_backend("tensorflow"),
        keras_tf_fit_refuses_empty_replicas,
        targets=targets(
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.fit",
            "keras.src.trainers.data_adapters.array_slicing:train_validation_split",
        ),
        acts_where=(
            "fit on >1 replica of a model not all Dense/Embedding/Dropout-like: a batch "
            "leaving a replica empty is refused; evaluate, predict, other models and "
            "batches: upstream's"
        ),
        no_harm=(
            "tests/compat/test_partial_batches.py::test_a_batch_that_leaves_a_replica_empty_is_refused_in_training_only",
            "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes",
            "conv, 63 at 6",
        ),
    ),
]
