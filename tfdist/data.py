"""Input pipelines done right for distributed training: global batch, cache, shuffle, shard.

``pipeline()`` turns a finite ``tf.data.Dataset`` (or in-memory arrays) into what a
strategy wants: mapped, cached, reshuffled every epoch, batched with the GLOBAL batch,
prefetched, with the auto-shard policy set so each worker sees its share once. A seeded
pipeline draws the order of epoch k from (seed, k) alone and has a *position*
(epoch, batches to skip) that ``set_position()`` moves, so a restarted job resumes on
exactly the batch it stopped at. ``mnist()`` loads MNIST through tensorflow_datasets
and fails fast, naming ``TFDS_DATA_DIR``, when the data is neither on disk nor
downloadable.

Example:
    >>> import tfdist
    >>> train = tfdist.data.pipeline(tfdist.data.mnist("train"), 64,     # doctest: +SKIP
    ...                              map_fn=tfdist.data.scale, seed=1)
    >>> model.fit(train, epochs=3)                                        # doctest: +SKIP
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from tfdist import strategy as _strategy

__all__ = [
    "MAP_ON",
    "Position",
    "pipeline",
    "set_position",
    "position",
    "scale",
    "mnist",
]

logger = logging.getLogger(__name__)

MAP_ON = ("auto", "example", "batch")
TFDS_DATA_DIR_ENV = "TFDS_DATA_DIR"
_MNIST_TIMEOUT_S = 30.0
# Unseeded shuffles under multi-worker agree on one seed through a collective: every
# worker must reach it, so bound the wait (a worker may still be loading its data).
_SEED_AGREEMENT_TIMEOUT_S = 300.0
_HOST_TIMEOUT_S = 300.0
_SEED_RANGE = 2**31 - 1
# "All of them", as a batch size: reads a whole dataset into one batch.
_ALL = 2**62
_FILE_READER_OPS = frozenset(
    {
        "TFRecordDataset",
        "TFRecordDatasetV2",
        "TextLineDataset",
        "FixedLengthRecordDataset",
        "FixedLengthRecordDatasetV2",
    }
)


@dataclass(frozen=True)
class Position:
    """Where a seeded pipeline's next iteration starts.

    Attributes:
        epoch: the epoch whose order the next iteration draws from ``(seed, epoch)``.
        skip_batches: GLOBAL batches that iteration skips before yielding.
    """

    epoch: int = 0
    skip_batches: int = 0


# --------------------------------------------------------------------------- host state


def _on_host(fn: Callable, what: str):
    """Runs ``fn`` on a fresh thread, under ``tf.init_scope()`` on this host's CPU.

    Variables created this way are plain host variables: a strategy scope would turn
    ``tf.Variable`` into a distributed (mirrored, maybe GPU-resident) variable, which
    tf.data functions cannot read. Strategy scopes are thread-local, so a fresh thread
    escapes any scope the caller has open.
    """
    box: list = []

    def target():
        try:
            with tf.init_scope(), tf.device("/CPU:0"):
                box.append(fn())
        except BaseException as err:  # re-raised on the caller's thread
            box.append(err)

    thread = threading.Thread(target=target, name="tfdist-data-host", daemon=True)
    thread.start()
    thread.join(timeout=_HOST_TIMEOUT_S)
    if not box:
        raise RuntimeError(
            f"tfdist.data: {what} did not finish within {_HOST_TIMEOUT_S:.0f} s; TensorFlow "
            "may be stuck initialising its devices, or the host is out of memory."
        )
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


class _PositionState:
    """The position of one pipeline, in host variables its dataset graph reads."""

    def __init__(self, start: Position):
        self.epoch, self.skip_batches = _on_host(
            lambda: (
                tf.Variable(start.epoch, dtype=tf.int64, trainable=False, name="epoch"),
                tf.Variable(start.skip_batches, dtype=tf.int64, trainable=False, name="skip"),
            ),
            "creating the pipeline position",
        )

    def set(self, where: Position) -> None:
        self.epoch.assign(where.epoch)
        self.skip_batches.assign(where.skip_batches)

    def get(self) -> Position:
        return Position(int(self.epoch.numpy()), int(self.skip_batches.numpy()))

    def start_iteration(self) -> tuple[tf.Tensor, tf.Tensor]:
        """Inside a dataset function: this iteration's (epoch, skip_batches), after
        which the position moves on to (epoch + 1, 0)."""
        epoch = self.epoch.read_value()
        skip = self.skip_batches.read_value()
        with tf.control_dependencies([epoch, skip]):
            advanced = tf.group(self.epoch.assign_add(1), self.skip_batches.assign(0))
        with tf.control_dependencies([advanced]):
            return tf.identity(epoch), tf.identity(skip)


@dataclass
class _PipelineState:
    """What a pipeline's dataset graph reads by handle; the dataset keeps it alive."""

    position: _PositionState | None
    seeded: bool
    data: object = None  # host variables holding the cached examples, if in memory


