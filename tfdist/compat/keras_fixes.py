"""Fixes to Keras 3 on the TensorFlow backend that break distributed training upstream.

Each ``_fix_*`` function's docstring says what breaks, what the fix changes and why the
result is the one upstream computes on one device. Every private Keras/TensorFlow name
used comes from ``tfdist._private``.
"""

from __future__ import annotations

from tfdist import _private
from tfdist.compat.registry import patch

__all__ = [
    "fix_ema_overwrite",
    "fix_symbolic_build",
    "fix_multi_worker_mean",
    "fix_gradient_accumulation",
    "fix_progbar_chief_only",
    "cross_replica_apply",
]


# ------------------------------------------------- fix: symbolic build from the spec


def _symbolic_batch(iterator):
    """KerasTensors shaped like one replica's batch, from the dataset's element_spec.

    Returns None when a spec has an unknown rank (a ``py_function`` without
    ``set_shape``): then only a real batch tells the shapes.
    """
    import keras
    import tensorflow as tf

    per_replica_spec = _private.tf_per_replica_spec_class()
    dataset = _private.tf_distributed_dataset(iterator)
    if dataset is None:
        return None

    class _UnknownRank(Exception):
        pass

    def to_symbolic(spec):
        if isinstance(spec, per_replica_spec):  # one spec per local replica, all alike
            spec = _private.tf_per_replica_component_spec(spec)
        if isinstance(spec, tf.OptionalSpec) or type(spec).__name__ == "NoneTensorSpec":
            return None  # the trainer turns optionals and Nones into None too
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None:
            raise _UnknownRank
        return keras.KerasTensor(
            tuple(shape.as_list()), dtype=keras.backend.standardize_dtype(spec.dtype)
        )

    try:
        return tf.nest.map_structure(to_symbolic, dataset.element_spec)
    except _UnknownRank:
        return None


def _local_batch(strategy, iterator):
    """One real batch as this worker's first replica sees it: no cross-worker reduce."""
    import tensorflow as tf

    for _, _, it in iterator:
        batch = next(it)
        break
    else:  # pragma: no cover - an empty dataset fails later, in the trainer, with its message
        return None

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return tf.nest.map_structure(local, batch)


def fix_symbolic_build() -> None:
    """Builds the model for ``fit``/``evaluate`` from the dataset's spec, not a real batch.

    Upstream ``TensorFlowTrainer._maybe_symbolic_build`` pulls one batch from the
    distributed iterator and averages it across replicas with
    ``strategy.reduce("MEAN", batch, axis=None)``, only to read its shapes and dtypes.
    Under MultiWorkerMirroredStrategy that reduce is a cross-worker collective on a
    nested batch and fails ("Attempt to convert a value (PerReplica...)"). It also
    costs every ``fit``/``evaluate`` one extra pass over a batch, which a pipeline that
    counts its iterations sees.

    The fix passes KerasTensors made from the distributed dataset's ``element_spec``
    (the spec of one replica's batch) to the same ``_symbolic_build``. That is exactly
    the information the averaged batch carried (shape and dtype; the batch dimension
    may be None, as for any ``keras.Input``), so the model, metrics and loss are built
    identically, and no data is read. When a spec has an unknown rank, it falls back
    to one real batch and takes this worker's first replica's part of it (shapes are
    equal on all replicas), which needs no cross-worker reduce either.
    """
    tf_trainer = _private.keras_tf_trainer_module()

    def make(original):
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            explicit = _private.keras_model_strategy_or_none(self)
            if explicit is None or iterator is None or data_batch is not None:
                return original(self, iterator=iterator, data_batch=data_batch)
            batch = _symbolic_batch(iterator)
            if batch is None:
                batch = _local_batch(self.distribute_strategy, iterator)
            with self.distribute_strategy.scope():
                _private.keras_symbolic_build(self, batch)

        return _maybe_symbolic_build

    patch(
        tf_trainer.TensorFlowTrainer,
        "_maybe_symbolic_build",
        "keras_symbolic_build_from_spec",
        make,
    )


