"""``pipeline()``: a finite source to an epoch-at-a-time, globally batched, sharded dataset.

Three named steps: ``_plan`` checks the arguments and decides everything (batch,
remainder, shard policy, whether the pipeline is positioned); ``_build`` makes the
batches (from memory or streamed); ``_finish`` prefetches, sets the shard policy and
the epoch length, and attaches the state the graph reads.

Example:
    >>> train = pipeline(tfdist.data.mnist("train"), 64, seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import tensorflow as tf

from tfdist import backends, distribute
from tfdist.core import process
from tfdist.data import checks, seeds
from tfdist.data.epochs import FullEpochs, in_memory_epochs, streamed_epochs
from tfdist.data.memory import read_into_memory
from tfdist.data.positions import PipelineState, new_state
from tfdist.data.sharding import shard_policy

__all__ = ["pipeline"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Plan:
    """Everything decided before any data is read."""

    source: tf.data.Dataset
    strategy: tf.distribute.Strategy
    per_replica_batch: int
    replicas: int
    batch: int  # the global batch: per_replica_batch x replicas
    per_replica_given: bool  # sized by per_replica_batch (else by global_batch)
    map_fn: Callable | None
    map_on: str
    cache: bool | str | os.PathLike
    shuffle: int | None
    seed: int | None
    drop_remainder: bool
    num_workers: int
    policy: tf.data.experimental.AutoShardPolicy
    why: str  # why this shard policy
    positioned: bool  # order from (seed, epoch) and a position, read per iteration

    @property
    def seeded(self) -> bool:
        return self.seed is not None

    @property
    def in_memory(self) -> bool:
        return self.cache is True


def _batch_sizes(per_replica_batch, global_batch, strategy) -> tuple[int, int, int]:
    """``(per_replica_batch, replicas, global batch)`` from exactly one of the two sizes."""
    if (per_replica_batch is None) == (global_batch is None):
        raise ValueError(
            "pipeline: pass exactly one of per_replica_batch= and global_batch=. Received: "
            f"per_replica_batch={per_replica_batch!r}, global_batch={global_batch!r}. Use "
            "global_batch= for the batch of one training step across the whole job "
            "(model parallelism, or a pipeline built before its scope), per_replica_batch= "
            "for the batch of one replica."
        )
    replicas = distribute.num_replicas(strategy=strategy)
    if per_replica_batch is not None:
        per_replica_batch = int(per_replica_batch)
        return per_replica_batch, replicas, per_replica_batch * replicas
    global_batch = checks.global_batch(global_batch, replicas)
    return global_batch // replicas, replicas, global_batch


def _plan(
    dataset,
    per_replica_batch,
    global_batch,
    map_fn,
    map_on,
    cache,
    shuffle,
    seed,
    drop_remainder,
    strategy,
):
    """Checks the arguments and decides everything before any data is read."""
    checks.check_options(per_replica_batch, map_fn, map_on, cache, shuffle, seed, drop_remainder)
    source = checks.as_dataset(dataset)
    checks.check_finite(source, dataset)
    checks.check_not_batched(source, dataset)
    strategy = distribute.current(strategy)
    per_replica_batch, replicas, batch = _batch_sizes(per_replica_batch, global_batch, strategy)
    num_workers = distribute.num_workers(strategy=strategy)
    policy, why = shard_policy(
        source, num_workers, in_memory=cache is True, positioned=seed is not None
    )
    return _Plan(
        source=source,
        strategy=strategy,
        per_replica_batch=per_replica_batch,
        replicas=replicas,
        batch=batch,
        per_replica_given=global_batch is None,
        map_fn=map_fn,
        map_on=map_on,
        cache=cache,
        shuffle=shuffle,
        seed=seed,
        drop_remainder=shuffle is not None if drop_remainder is None else drop_remainder,
        num_workers=num_workers,
        policy=policy,
        why=why,
        # Shuffled pipelines are positioned unless FILE-sharded: under DATA sharding
        # every worker must follow the same order.
        positioned=seed is not None
        or (shuffle is not None and policy != tf.data.experimental.AutoShardPolicy.FILE),
    )


def _shuffle_seed(plan: _Plan) -> int | None:
    """The seed of a positioned pipeline's orders: its own, or one the workers agree on."""
    if not plan.positioned:
        return None
    if plan.seed is not None:  # plan.seeded
        return int(plan.seed)
    return seeds.agreed_seed(plan.strategy, plan.num_workers)


