"""Fixes to Keras 3 on the TensorFlow backend that break distributed training upstream.

Each ``_fix_*`` function's docstring says what breaks, what the fix changes and why the
result is the one upstream computes on one device. Every private Keras/TensorFlow name
used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

from typing import Any

from tfdist.core import upstream
from tfdist.core.cross_replica import (
    accumulate_in_replica_context,
    consolidate_accumulators,
    tf_var,
)
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "KERAS_TF_PROGBAR_CHIEF_ONLY",
    "KERAS_TF_GRADIENT_ACCUMULATION",
    "KERAS_TF_EMA_OVERWRITE_UNDER_STRATEGY",
    "KERAS_TF_MULTI_WORKER_MEAN",
    "KERAS_TF_SYMBOLIC_BUILD_FROM_SPEC",
    "KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE",
    "keras_tf_scalar_of_a_mirrored_variable",
    "keras_tf_ema_overwrite_under_strategy",
    "keras_tf_symbolic_build_from_spec",
    "keras_tf_multi_worker_mean",
    "keras_tf_gradient_accumulation",
    "keras_tf_progbar_chief_only",
]

# The fixes' names, declared once (other layers import them).
KERAS_TF_SYMBOLIC_BUILD_FROM_SPEC = "keras_tf_symbolic_build_from_spec"
KERAS_TF_MULTI_WORKER_MEAN = "keras_tf_multi_worker_mean"
KERAS_TF_EMA_OVERWRITE_UNDER_STRATEGY = "keras_tf_ema_overwrite_under_strategy"
KERAS_TF_GRADIENT_ACCUMULATION = "keras_tf_gradient_accumulation"
KERAS_TF_PROGBAR_CHIEF_ONLY = "keras_tf_progbar_chief_only"
KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE = "keras_tf_scalar_of_a_mirrored_variable"


# ------------------------------------------------- fix: symbolic build from the spec


def _symbolic_batch(iterator):
    """KerasTensors shaped like one replica's batch, from the dataset's element_spec.

    Returns None when a spec has an unknown rank (a ``py_function`` without
    ``set_shape``): then only a real batch tells the shapes.
    """
    import keras
    import tensorflow as tf

    per_replica_spec = upstream.tf_per_replica_spec_class()
    dataset = upstream.tf_distributed_dataset(iterator)
    if dataset is None:
        return None

    class _UnknownRank(Exception):
        pass

    def to_symbolic(spec):
        if isinstance(spec, per_replica_spec):  # one spec per local replica, all alike
            spec = upstream.tf_per_replica_component_spec(spec)
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


def keras_tf_symbolic_build_from_spec() -> None:
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
    tf_trainer = upstream.keras_tf_trainer_module()

    def make(original):
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            explicit = upstream.keras_model_strategy_or_none(self)
            if explicit is None or iterator is None or data_batch is not None:
                return original(self, iterator=iterator, data_batch=data_batch)
            batch = _symbolic_batch(iterator)
            if batch is None:
                batch = _local_batch(self.distribute_strategy, iterator)
            with self.distribute_strategy.scope():
                upstream.keras_symbolic_build(self, batch)

        return _maybe_symbolic_build

    patch(
        tf_trainer.TensorFlowTrainer,
        "_maybe_symbolic_build",
        KERAS_TF_SYMBOLIC_BUILD_FROM_SPEC,
        make,
    )


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


# ------------------------------------------------- fix: gradient accumulation


def keras_tf_gradient_accumulation() -> None:
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

    def make(original):
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
                return original(self, grads, trainable_variables)
            accumulate_in_replica_context(self, grads, trainable_variables)
            # Unchanged from upstream: the moving average of the weights, if asked for.
            upstream.keras_optimizer_ema_step(self)

        return _backend_apply_gradients

    # Set on the TensorFlow optimizer class (the original is found through its bases), so
    # it shadows BaseOptimizer's method for every Keras optimizer on this backend only.
    tf_optimizer = upstream.keras_tf_optimizer_module()
    patch(
        tf_optimizer.TFOptimizer, "_backend_apply_gradients", KERAS_TF_GRADIENT_ACCUMULATION, make
    )

    def make_save(original):
        def save_own_variables(self, store):
            # Every save of a Keras model (``save``, ``save_weights``, the callbacks)
            # writes the optimizer through here: mid-window, the copies are made equal
            # first, so the one copy saved is the window's sum (see above).
            consolidate_accumulators(self)
            return original(self, store)

        return save_own_variables

    patch(tf_optimizer.TFOptimizer, "save_own_variables", KERAS_TF_GRADIENT_ACCUMULATION, make_save)


# ------------------------------------------------- fix: progress bars on the chief only


def keras_tf_progbar_chief_only() -> None:
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
            if strategy is not None and upstream.tf_in_multi_worker_mode(strategy):
                if not strategy.extended.should_save_summary:
                    self.verbose = 0

        return set_params

    patch(upstream.keras_progbar_logger_class(), "set_params", KERAS_TF_PROGBAR_CHIEF_ONLY, make)


# ------------------------------------------------- fix: int() of a mirrored variable


def keras_tf_scalar_of_a_mirrored_variable() -> None:
    """Makes ``int()`` and ``float()`` of a scalar Keras variable work under a strategy.

    A callback that reads ``int(self.model.optimizer.iterations)`` (Keras's own
    callback tests do; learning-rate warm-ups do) fails under Mirrored and
    MultiWorkerMirroredStrategy: Keras's ``Variable.__int__`` calls ``int(self.value)``,
    and the value there is a ``MirroredVariable``, which has no ``__int__`` ("int()
    argument must be ... not 'MirroredVariable'"). ``np.asarray`` of the same variable
    works and reads its value. The fix converts such a distributed value through NumPy,
    as one device's ``tf.Variable`` converts; a variable that is not distributed, or
    not a scalar (upstream's TypeError), takes upstream's path.
    """

    def make(original, kind):
        def convert(self):
            import numpy as np
            import tensorflow as tf

            if self.ndim > 0 or not isinstance(self.value, tf.distribute.DistributedValues):
                return original(self)
            return kind(np.asarray(self))

        return convert

    variable = upstream.keras_backend_variable_class()
    patch(variable, "__int__", KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE, lambda o: make(o, int))
    patch(variable, "__float__", KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE, lambda o: make(o, float))


# ------------------------------------------------- fix: EMA overwrite under a strategy


def _in_replica_context_of_a_strategy() -> bool:
    import tensorflow as tf

    return (
        tf.distribute.has_strategy()
        and not tf.distribute.in_cross_replica_context()
        and not tf.executing_eagerly()
    )


def keras_tf_ema_overwrite_under_strategy() -> None:
    """Makes ``use_ema`` with ``ema_overwrite_frequency`` work under a tf.distribute strategy.

    Upstream ``BaseOptimizer._backend_apply_gradients`` ends with the moving average of
    the weights and, every ``ema_overwrite_frequency`` updates, an ``ops.cond`` that
    overwrites the weights with that average. Under MirroredStrategy or
    MultiWorkerMirroredStrategy the step runs in replica context, where assigning a
    mirrored variable is a ``merge_call``, which is not allowed inside a cond branch:
    ``fit`` fails ("merge_call called while defining a new graph"). In that case only
    (replica context of a strategy, an overwrite frequency, no gradient accumulation,
    which ``keras_tf_gradient_accumulation`` handles), the fix runs upstream's own steps of
    the non-accumulating branch (clip, weight decay, ``_backend_update_step``, the moving
    average) and then the same condition and overwrite in one ``merge_call``, in
    cross-replica context, where each assignment updates every replica's copy with the
    same mirrored average: the weights one device gets. (Upstream's attribute cannot be
    switched off for the call: MirroredStrategy runs the replicas in threads that share
    the optimizer.) Otherwise upstream's code runs unchanged.
    """

    def make(original):
        def _backend_apply_gradients(self, grads, trainable_variables):
            if (
                not (self.use_ema and self.ema_overwrite_frequency)
                or self.gradient_accumulation_steps
                or not _in_replica_context_of_a_strategy()
            ):
                return original(self, grads, trainable_variables)
            # Upstream's non-accumulating branch, step for step.
            grads = upstream.keras_optimizer_clip(self, grads)
            upstream.keras_optimizer_apply_weight_decay(self, trainable_variables)
            upstream.keras_optimizer_update_step(self, grads, trainable_variables)
            upstream.keras_optimizer_ema_step(self)  # the overwrite in cross-replica context

        return _backend_apply_gradients

    patch(
        upstream.keras_base_optimizer_class(),
        "_backend_apply_gradients",
        KERAS_TF_EMA_OVERWRITE_UNDER_STRATEGY,
        make,
    )


# Module prefixes of the targets below.
_KT = "keras.src.backend.tensorflow.trainer:"
_KO = "keras.src.backend.tensorflow.optimizer:"
_KB = "keras.src.optimizers.base_optimizer:"
_CARS = "tensorflow.python.distribute.collective_all_reduce_strategy:"

FIXES: list[Fix] = [
    Fix(
        KERAS_TF_SYMBOLIC_BUILD_FROM_SPEC,
        "Keras 3 fit/evaluate under MultiWorkerMirroredStrategy: 'Attempt to convert a "
        "value (PerReplica...)' in TensorFlowTrainer._maybe_symbolic_build",
        on_keras_backend("tensorflow"),
        keras_tf_symbolic_build_from_spec,
        targets=targets(
            _KT + "TensorFlowTrainer._maybe_symbolic_build",
            _KT + "TensorFlowTrainer._symbolic_build",
            _KT + "TensorFlowTrainer._distribute_strategy (instance)",
            _KT + "TFEpochIterator._distributed_dataset (instance)",
            "tensorflow.python.distribute.values:PerReplicaSpec._component_specs",
        ),
        acts_where=(
            "fit/evaluate of a model built in a tf.distribute strategy's scope (any replica "
            "count); no model strategy, `*_on_batch`: upstream's path"
        ),
        no_harm=(
            "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes",
            "tests/compat/test_upstream_keras.py::test_keras_tests_fail_with_the_fixes_only_where_they_fail_without[tensorflow]",
        ),
    ),
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
    Fix(
        KERAS_TF_EMA_OVERWRITE_UNDER_STRATEGY,
        "Keras 3 Optimizer(use_ema=True, ema_overwrite_frequency=k) under Mirrored/Multi"
        "WorkerMirroredStrategy: 'merge_call called while defining a new graph'",
        on_keras_backend("tensorflow"),
        keras_tf_ema_overwrite_under_strategy,
        targets=targets(
            _KB + "BaseOptimizer._backend_apply_gradients",
            _KB + "BaseOptimizer._clip_gradients",
            _KB + "BaseOptimizer._apply_weight_decay",
            _KB + "BaseOptimizer._backend_update_step",
            _KB + "BaseOptimizer._update_model_variables_moving_average",
            _KB + "BaseOptimizer._overwrite_model_variables_with_average_value",
            _KB + "BaseOptimizer._trainable_variables (instance)",
            "keras.src.ops:cond",
        ),
        acts_where=(
            "Optimizer(use_ema=True, ema_overwrite_frequency=k), no gradient accumulation, "
            "applied in a traced replica function of a strategy; eagerly, no strategy: "
            "upstream's"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_TF_GRADIENT_ACCUMULATION,
        "Keras 3 Optimizer(gradient_accumulation_steps=k) under Mirrored/MultiWorker"
        "MirroredStrategy: 'merge_call called while defining a new graph'",
        on_keras_backend("tensorflow"),
        keras_tf_gradient_accumulation,
        targets=targets(
            _KO + "TFOptimizer._backend_apply_gradients",
            _KB + "BaseOptimizer.save_own_variables",
            _KO + "TFOptimizer._distributed_tf_update_step",
            _KB + "BaseOptimizer._get_variable_index",
            _KB + "BaseOptimizer._clip_gradients",
            _KB + "BaseOptimizer._use_weight_decay",
            _KB + "BaseOptimizer._update_model_variables_moving_average",
            _KB + "BaseOptimizer._overwrite_model_variables_with_average_value",
            _KB + "BaseOptimizer._accumulated_gradients (instance)",
            _KB + "BaseOptimizer._iterations (instance)",
            _KB + "BaseOptimizer._trainable_variables (instance)",
            "keras.src.backend:Variable",
        ),
        acts_where=(
            "Optimizer(gradient_accumulation_steps=k) applied in a traced replica function "
            "of a strategy, and its saves mid-window on >1 replica; eagerly, no strategy: "
            "upstream's"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_TF_PROGBAR_CHIEF_ONLY,
        "Keras 3 prints progress bars on every worker of a multi-worker job",
        on_keras_backend("tensorflow"),
        keras_tf_progbar_chief_only,
        targets=targets(
            "keras.src.callbacks.progbar_logger:ProgbarLogger.set_params",
            _CARS + "CollectiveAllReduceExtended._in_multi_worker_mode",
        ),
        acts_where=(
            "ProgbarLogger (verbose != 0) on a non-chief worker of "
            "MultiWorkerMirroredStrategy with >1 worker; the chief, one worker: untouched"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE,
        "Keras 3 under Mirrored/MultiWorkerMirroredStrategy: int() or float() of a scalar "
        "variable (int(model.optimizer.iterations) in a callback) raises 'int() argument "
        "must be ... not MirroredVariable'",
        on_keras_backend("tensorflow"),
        keras_tf_scalar_of_a_mirrored_variable,
        targets=targets(
            "keras.src.backend.common.variables:Variable.__int__",
            "keras.src.backend.common.variables:Variable.__float__",
            "keras.src.backend:Variable",
        ),
        acts_where=(
            "int() and float() of a scalar Keras variable whose value is distributed (built "
            "under a strategy); other variables and shapes: upstream's"
        ),
        no_harm=(
            "tests/compat/test_upstream_keras.py::test_keras_tests_under_tfdist_scope_fail_with_the_fixes_only_where_they_fail_without",
        ),
    ),
]