# ------------------------------------------------- fix: multi-worker metric reduction


def _multi_worker_mean(strategy, value):
    """The mean of ``value`` over all replicas of all workers (see ``fix_multi_worker_mean``)."""
    if _private.tf_is_distributed_variable(_tf_var(value)):
        # A metric whose result() returns its variable: reading it in cross-replica
        # context already gives the value every replica agrees on (a SyncOnRead
        # variable aggregates all replicas of all workers), as upstream's
        # single-worker branch returns it.
        return value
    return strategy.reduce("MEAN", value, axis=None)


def _multi_worker_means(strategy, values, tree):
    """Every value's mean over all replicas of all workers, the scalars of each dtype
    stacked into one all-reduce (a step's loss and metrics: one collective, not one each).

    The mean of a stacked vector is the mean of each element, computed alike: the
    results are those of one reduction per value.
    """
    import tensorflow as tf

    leaves = tree.flatten(values)
    reduced = [None] * len(leaves)
    by_dtype: dict = {}
    for index, value in enumerate(leaves):
        local = strategy.experimental_local_results(value)
        if _private.tf_is_distributed_variable(_tf_var(value)) or not all(
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


def fix_multi_worker_mean() -> None:
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

    tree = _private.keras_tree()
    tf_trainer = _private.keras_tf_trainer_module()

    def make(original):
        def reduce_per_replica(values, strategy, reduction):
            tpu = isinstance(strategy, tf.distribute.TPUStrategy)
            if (
                reduction in ("auto", "mean")
                and not tpu
                and _private.tf_in_multi_worker_mode(strategy)
            ):
                return _multi_worker_means(strategy, values, tree)
            return original(values, strategy, reduction)

        return reduce_per_replica

    patch(tf_trainer, "reduce_per_replica", "keras_multi_worker_mean", make)


def _tf_var(v):
    """The tf.Variable behind a Keras variable (strategies update tf.Variables)."""
    return v.value if isinstance(v, _private.keras_backend_variable_class()) else v


def _accumulate_in_replica_context(optimizer, grads, variables) -> None:
    """Steps 1-2 of the gradient-accumulation fix (see ``fix_gradient_accumulation``)."""
    import tensorflow as tf

    steps = optimizer.gradient_accumulation_steps
    context = tf.distribute.get_replica_context()
    accumulators = _private.keras_optimizer_accumulators(optimizer, variables)
    # This replica's own gradient, dense (IndexedSlices too): nothing is reduced here.
    # Times the replica count: each copy of an accumulator then holds N x its replica's
    # share, so the MEAN over the copies is the window's sum so far, the value one device
    # holds, whatever N is (what ``consolidate_accumulators`` writes into every copy).
    replicas = context.num_replicas_in_sync
    local = [tf.convert_to_tensor(g) * replicas for g in grads]
    # Reading a mirrored accumulator in replica context reads this replica's copy: its
    # local sum of the window's earlier micro-steps.
    totals = [g + acc for g, acc in zip(local, accumulators, strict=True)]

    def merge_fn(distribution, local, totals):
        tf.cond(
            # The micro-step counter, as upstream: ``iterations`` counts updates only.
            (_private.keras_optimizer_micro_steps(optimizer) + 1) % steps == 0,
            lambda: _cross_replica_update(optimizer, distribution, totals, variables, accumulators),
            lambda: _cross_replica_accumulate(distribution, local, accumulators),
        )

    context.merge_call(merge_fn, args=(local, totals))


def _cross_replica_update(optimizer, distribution, totals, variables, accumulators) -> None:
    """The update step: the window's one all-reduce, clip, the update, accumulators zeroed."""
    import tensorflow as tf

    reduced = distribution.extended.batch_reduce_to(
        tf.distribute.ReduceOp.MEAN,
        [(t, _tf_var(v)) for t, v in zip(totals, variables, strict=True)],
    )
    clipped = _clipped_means(optimizer, distribution, reduced)
    cross_replica_apply(optimizer, distribution, clipped, variables)
    for acc in accumulators:
        distribution.extended.update(
            _tf_var(acc), lambda a: a.assign(tf.zeros_like(a)), group=False
        )


def _clipped_means(optimizer, distribution, reduced) -> list:
    """``clip(sum / k)`` of the all-reduced window sums, on each local device's copy.

    ``clipnorm``/``global_clipnorm`` see the global mean gradient, as on one device. Each
    device clips its own (identical) copy, so no device waits for another's.
    """
    import tensorflow as tf

    steps = optimizer.gradient_accumulation_steps
    copies = [distribution.experimental_local_results(r) for r in reduced]
    local_replicas = len(copies[0])
    per_device = []
    for d in range(local_replicas):
        with tf.device(copies[0][d].device):
            per_device.append(
                _private.keras_optimizer_clip(optimizer, [c[d] / steps for c in copies])
            )

    def value(i):
        # Replica ids run over the cluster; a worker's local replicas are consecutive.
        return lambda ctx: per_device[ctx.replica_id_in_sync_group % local_replicas][i]

    return [
        distribution.experimental_distribute_values_from_function(value(i))
        for i in range(len(reduced))
    ]


def cross_replica_apply(optimizer, distribution, grads, variables) -> None:
    """Weight decay, then the optimizer's update of every variable with ``grads``.

    What upstream's ``_apply_weight_decay`` and ``_backend_update_step`` do after their
    all-reduce, for gradients already all-reduced (and clipped): no second reduction.
    Shared by the gradient-accumulation and clipping fixes (``tfdist.compat.clipping``);
    called with the strategy ``merge_call`` hands over.

    Example:
        >>> cross_replica_apply(opt, strategy, clipped, variables)  # doctest: +SKIP
    """
    import tensorflow as tf

    if optimizer.weight_decay is not None:

        def weight_decay_fn(variable):
            if _private.keras_optimizer_uses_weight_decay(optimizer, variable):
                lr = tf.cast(optimizer.learning_rate, variable.dtype)
                wd = tf.cast(optimizer.weight_decay, variable.dtype)
                variable.assign_sub(variable * wd * lr)

        for variable in variables:
            distribution.extended.update(_tf_var(variable), weight_decay_fn, group=False)
    _private.keras_optimizer_distributed_update(
        optimizer,
        distribution,
        list(zip(grads, [_tf_var(v) for v in variables], strict=True)),
        optimizer.learning_rate,
    )


def consolidate_accumulators(optimizer) -> bool:
    """Gives every copy of each gradient accumulator the mean of the copies, mid-window.

    Under the fix, the copies of a mirrored accumulator differ between updates (each
    holds N x its replica's share), and a save reads one copy. Called before a save (the
    fix's ``save_own_variables``, tfdist's checkpoints), this makes every copy the mean:
    the window's sum so far, the value one device holds. A checkpoint written mid-window
    then resumes exactly, on any number of replicas. A collective: under
    MultiWorkerMirroredStrategy every worker must save (as the fixed Keras callbacks and
    tfdist's checkpoints do). Returns whether anything was done (not at a window
    boundary, where every copy is zero, nor on one replica).

    Example:
        >>> consolidate_accumulators(model.optimizer)  # doctest: +SKIP
        True
    """
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    accumulators = _private.keras_optimizer_all_accumulators(optimizer) if steps else []
    if not accumulators:
        return False  # no accumulation, or an optimizer not built yet
    variables = [_tf_var(a) for a in accumulators]
    strategy = getattr(variables[0], "distribute_strategy", None)  # tf.distribute's only
    if strategy is None or strategy.num_replicas_in_sync == 1:
        return False
    if int(_private.keras_optimizer_micro_steps(optimizer).numpy()) % steps == 0:
        return False  # a window boundary: every copy is zero already
    import tensorflow as tf

    def copies_of(var):
        copies = strategy.experimental_local_results(var)

        def value(context):
            # Replica ids run over the cluster; a worker's local replicas are consecutive.
            copy = copies[context.replica_id_in_sync_group % len(copies)]
            with tf.device(copy.device):
                return tf.identity(copy)

        # Per replica, not mirrored: a MEAN of a mirrored value is returned unreduced.
        return strategy.experimental_distribute_values_from_function(value)

    @tf.function(autograph=False)
    def consolidate():
        pairs = [(copies_of(var), var) for var in variables]
        means = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.MEAN, pairs)
        for var, mean in zip(variables, means, strict=True):
            strategy.extended.update(var, lambda a, m: a.assign(m), args=(mean,), group=False)

    with strategy.scope():
        consolidate()
    return True