def _drop_remainder(plan: _Plan, count: int | None) -> bool:
    """``drop_remainder`` for ``batch``: also True when no batch is partial, so the batch
    size is static (Keras on JAX needs it to split batches between processes)."""
    if plan.drop_remainder or count is None:
        return plan.drop_remainder
    partial = count % plan.batch
    if partial and not backends.get().splits_uneven_batches():
        _check_even_partial_batch(plan, count, partial)
    return partial == 0


def _check_even_partial_batch(plan: _Plan, count: int, partial: int) -> None:
    """A backend that splits every batch evenly (Keras on JAX, the one today): a partial
    batch must divide between the replicas; between processes only where the fix
    ``keras_jax_partial_batch_share`` feeds each process its equal part."""
    shared = "keras_jax_partial_batch_share" in process.state().applied_fixes
    if partial % plan.replicas == 0 and (plan.num_workers == 1 or shared):
        return  # each replica gets partial / replicas examples
    where = (
        f"between {plan.num_workers} workers"
        if plan.num_workers > 1
        else f"between {plan.replicas} replicas"
    )
    raise ValueError(
        f"pipeline: the dataset has {count} examples, so its last batch has {partial} "
        f"(global batch {plan.batch}), and Keras on JAX cannot split that batch {where}: "
        "every batch must divide evenly. Pass drop_remainder=True (the last "
        f"{partial} examples are left out), or a per_replica_batch for which it does."
    )


def _build_in_memory(plan: _Plan, state: PipelineState, shuffle_seed):
    """Batches gathered from the source read into memory: (dataset, count, how)."""
    state.data, count, how = read_into_memory(plan.source, plan.map_fn, plan.map_on)
    if plan.drop_remainder and count < plan.batch:
        raise ValueError(
            f"pipeline: the dataset has {count} examples, fewer than one global batch of "
            f"{plan.batch} (per_replica_batch={plan.per_replica_batch} x "
            f"{plan.replicas} replicas), so dropping the partial batch "
            "leaves nothing. Lower per_replica_batch or pass drop_remainder=False."
        )
    ds = in_memory_epochs(
        state.data,
        count,
        state.position,
        seed=shuffle_seed,
        shuffle=plan.shuffle,
        skip_per_batch=plan.batch,
        batch=plan.batch,
        drop_remainder=_drop_remainder(plan, count),
    )
    return ds, count, how