class _Epochs(tf.data.Dataset):
    """The pipeline as returned: a dataset whose ``cardinality()`` is a full epoch's batches.

    A positioned pipeline starts each iteration inside a per-epoch function, so
    tf.data cannot know its length. Keras 3 then takes the length of the first epoch it
    runs for every later epoch; after a resume that skips batches, the first epoch is
    short and every later one would be cut short too. Reporting a full epoch instead
    makes Keras run full epochs and end the short one where its data ends.
    """

    def __init__(self, dataset: tf.data.Dataset, batches: int):
        self._dataset = dataset
        self._batches = batches
        super().__init__(dataset._variant_tensor)  # the same graph; only the length differs

    def _inputs(self):
        return [self._dataset]

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def cardinality(self):
        return tf.constant(self._batches, tf.int64)


_registry_lock = threading.Lock()
_registry: weakref.WeakSet[_PositionState] = weakref.WeakSet()
_start = Position()


def _non_negative_int(value, name: str, where: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{where}: {name} must be a non-negative int. Received: {name}={value!r}. {hint}"
        )
    if value < 0:
        raise ValueError(
            f"{where}: {name} must be a non-negative int. Received: {name}={value!r}. {hint}"
        )
    return int(value)


def set_position(epoch: int, skip_batches: int = 0) -> None:
    """Sets where every seeded pipeline of this process starts its next iteration.

    The next iteration of each live seeded pipeline (the next ``iter()``, the next Keras
    epoch) draws its order from ``(seed, epoch)`` and skips ``skip_batches`` GLOBAL
    batches; once it starts, the position moves to ``(epoch + 1, 0)``. Pipelines built
    later start from this position too. Unseeded pipelines (validation, say) ignore it.
    Checkpointing calls it in ``on_epoch_begin`` to resume exactly.

    Args:
        epoch: epoch number (>= 0) whose order the next iteration uses.
        skip_batches: global batches (>= 0) of that epoch already trained on.

    Example:
        >>> set_position(3, skip_batches=120)  # doctest: +SKIP
        >>> first = next(iter(train))           # batch 120 of epoch 3's order  # doctest: +SKIP
    """
    global _start
    hint = "Pass the epoch to resume and the number of global batches already done."
    where = Position(
        _non_negative_int(epoch, "epoch", "set_position", hint),
        _non_negative_int(skip_batches, "skip_batches", "set_position", hint),
    )
    with _registry_lock:
        _start = where
        states = list(_registry)
    for state in states:
        state.set(where)
    logger.debug("tfdist.data: position of %d seeded pipeline(s) set to %s", len(states), where)


def position(dataset: tf.data.Dataset) -> Position:
    """The position of a seeded pipeline: where its next iteration will start.

    Args:
        dataset: a dataset returned by ``pipeline(..., seed=...)``.

    Raises:
        ValueError: ``dataset`` is not a seeded pipeline.

    Example:
        >>> train = pipeline(ds, 32, seed=0)  # doctest: +SKIP
        >>> for _ in train: pass              # doctest: +SKIP
        >>> position(train)                   # doctest: +SKIP
        Position(epoch=1, skip_batches=0)
    """
    state = getattr(dataset, "_tfdist_state", None)
    if state is None or not state.seeded:
        raise ValueError(
            "position: dataset must be a pipeline built with a seed, as returned by "
            f"tfdist.data.pipeline(..., seed=...). Received: dataset={_short(dataset)}. "
            "Transformed copies (dataset.map(...)) do not carry the position; ask the "
            "pipeline itself."
        )
    return state.position.get()