def _cross_replica_accumulate(distribution, local, accumulators) -> None:
    """The accumulate step: each replica adds its own gradient to its own accumulator copy.

    No communication: the copies of a mirrored accumulator hold different local sums
    until the update step all-reduces them.
    """
    for grad, acc in zip(local, accumulators, strict=True):
        distribution.extended.update(
            _tf_var(acc), lambda a, g: a.assign_add(g), args=(grad,), group=False
        )


# ------------------------------------------------- fix: gradient accumulation


def fix_gradient_accumulation() -> None:
    """Makes ``gradient_accumulation_steps`` work under Mirrored/MultiWorkerMirrored.

    Upstream ``BaseOptimizer._backend_apply_gradients`` wraps "update" and
    "accumulate" in ``ops.cond`` in replica context, and both branches reach
    ``merge_call`` (the TF optimizer's all-reduce and variable updates). A
    ``merge_call`` inside a ``tf.cond`` branch is not allowed ("merge_call called while
    defining a new graph"), so any strategy with more than one replica fails.

    The fix keeps the same arithmetic, moves the synchronisation out of the cond, and
    communicates once per window instead of once per micro-step (Horovod's
    ``backward_passes_per_step``, DDP's ``no_sync``):

    1. in replica context, nothing is reduced: each replica forms ``acc_r + N * g_r``
       (its copy of the accumulator plus N times this step's local gradient, N the
       replica count);
    2. one ``merge_call``; in cross-replica context, ``tf.cond(is_update_step, ...)``
       either adds ``N * g_r`` to replica r's own copy of the accumulator (no
       communication), or, on the k-th micro-step, all-reduces (MEAN) those window sums
       once, divides by k, clips (``clipnorm``/``global_clipnorm`` see the global mean
       gradient, as on one device), applies weight decay and the optimizer update
       (``update_step`` on every variable, via ``extended.update``) and zeroes the
       accumulators.

    The loss is already scaled by 1/replicas, so the MEAN over replicas of N times the
    local window sums is the sum of the k global-batch gradients, and the update equals
    accumulation on one device with the same global batch. Between updates the copies of
    an accumulator differ; ``consolidate_accumulators`` sets each to their mean before
    every save (patched ``save_own_variables``; tfdist's own checkpoints), so a
    checkpoint written mid-window holds the window's sum so far, as one device's does,
    and resumes exactly on any number of replicas. Without a strategy, in
    cross-replica context, or eagerly (where upstream's ``merge_call`` inside
    ``ops.cond`` works), upstream's code runs unchanged.
    """

    def make(upstream):
        def _backend_apply_gradients(self, grads, trainable_variables):
            import tensorflow as tf

            if (
                not self.gradient_accumulation_steps
                or not tf.distribute.has_strategy()
                or tf.distribute.in_cross_replica_context()
                # Eagerly (strategy.run outside a tf.function) upstream's cond is a Python
                # branch and its merge_call works: upstream stays as it is there.
                or tf.executing_eagerly()
            ):
                return upstream(self, grads, trainable_variables)
            _accumulate_in_replica_context(self, grads, trainable_variables)
            # Unchanged from upstream: the moving average of the weights, if asked for.
            _private.keras_optimizer_ema_step(self)

        return _backend_apply_gradients

    # Set on the TensorFlow optimizer class (the original is found through its bases), so
    # it shadows BaseOptimizer's method for every Keras optimizer on this backend only.
    tf_optimizer = _private.keras_tf_optimizer_module()
    patch(tf_optimizer.TFOptimizer, "_backend_apply_gradients", "keras_gradient_accumulation", make)

    def make_save(upstream):
        def save_own_variables(self, store):
            # Every save of a Keras model (``save``, ``save_weights``, the callbacks)
            # writes the optimizer through here: mid-window, the copies are made equal
            # first, so the one copy saved is the window's sum (see above).
            consolidate_accumulators(self)
            return upstream(self, store)

        return save_own_variables

    patch(tf_optimizer.TFOptimizer, "save_own_variables", "keras_gradient_accumulation", make_save)