def _cache_path(plan: _Plan) -> str:
    assert not isinstance(plan.cache, bool)  # a file path here: cache=True is in memory
    path = os.fspath(plan.cache)
    if plan.num_workers > 1:
        # Workers on one host (or one shared disk) must not write the same cache files.
        path = f"{path}.worker{distribute.worker_index(strategy=plan.strategy)}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def _build_streamed(plan: _Plan, state: PipelineState, shuffle_seed):
    """Batches read from the source every epoch (cached in files if asked): (ds, count, how)."""
    cardinality = int(plan.source.cardinality())
    count = cardinality if cardinality >= 0 else None
    ds, how = plan.source, None
    if plan.map_fn is not None and plan.map_on != "batch":
        ds = ds.map(plan.map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        how = "per example"
    if plan.cache:
        ds = ds.cache(_cache_path(plan))
    if plan.positioned:
        assert state.position is not None  # new_state gives a positioned plan its variables
        ds = streamed_epochs(
            ds, state.position, seed=shuffle_seed, shuffle=plan.shuffle, skip_per_batch=plan.batch
        )
    elif plan.shuffle is not None:  # FILE-sharded: each worker shuffles its own files
        ds = ds.shuffle(plan.shuffle, seed=seeds.agreed_seed(plan.strategy, 1))
    return ds.batch(plan.batch, drop_remainder=_drop_remainder(plan, count)), count, how


def _build(plan: _Plan, state: PipelineState):
    """The global batches, ``map_fn`` applied: (dataset, examples or None, how mapped)."""
    shuffle_seed = _shuffle_seed(plan)
    build = _build_in_memory if plan.in_memory else _build_streamed
    ds, count, how = build(plan, state, shuffle_seed)
    if plan.map_fn is not None and plan.map_on == "batch":
        ds = ds.map(plan.map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        how = "per batch"
    return ds, count, how


def _full_epochs(plan: _Plan, ds: tf.data.Dataset, count: int | None) -> tf.data.Dataset:
    """A positioned pipeline with its full epoch's length (when known) as cardinality."""
    if count is not None:
        batches = count // plan.batch if plan.drop_remainder else -(-count // plan.batch)
        return FullEpochs(ds, batches)
    if plan.seeded:
        logger.warning(
            "tfdist.data: the dataset's length is unknown, so Keras will take the length "
            "of the first epoch it runs for all epochs; an epoch resumed with "
            "set_position(epoch, batch > 0) would then shorten the ones after it. "
            "Use cache=True, or declare the length with "
            "dataset.apply(tf.data.experimental.assert_cardinality(n))."
        )
    return ds


def _finish(plan: _Plan, state: PipelineState, ds, count, how) -> tf.data.Dataset:
    """Prefetched, the shard policy set, a full epoch's length, the state attached."""
    ds = ds.prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = plan.policy
    ds = ds.with_options(options)
    if plan.positioned:
        ds = _full_epochs(plan, ds, count)
    # The graph reads the position and the cached examples by handle: the dataset
    # keeps them alive (the process's set of positions holds weak references only).
    state.attach(ds)
    with process.state().lock:
        process.state().batch_plans[ds] = (plan.batch, plan.replicas, plan.per_replica_given)
    logger.info(
        "tfdist.data: global batch %d (%d x %d replicas), drop_remainder=%s, shard by %s "
        "(%s), cache=%s, shuffle=%s, seed=%s, map_fn applied %s",
        plan.batch,
        plan.per_replica_batch,
        plan.replicas,
        plan.drop_remainder,
        plan.policy.name,
        plan.why,
        plan.cache,
        plan.shuffle,
        plan.seed,
        how or "never (none given)",
    )
    return ds


def pipeline(
    dataset,
    per_replica_batch: int | None = None,
    *,
    global_batch: int | None = None,
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
            example axis (what Keras ``fit`` takes). A dataset that already yields
            batches (``.batch()``/``padded_batch()`` with only prefetch, cache, shuffle
            or shape-keeping maps after it, or ``tfds.load(batch_size=...)``) is
            refused rather than batched twice.
        per_replica_batch: examples per replica per step (the global batch is this times
            the replicas of the distribution in effect when the pipeline is built).
        global_batch: instead of ``per_replica_batch``: examples per training step across
            the whole job, divisible by the replicas (the data axis of a mesh). Use it
            with model parallelism or when the pipeline is built before its scope: a
            ``ModelParallel`` scope entered later checks it against its data axis (and
            warns when a ``per_replica_batch`` pipeline was sized for other replicas).
        map_fn: applied to every example (decode, scale, ...), e.g. ``tfdist.data.scale``.
        map_on: ``'auto'`` (default): per example, and when the data is cached in
            memory vectorised over all examples at once with ``tf.vectorized_map``
            (the same results, many times faster; functions it cannot vectorise run per
            example; a function marked ``fn.batch_safe = True``, as
            ``tfdist.data.scale`` is, is called once on all of them); ``'example'``: one
            call per example; ``'batch'``: called on each
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
        >>> images.shape                                              # doctest: +SKIP
        TensorShape([128, 28, 28, 1])
        >>> # 128 = 64 x 2 replicas: the GLOBAL batch
    """
    plan = _plan(
        dataset,
        per_replica_batch,
        global_batch,
        map_fn,
        map_on,
        cache,
        shuffle,
        seed,
        drop_remainder,
        strategy,
    )
    state = new_state(seeded=plan.seeded, positioned=plan.positioned)
    ds, count, how = _build(plan, state)
    return _finish(plan, state, ds, count, how)