# --------------------------------------------------------------------------- checks


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _as_dataset(dataset) -> tf.data.Dataset:
    """The source as a Dataset (in-memory arrays are sliced into examples)."""
    if isinstance(dataset, tf.data.Dataset):
        return dataset
    if isinstance(dataset, tf.distribute.DistributedDataset):
        raise TypeError(
            "pipeline: dataset must be a tf.data.Dataset, not one already distributed. "
            f"Received: dataset={_short(dataset)}. Pass the dataset itself; Keras (or "
            "strategy.experimental_distribute_dataset) distributes the pipeline."
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
            "pipeline: dataset must be a tf.data.Dataset, a numpy array, or a tuple/list/dict "
            "of numpy arrays (features, labels) with a leading example axis. "
            f"Received: dataset={_short(dataset)}. Build a Dataset with "
            "tf.data.Dataset.from_tensor_slices(...) or load one with tfdist.data.mnist()."
        )
    lengths = {int(x.shape[0]) for x in leaves}
    if len(lengths) != 1:
        raise ValueError(
            "pipeline: the arrays in dataset must have the same number of examples (first "
            f"axis). Received lengths {sorted(lengths)}. Pass features and labels that match."
        )
    return tf.data.Dataset.from_tensor_slices(structure)


def _error_type(value) -> type[Exception]:
    """TypeError for a value that is not an int at all, ValueError for a bad int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return TypeError
    return ValueError


def _check_options(per_replica_batch, map_fn, map_on, cache, shuffle, seed, drop_remainder):
    if isinstance(per_replica_batch, bool) or not isinstance(per_replica_batch, numbers.Integral):
        raise TypeError(
            "pipeline: per_replica_batch must be a positive int. "
            f"Received: per_replica_batch={per_replica_batch!r}. Pass the batch one replica "
            "processes per step, e.g. 64; the pipeline batches with 64 x replicas."
        )
    if per_replica_batch < 1:
        raise ValueError(
            "pipeline: per_replica_batch must be a positive int. "
            f"Received: per_replica_batch={per_replica_batch!r}. Pass the batch one replica "
            "processes per step, e.g. 64; the pipeline batches with 64 x replicas."
        )
    if map_fn is not None and not callable(map_fn):
        raise TypeError(
            f"pipeline: map_fn must be callable or None. Received: map_fn={_short(map_fn)}. "
            "Pass a function of one example, e.g. lambda image, label: (image / 255, label)."
        )
    if map_on not in MAP_ON:
        raise ValueError(
            f"pipeline: map_on must be one of {MAP_ON}. Received: map_on={map_on!r}. 'auto' "
            "(the default) is right unless map_fn is random augmentation ('batch', if it "
            "handles batches) or must see examples one by one ('example')."
        )
    if not (isinstance(cache, bool) or (isinstance(cache, (str, os.PathLike)) and str(cache))):
        raise TypeError(
            "pipeline: cache must be True (in memory), False, or a file path prefix. "
            f"Received: cache={cache!r}."
        )
    if shuffle is not None and (
        isinstance(shuffle, bool) or not isinstance(shuffle, numbers.Integral) or shuffle < 1
    ):
        raise _error_type(shuffle)(
            "pipeline: shuffle must be a positive int (the shuffle buffer, in examples) or "
            f"None to keep the order. Received: shuffle={shuffle!r}. The default is 10_000."
        )
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**63
    ):
        raise _error_type(seed)(
            "pipeline: seed must be None or an int in [0, 2**63). "
            f"Received: seed={seed!r}. Any fixed int makes every epoch's order reproducible."
        )
    if drop_remainder is not None and not isinstance(drop_remainder, bool):
        raise TypeError(
            "pipeline: drop_remainder must be True, False or None (None: drop the partial "
            f"last batch when shuffling, keep it otherwise). Received: "
            f"drop_remainder={drop_remainder!r}."
        )


# --------------------------------------------------------------------------- distribution


def _num_workers(strategy: tf.distribute.Strategy) -> int:
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    local = max(len(strategy.extended.worker_devices), 1)
    return max(strategy.num_replicas_in_sync // local, 1)


def _worker_index(strategy: tf.distribute.Strategy) -> int:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return 0
    spec = resolver.cluster_spec().as_dict()
    if resolver.task_type == "worker" and "chief" in spec:
        return len(spec["chief"]) + int(resolver.task_id)
    return int(resolver.task_id or 0)


def _source_file_count(dataset: tf.data.Dataset) -> int | None:
    """How many files the dataset reads, when its graph shows a reader over a file list.

    TensorFlow's FILE auto-shard needs a file reader fed by a list of file names, and
    at least one file per worker (with fewer it fails); this mirrors that check on the
    serialised graph. Any doubt (no reader, names computed at run time, a graph too
    large to serialise) answers None, and the caller shards by DATA, which is always
    correct.
    """
    try:
        serialized = dataset._as_serialized_graph(  # no public accessor for the graph
            external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN
        )
        graph = tf.compat.v1.GraphDef.FromString(serialized.numpy())
    except Exception as err:  # noqa: BLE001 - any failure means "unknown", not an error
        logger.debug("tfdist.data: could not inspect the dataset graph: %s", err)
        return None
    ops = {n.op for n in graph.node}
    for function in graph.library.function:
        ops.update(n.op for n in function.node_def)
    if not ops & _FILE_READER_OPS:
        return None
    consts = {n.name: n for n in graph.node if n.op == "Const"}
    counts = []
    for node in graph.node:
        if node.op != "TensorSliceDataset" or not node.input:
            continue
        const = consts.get(node.input[0].split(":")[0])
        if const is None:
            continue
        tensor = const.attr["value"].tensor
        if tensor.dtype == tf.string.as_datatype_enum and len(tensor.tensor_shape.dim) == 1:
            counts.append(int(tensor.tensor_shape.dim[0].size))
    return counts[0] if len(counts) == 1 else None


def _shard_policy(dataset, num_workers: int, *, in_memory: bool, positioned: bool):
    """The auto-shard policy and why: set explicitly so TensorFlow never guesses."""
    Policy = tf.data.experimental.AutoShardPolicy
    explicit = dataset.options().experimental_distribute.auto_shard_policy
    if explicit != Policy.AUTO:
        return explicit, "set on the dataset"
    if num_workers == 1:
        return Policy.DATA, "one worker"
    if in_memory:
        return Policy.DATA, "data in memory"
    if positioned:
        # A positioned stream reads its source inside a per-epoch function, where
        # TensorFlow's FILE rewrite cannot find the reader.
        return Policy.DATA, "seeded stream"
    files = _source_file_count(dataset)
    if files is not None and files >= num_workers:
        return Policy.FILE, f"{files} files for {num_workers} workers"
    return Policy.DATA, f"{files or 'no'} file(s) for {num_workers} workers"


def _random_seed(strategy: tf.distribute.Strategy, num_workers: int) -> int:
    """A shuffle seed for an unseeded pipeline, the same on every worker.

    Drawn from TensorFlow's global generator, so ``keras.utils.set_random_seed`` makes
    it reproducible. Under multi-worker the chief's draw is shared through an
    all-reduce: with DATA sharding every worker must shuffle alike, or examples are
    seen twice or never.
    """
    try:
        local = _on_host(
            lambda: int(tf.random.uniform([], 0, _SEED_RANGE, dtype=tf.int64)), "drawing a seed"
        )
    except RuntimeError as err:  # op determinism is on and no global seed is set
        raise RuntimeError(
            "pipeline: shuffling needs a seed because op determinism is enabled. "
            "Pass seed=... to pipeline(), or call keras.utils.set_random_seed(...) first."
        ) from err
    if num_workers == 1:
        return local
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=_SEED_AGREEMENT_TIMEOUT_S
    )

    def chief_seed():
        ctx = tf.distribute.get_replica_context()
        mine = tf.where(
            tf.equal(ctx.replica_id_in_sync_group, 0),
            tf.constant(local, tf.int64),
            tf.constant(0, tf.int64),
        )
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, mine, options=options)

    try:
        shared = strategy.run(chief_seed)
        return int(strategy.experimental_local_results(shared)[0])
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as err:
        raise RuntimeError(
            "pipeline: the workers did not agree on a shuffle seed within "
            f"{_SEED_AGREEMENT_TIMEOUT_S:.0f} s. Every worker must build the same pipelines in "
            "the same order; or pass seed=... so that no agreement is needed."
        ) from err


# --------------------------------------------------------------------------- building


def _call(map_fn: Callable, element, is_tuple: bool):
    # tf.data's convention: a tuple element is passed as positional arguments.
    return map_fn(*element) if is_tuple else map_fn(element)


def _read_into_memory(source: tf.data.Dataset, map_fn, map_on: str):
    """Reads the whole dataset into host variables, applying ``map_fn`` to each example.

    With ``map_on='auto'`` the per-example function runs vectorised over all examples
    at once (``tf.vectorized_map``: the results of one call per example, many times
    faster); a function it cannot vectorise runs per example, in parallel, instead.

    Returns:
        (variables with the structure of an example, number of examples, how
        ``map_fn`` was applied).
    """
    is_tuple = isinstance(source.element_spec, tuple)
    cardinality = int(source.cardinality())
    size = cardinality if cardinality > 0 else _ALL
    # A map followed by batch(size) fuses into an op that allocates the whole batch up
    # front: with an unknown length (size=_ALL) that aborts the process.
    unfused = tf.data.Options()
    unfused.experimental_optimization.map_and_batch_fusion = False
    how = None
    everything = None
    if map_fn is not None and map_on == "auto":

        def vectorized(*examples):
            return tf.vectorized_map(
                lambda e: _call(map_fn, e, is_tuple),
                examples if is_tuple else examples[0],
                fallback_to_while_loop=False,
            )

        try:
            everything = source.batch(size).with_options(unfused).map(vectorized)
            how = "vectorised"
        except (ValueError, TypeError, NotImplementedError) as err:
            logger.info("tfdist.data: map_fn runs per example (cannot vectorise it: %s)", err)
    if everything is None:
        mapped = source
        if map_fn is not None and map_on != "batch":
            mapped = source.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            how = "per example"
        everything = mapped.batch(size).with_options(unfused)
    whole = next(iter(everything), None)
    if whole is None:
        raise ValueError(
            "pipeline: dataset is empty, so there is nothing to train on. Check the split or "
            "the filter that produced it."
        )
    count = int(tf.nest.flatten(whole)[0].shape[0])
    variables = _on_host(
        lambda: tf.nest.map_structure(lambda t: tf.Variable(t, trainable=False), whole),
        "copying the dataset into memory",
    )
    return variables, count, how


def _in_memory_epochs(
    variables, count: int, state, *, seed, shuffle, skip_per_batch, batch, drop_remainder
) -> tf.data.Dataset:
    """Batches gathered from examples held in memory, in one epoch's order.

    Only example indices flow through tf.data one by one (cheap int64 scalars); the
    examples themselves are gathered a whole batch at a time. With a position, each
    iteration starts where the position says and uses the order of (seed, epoch): a
    full uniform permutation keyed by Philox on (seed, epoch), the same everywhere.
    """

    def gather(idx):
        return tf.nest.map_structure(lambda v: tf.gather(v, idx), variables)

    if state is None:  # no shuffle, no position: the source order
        batches = tf.data.Dataset.range(count).batch(batch, drop_remainder=drop_remainder)
        return batches.map(gather)

    seed_t = tf.constant(seed, tf.int64)

    def one_epoch(_):
        epoch, skip = state.start_iteration()
        order = tf.range(count, dtype=tf.int64)
        if shuffle is not None:
            order = tf.random.experimental.stateless_shuffle(order, seed=tf.stack([seed_t, epoch]))
        order = order[skip * skip_per_batch :]
        if not drop_remainder:
            return tf.data.Dataset.from_tensor_slices(order)
        # Whole batches of indices at once: nothing flows through tf.data per example.
        full = tf.size(order, out_type=tf.int64) // batch
        return tf.data.Dataset.from_tensor_slices(tf.reshape(order[: full * batch], [-1, batch]))

    per_epoch = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).flat_map(one_epoch)
    if not drop_remainder:
        # Batched outside the per-epoch function, where tf.distribute can find the batch
        # size to split a short last batch between replicas and workers. (With full
        # batches only, the static batch dimension tells it.)
        per_epoch = per_epoch.batch(batch)
    # A gather is one memory copy: running it in parallel would only add threads.
    return per_epoch.map(gather)


def _epoch_seed(seed: tf.Tensor, epoch: tf.Tensor) -> tf.Tensor:
    # Philox keyed by (seed, epoch): the same on every platform and in every process.
    return tf.random.stateless_uniform(
        [], tf.stack([seed, epoch]), minval=0, maxval=_SEED_RANGE, dtype=tf.int64
    )


def _streamed_epochs(source: tf.data.Dataset, state, *, seed, shuffle, skip_per_batch):
    """One epoch of ``source`` per iteration, buffer-shuffled by (seed, epoch), from the
    position (read inside the dataset graph when an iteration starts)."""
    seed_t = tf.constant(seed, tf.int64)

    def one_epoch(_):
        epoch, skip = state.start_iteration()
        ds = source
        if shuffle is not None:
            # The order must come from (seed, epoch) alone: a global seed set with
            # tf.random.set_seed would otherwise enter the shuffle's seed pair.
            graph = tf.compat.v1.get_default_graph()
            saved, graph.seed = graph.seed, None
            try:
                ds = ds.shuffle(shuffle, seed=_epoch_seed(seed_t, epoch))
            finally:
                graph.seed = saved
        return ds.skip(skip * skip_per_batch)

    return tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).flat_map(one_epoch)


def _cache_path(cache, num_workers: int, strategy) -> str:
    path = os.fspath(cache)
    if num_workers > 1:
        # Workers on one host (or one shared disk) must not write the same cache files.
        path = f"{path}.worker{_worker_index(strategy)}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def pipeline(
    dataset,
    per_replica_batch: int,
    *,
    map_fn: Callable | None = None,
    map_on: str = "auto",
    cache: bool | str | os.PathLike = True,
    shuffle: int | None = 10_000,
    seed: int | None = None,
    drop_remainder: bool | None = None,
    strategy: tf.distribute.Strategy | None = None,
) -> tf.data.Dataset:
    """A finite, epoch-at-a-time input pipeline batched with the GLOBAL batch size.

    Every iteration is one epoch in a new order (``model.fit(train, epochs=N)`` needs
    no ``repeat()``), batched with ``tfdist.global_batch_size(per_replica_batch)`` and
    prefetched (AUTOTUNE).

    Order of operations. ``cache=True``: the examples are read once, when the pipeline
    is built, with ``map_fn`` applied, into host memory; each epoch then shuffles only
    example indices and gathers whole batches, so the per-epoch cost hardly depends on
    the example size. ``cache=False`` or a path: ``map_fn`` per example -> cache (files)
    -> shuffle (buffer of ``shuffle`` examples) -> batch.

    Partial last batch: ``drop_remainder=None`` (the default) drops it when shuffling
    (training: the batch shape stays static, every replica of every worker gets an
    equal share, and each epoch drops different examples) and keeps it when
    ``shuffle=None`` (evaluation: every example counts; tf.distribute splits a short
    batch between replicas and workers, giving empty per-replica batches where it
    runs out, so no step fails).

    Sharding: the auto-shard policy is always set, so tf.data never guesses: DATA (each
    worker keeps its slice of every global batch) for data in memory and seeded
    pipelines, FILE when a streamed source reads at least one file per worker.
    Unseeded shuffles share one seed between workers, so no example is seen twice.

    Seeded pipelines: the order of epoch k depends on ``(seed, k)`` only, in every
    process. Each iteration starts at the pipeline's position (``set_position``): it
    uses that epoch's order, skips that many global batches, then moves on to the next
    epoch with no skip.

    Args:
        dataset: a finite ``tf.data.Dataset`` of single examples (not batched), or data
            in memory: a numpy array, or a tuple/list/dict of arrays with a leading
            example axis (what Keras ``fit`` takes).
        per_replica_batch: examples per replica per step.
        map_fn: applied to every example (decode, scale, ...), e.g. ``tfdist.data.scale``.
        map_on: ``'auto'`` (default): per example, and when the data is cached in
            memory vectorised over all examples at once with ``tf.vectorized_map``
            (the same results, many times faster; functions it cannot vectorise run per
            example); ``'example'``: one call per example; ``'batch'``: called on each
            global batch, every epoch, after the cache (random augmentation; ``map_fn``
            must accept batches).
        cache: ``True`` keeps the (mapped) examples in memory; a path caches them in
            files with that prefix (one set per worker under multi-worker); ``False``
            re-reads the source every epoch.
        shuffle: ``None`` keeps the source order. Otherwise the epoch is shuffled: a
            full permutation for data in memory, else a buffer of this many examples.
        seed: makes every epoch's order reproducible and enables ``set_position``.
        drop_remainder: ``True``/``False``, or ``None`` for the policy above.
        strategy: defaults to the open strategy scope, else ``tfdist.strategy()``.

    Returns:
        A ``tf.data.Dataset`` of global batches.

    Raises:
        TypeError, ValueError: an argument is invalid; the message says which and why.

    Example:
        >>> train = pipeline(tfdist.data.mnist("train"), 64,          # doctest: +SKIP
        ...                  map_fn=tfdist.data.scale, seed=0)
        >>> images, labels = next(iter(train))                        # doctest: +SKIP
        >>> images.shape                                              # 2 replicas
        TensorShape([128, 28, 28, 1])
    """
    _check_options(per_replica_batch, map_fn, map_on, cache, shuffle, seed, drop_remainder)
    source = _as_dataset(dataset)
    if int(source.cardinality()) == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "pipeline: dataset must be finite, but it repeats forever. Received: "
            f"dataset={_short(dataset)}. Remove .repeat(): the pipeline yields one epoch per "
            "iteration, and model.fit(epochs=...) iterates it once per epoch."
        )
    strategy = _strategy._current(strategy)
    per_replica_batch = int(per_replica_batch)
    batch = _strategy.global_batch_size(per_replica_batch, strategy=strategy)
    if drop_remainder is None:
        drop_remainder = shuffle is not None
    num_workers = _num_workers(strategy)
    seeded = seed is not None
    in_memory = cache is True
    # Shuffled pipelines are positioned (order from (seed, epoch)) unless FILE-sharded:
    # under DATA sharding every worker must follow the same order.
    policy, why = _shard_policy(source, num_workers, in_memory=in_memory, positioned=seeded)
    positioned = seeded or (
        shuffle is not None and policy != tf.data.experimental.AutoShardPolicy.FILE
    )

    state = _PipelineState(position=None, seeded=seeded)
    shuffle_seed = None
    if positioned:
        with _registry_lock:
            state.position = _PositionState(_start if seeded else Position())
            if seeded:
                _registry.add(state.position)
        shuffle_seed = int(seed) if seeded else _random_seed(strategy, num_workers)

    how = None
    if in_memory:
        state.data, count, how = _read_into_memory(source, map_fn, map_on)
        if drop_remainder and count < batch:
            raise ValueError(
                f"pipeline: the dataset has {count} examples, fewer than one global batch of "
                f"{batch} (per_replica_batch={per_replica_batch} x "
                f"{strategy.num_replicas_in_sync} replicas), so dropping the partial batch "
                "leaves nothing. Lower per_replica_batch or pass drop_remainder=False."
            )
        ds = _in_memory_epochs(
            state.data,
            count,
            state.position,
            seed=shuffle_seed,
            shuffle=shuffle,
            skip_per_batch=batch,
            batch=batch,
            drop_remainder=drop_remainder,
        )
    else:
        count = int(source.cardinality())
        count = count if count >= 0 else None
        ds = source
        if map_fn is not None and map_on != "batch":
            ds = ds.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            how = "per example"
        if cache:
            ds = ds.cache(_cache_path(cache, num_workers, strategy))
        if positioned:
            ds = _streamed_epochs(
                ds, state.position, seed=shuffle_seed, shuffle=shuffle, skip_per_batch=batch
            )
        elif shuffle is not None:  # FILE-sharded: each worker shuffles its own files
            ds = ds.shuffle(shuffle, seed=_random_seed(strategy, 1))
        ds = ds.batch(batch, drop_remainder=drop_remainder)
    if map_fn is not None and map_on == "batch":
        ds = ds.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        how = "per batch"
    ds = ds.prefetch(tf.data.AUTOTUNE)

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    ds = ds.with_options(options)
    if positioned:
        if count is not None:
            ds = _Epochs(ds, count // batch if drop_remainder else -(-count // batch))
        elif seeded:
            logger.warning(
                "tfdist.data: the dataset's length is unknown, so Keras will take the length "
                "of the first epoch it runs for all epochs; an epoch resumed with "
                "set_position(epoch, skip_batches > 0) would then shorten the ones after it. "
                "Use cache=True, or declare the length with "
                "dataset.apply(tf.data.experimental.assert_cardinality(n))."
            )
    # The graph reads the position and the cached examples by handle: the dataset
    # keeps them alive (the registry of positions holds weak references only).
    ds._tfdist_state = state
    logger.info(
        "tfdist.data: global batch %d (%d x %d replicas), drop_remainder=%s, shard by %s "
        "(%s), cache=%s, shuffle=%s, seed=%s, map_fn applied %s",
        batch,
        per_replica_batch,
        strategy.num_replicas_in_sync,
        drop_remainder,
        policy.name,
        why,
        cache,
        shuffle,
        seed,
        how or "never (none given)",
    )
    return ds


def scale(image, label):
    """Scales images to float32 in [0, 1]; labels pass through. Works on batches too.

    Example:
        >>> train = pipeline(mnist(), 64, map_fn=scale)  # doctest: +SKIP
    """
    return tf.cast(image, tf.float32) / 255.0, label


# --------------------------------------------------------------------------- MNIST


def _reachable(url: str, timeout: float) -> str | None:
    """None when ``url`` answers within ``timeout`` s (through any configured proxy),
    else why not. Runs on a thread so a slow DNS lookup cannot outlast the timeout."""
    result: list[str | None] = []

    def probe():
        try:
            request = urllib.request.Request(url, method="HEAD")
            with urllib.request.urlopen(request, timeout=timeout):
                pass
            result.append(None)
        except urllib.error.HTTPError:  # the server answered: the network works
            result.append(None)
        except Exception as err:  # noqa: BLE001 - any failure means "not reachable"
            result.append(f"{type(err).__name__}: {err}")

    thread = threading.Thread(target=probe, name="tfdist-mnist-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else f"no answer within {timeout:.0f} s"


def _settle_strategy_before_tensorflow_starts() -> None:
    """Creates tfdist's strategy if TensorFlow has not started yet.

    Loading data runs TensorFlow ops, which fixes TensorFlow's devices and makes it too
    late to split the CPU (``TFDIST_CPU_DEVICES``) or to set up multi-worker collectives
    ("Collective ops must be configured at program startup"). A script that loads MNIST
    before opening ``tfdist.scope()`` would then fail later; creating the strategy first
    makes the order not matter. Once TensorFlow has started, nothing is created here.
    """
    from tensorflow.python.eager import context

    started = getattr(context.context(), "_context_handle", True) is not None
    if not started and _strategy.current_plan() is None:
        _strategy.strategy()


def mnist(
    split: str = "train",
    *,
    data_dir: str | os.PathLike | None = None,
    download: bool = True,
    timeout: float = _MNIST_TIMEOUT_S,
) -> tf.data.Dataset:
    """MNIST through tensorflow_datasets as ``(image uint8 (28, 28, 1), label int64)``.

    Uses the data in ``data_dir`` (else ``$TFDS_DATA_DIR``, else tfds's default
    ``~/tensorflow_datasets``). When it is not there, downloads it if the download
    server answers within ``timeout`` seconds; otherwise fails at once instead of
    letting tfds retry for minutes.

    Args:
        split: a tfds split: ``"train"``, ``"test"``, or tfds slicing like ``"train[:10%]"``.
        data_dir: the tfds data directory; overrides ``TFDS_DATA_DIR``.
        download: whether to download when the data is missing.
        timeout: seconds to wait for the download server before giving up.

    Raises:
        FileNotFoundError: the data is not on disk and cannot be downloaded.
        ValueError: ``split`` is not a split of MNIST.

    Example:
        >>> train = mnist("train")  # doctest: +SKIP
        >>> train.cardinality()     # doctest: +SKIP
        60000
    """
    if not isinstance(split, str) or not split.strip():
        raise TypeError(
            f"mnist: split must be a tfds split name such as 'train' or 'test'. "
            f"Received: split={split!r}."
        )
    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise TypeError(f"mnist: data_dir must be a path or None. Received: data_dir={data_dir!r}.")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout <= 0:
        raise ValueError(
            f"mnist: timeout must be a positive number of seconds. Received: timeout={timeout!r}."
        )
    # Resolved here, not by tfds: tfds reads TFDS_DATA_DIR once, when it is imported.
    if data_dir is None:
        data_dir = os.environ.get(TFDS_DATA_DIR_ENV) or os.path.join(
            os.path.expanduser("~"), "tensorflow_datasets"
        )
    data_dir = os.fspath(data_dir)

    _settle_strategy_before_tensorflow_starts()
    import tensorflow_datasets as tfds  # imported late: it costs seconds

    builder = tfds.builder("mnist", data_dir=data_dir)
    if not builder.is_prepared():
        how = (
            f"Put the prepared tfds MNIST (mnist/{builder.version}/...) under a directory and "
            f"set {TFDS_DATA_DIR_ENV} to it (or pass data_dir=), or run once where the internet "
            f"is reachable to download it into {data_dir}."
        )
        if not download:
            raise FileNotFoundError(
                f"mnist: MNIST is not in {data_dir} ({TFDS_DATA_DIR_ENV}="
                f"{os.environ.get(TFDS_DATA_DIR_ENV)!r}) and download=False. {how}"
            )
        url = getattr(builder, "URL", None) or "https://storage.googleapis.com/"
        problem = _reachable(url, float(timeout))
        if problem is not None:
            raise FileNotFoundError(
                f"mnist: MNIST is not in {data_dir} ({TFDS_DATA_DIR_ENV}="
                f"{os.environ.get(TFDS_DATA_DIR_ENV)!r}) and cannot be downloaded: {url} did "
                f"not answer ({problem}). {how}"
            )
        logger.info("tfdist.data: downloading MNIST into %s", data_dir)
        builder.download_and_prepare()
    known = set(builder.info.splits.keys())
    unknown = [part for part in split.split("+") if part.split("[")[0].strip() not in known]
    if unknown:
        raise ValueError(
            f"mnist: split must be one of {sorted(known)} (tfds slicing like 'train[:10%]' is "
            f"fine). Received: split={split!r}."
        )
    return builder.as_dataset(split=split, as_supervised=True, shuffle_files=False)