# ------------------------------------------------- fix: progress bars on the chief only


def fix_progbar_chief_only() -> None:
    """Silences Keras' progress bar on the non-chief workers of a multi-worker job.

    Every worker of a MultiWorkerMirroredStrategy job runs the same ``fit`` and computes
    the same global metrics (the epoch logs come from all-reduced metric variables), so
    N workers print N copies of every progress bar and epoch summary. Keras 3 has no
    chief logic. The fix sets ``verbose=0`` on ``keras.callbacks.ProgbarLogger`` when
    the model's strategy spans several workers and this worker is not the one that
    writes summaries (``strategy.extended.should_save_summary``, True on the chief
    only). Nothing else changes: callbacks, History and the returned logs are the same
    on every worker.
    """

    def make(original):
        def set_params(self, params):
            original(self, params)
            strategy = getattr(getattr(self, "model", None), "distribute_strategy", None)
            if strategy is not None and _private.tf_in_multi_worker_mode(strategy):
                if not strategy.extended.should_save_summary:
                    self.verbose = 0

        return set_params

    patch(_private.keras_progbar_logger_class(), "set_params", "keras_progbar_chief_only", make)


# ------------------------------------------------- fix: EMA overwrite under a strategy


def _in_replica_context_of_a_strategy() -> bool:
    import tensorflow as tf

    return (
        tf.distribute.has_strategy()
        and not tf.distribute.in_cross_replica_context()
        and not tf.executing_eagerly()
    )


def fix_ema_overwrite() -> None:
    """Makes ``use_ema`` with ``ema_overwrite_frequency`` work under a tf.distribute strategy.

    Upstream ``BaseOptimizer._backend_apply_gradients`` ends with the moving average of
    the weights and, every ``ema_overwrite_frequency`` updates, an ``ops.cond`` that
    overwrites the weights with that average. Under MirroredStrategy or
    MultiWorkerMirroredStrategy the step runs in replica context, where assigning a
    mirrored variable is a ``merge_call``, which is not allowed inside a cond branch:
    ``fit`` fails ("merge_call called while defining a new graph"). In that case only
    (replica context of a strategy, an overwrite frequency, no gradient accumulation,
    which ``keras_gradient_accumulation`` handles), the fix runs upstream's own steps of
    the non-accumulating branch (clip, weight decay, ``_backend_update_step``, the moving
    average) and then the same condition and overwrite in one ``merge_call``, in
    cross-replica context, where each assignment updates every replica's copy with the
    same mirrored average: the weights one device gets. (Upstream's attribute cannot be
    switched off for the call: MirroredStrategy runs the replicas in threads that share
    the optimizer.) Otherwise upstream's code runs unchanged.
    """

    def make(upstream):
        def _backend_apply_gradients(self, grads, trainable_variables):
            if (
                not (self.use_ema and self.ema_overwrite_frequency)
                or self.gradient_accumulation_steps
                or not _in_replica_context_of_a_strategy()
            ):
                return upstream(self, grads, trainable_variables)
            # Upstream's non-accumulating branch, step for step.
            grads = _private.keras_optimizer_clip(self, grads)
            _private.keras_optimizer_apply_weight_decay(self, trainable_variables)
            _private.keras_optimizer_update_step(self, grads, trainable_variables)
            _private.keras_optimizer_ema_step(self)  # the overwrite in cross-replica context

        return _backend_apply_gradients

    patch(
        _private.keras_base_optimizer_class(),
        "_backend_apply_gradients",
        "keras_ema_overwrite_under_strategy",
        make,
    )
