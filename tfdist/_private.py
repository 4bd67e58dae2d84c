"""Every private TensorFlow and Keras name tfdist touches, behind one named helper each.

Upstream has no public way to do these things; each helper says why tfdist needs it.
``tests/test_private.py`` checks that every name still exists in the installed versions,
so an upgrade that moves one fails that test, naming the helper, instead of breaking
training somewhere else. Nothing outside this module spells a private upstream name.

Heavy imports happen inside the helpers: importing this module is free.

Example:
    >>> from tfdist import _private
    >>> _private.REQUIRED["tensorflow"][0]
    'tensorflow.python.eager.context:Context.ensure_initialized'
"""

from __future__ import annotations

import importlib

__all__ = [
    "REQUIRED",
    "INSTANCE_ATTRIBUTES",
    "SOURCE_ATTRIBUTES",
    "resolve",
    "tf_context",
    "tf_context_initialized",
    "tf_collectives_configured",
    "tf_context_class",
    "tf_collective_extended_class",
    "tf_collective_options",
    "tf_in_multi_worker_mode",
    "tf_extended_num_workers",
    "tf_is_distributed_variable",
    "tf_communication_options",
    "tf_set_communication_options",
    "tf_collectives_enabled",
    "tf_mark_server_started",
    "tf_configure_coordination",
    "tf_key_value_set",
    "tf_key_value_get",
    "tf_per_replica_spec_class",
    "tf_per_replica_component_spec",
    "tf_distributed_dataset",
    "tf_dataset_variant",
    "tf_dataset_graph_def",
    "tf_dataset_inputs",
    "keras_tf_trainer_module",
    "keras_loss_module",
    "keras_model_class",
    "keras_py_dataset_adapter_class",
    "tf_distributed_dataset_class",
    "tf_legacy_rebatch",
    "keras_tf_optimizer_module",
    "keras_tree",
    "keras_backend_variable_class",
    "keras_ops",
    "keras_progbar_logger_class",
    "keras_seed_generators",
    "keras_optimizer_learning_rate",
    "keras_model_strategy_or_none",
    "keras_symbolic_build",
    "keras_optimizer_accumulators",
    "keras_optimizer_all_accumulators",
    "keras_optimizer_clip",
    "keras_optimizer_micro_steps",
    "keras_optimizer_uses_weight_decay",
    "keras_optimizer_distributed_update",
    "keras_optimizer_ema_step",
    "keras_optimizer_ema_overwrite",
    "keras_base_optimizer_class",
    "keras_loss_scale_optimizer_class",
    "keras_optimizer_apply_weight_decay",
    "keras_optimizer_update_step",
    "keras_jax_distribution_lib",
    "keras_jax_epoch_iterator_class",
    "tf_wait_at_barrier",
    "jax_wait_at_barrier",
    "keras_trainer_class",
    "keras_jax_trainer_class",
    "keras_distribution_class",
    "MODEL_CHECKPOINT_HOOKS",
]

# "module:attribute.path" of every private name used below, per package (tested).
REQUIRED = {
    "jax": [
        "keras.src.backend.jax.distribution_lib:initialize",
        "keras.src.backend.jax.distribution_lib:initialize_rng",
        "keras.src.backend.jax.trainer:JAXTrainer.fit",
        "keras.src.backend.jax.trainer:JAXEpochIterator._get_distributed_iterator",
        "keras.src.distribution.distribution_lib:Distribution.distribute_tf_dataset",
        "keras.src.trainers.trainer:Trainer.__init__",
        "jax._src.distributed:State.client",
    ],
    "tensorflow": [
        "tensorflow.python.eager.context:Context.ensure_initialized",
        "tensorflow.python.eager.context:Context.configure_coordination_service",
        "tensorflow.python.eager.context:Context.coordination_service",
        "tensorflow.python.eager.context:Context.set_config_key_value",
        "tensorflow.python.eager.context:Context.get_config_key_value",
        "tensorflow.python.eager.context:Context.wait_at_barrier",
        "tensorflow.python.distribute.collective_all_reduce_strategy:"
        "CollectiveAllReduceExtended._initialize_multi_worker",
        "tensorflow.python.distribute.collective_all_reduce_strategy:"
        "CollectiveAllReduceExtended._initialize_local_devices",
        "tensorflow.python.distribute.collective_all_reduce_strategy:"
        "CollectiveAllReduceExtended._in_multi_worker_mode",
        "tensorflow.python.distribute.collective_util:Options",
        "tensorflow.python.distribute.multi_worker_util:normalize_cluster_spec",
        "tensorflow.python.distribute.multi_worker_util:coordination_leader",
        "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2:CoordinatedJob",
        "tensorflow.python.data.ops.dataset_ops:DatasetV2._variant_tensor",
        "tensorflow.python.data.ops.dataset_ops:DatasetV2._as_serialized_graph",
        # tfdist.compat.datasets.FullEpochs implements this abstract method of tf.data.Dataset.
        "tensorflow.python.data.ops.dataset_ops:DatasetV2._inputs",
        "tensorflow.python.distribute.values:PerReplicaSpec._component_specs",
        "tensorflow.python.distribute.collective_all_reduce_strategy:"
        "CollectiveAllReduceExtended._experimental_distribute_dataset",
        "tensorflow.python.distribute.input_lib:DistributedDataset._make_rebatch_fn",
        "tensorflow.python.data.experimental.ops.distribute:_LegacyRebatchDataset",
        "tensorflow.python.distribute.input_lib:DistributedDataset."
        "_create_cloned_datasets_from_dataset",
    ],
    "keras": [
        "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._maybe_symbolic_build",
        "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._symbolic_build",
        "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._make_function",
        "keras.src.backend.tensorflow.trainer:reduce_per_replica",
        "keras.src.losses.loss:reduce_values",
        "keras.src.trainers.data_adapters.py_dataset_adapter:PyDatasetAdapter._finite_generator",
        "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.predict_on_batch",
        "keras.src.backend.tensorflow.optimizer:TFOptimizer._backend_apply_gradients",
        "keras.src.backend.tensorflow.optimizer:TFOptimizer._distributed_tf_update_step",
        "keras.src.tree:map_structure",
        "keras.src.tree:flatten",
        "keras.src.tree:pack_sequence_as",
        "keras.src.ops:cond",
        "keras.src.backend:Variable",
        "keras.src.callbacks.progbar_logger:ProgbarLogger.set_params",
        "keras.src.layers.layer:Layer._flatten_layers",
        "keras.src.optimizers.base_optimizer:BaseOptimizer._get_variable_index",
        "keras.src.optimizers.base_optimizer:BaseOptimizer._apply_weight_decay",
        "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer._tf_apply",
        "keras.src.optimizers.base_optimizer:BaseOptimizer._backend_update_step",
        "keras.src.optimizers.base_optimizer:BaseOptimizer._clip_gradients",
        "keras.src.optimizers.base_optimizer:BaseOptimizer._use_weight_decay",
        "keras.src.optimizers.base_optimizer:BaseOptimizer._update_model_variables_moving_average",
        "keras.src.optimizers.base_optimizer:"
        "BaseOptimizer._overwrite_model_variables_with_average_value",
        "keras.src.callbacks.model_checkpoint:ModelCheckpoint._should_save_on_batch",
        "keras.src.callbacks.model_checkpoint:ModelCheckpoint._get_file_path",
        "keras.src.callbacks.model_checkpoint:ModelCheckpoint._save_model",
    ],
}

# Private attributes that exist only on instances: "what: attribute" (the test builds
# each instance and checks the attribute).
INSTANCE_ATTRIBUTES = {
    "eager context": ["_context_handle", "_collective_leader", "_collective_ops_server_def"],
    "CollectiveAllReduceExtended": ["_communication_options"],
    "PerReplicaSpec": ["_component_specs"],
    "keras TFEpochIterator": ["_distributed_dataset"],
    "keras optimizer": ["_learning_rate", "_accumulated_gradients", "_trainable_variables"],
    "keras model": ["_distribute_strategy"],
    "keras layer": ["_seed_generators"],
}

# Private attributes that instances get in upstream's own code (``self.<name> = ...`` in
# the class or a base): the fixes' guards check them in the source (tfdist.compat.registry),
# since some exist only in a multi-worker job (the test checks them the same way).
SOURCE_ATTRIBUTES = [
    "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._distribute_strategy",
    "keras.src.backend.tensorflow.trainer:TFEpochIterator._distributed_dataset",
    "keras.src.optimizers.base_optimizer:BaseOptimizer._accumulated_gradients",
    "keras.src.optimizers.base_optimizer:BaseOptimizer._iterations",
    "keras.src.optimizers.base_optimizer:BaseOptimizer._trainable_variables",
    "tensorflow.python.distribute.collective_all_reduce_strategy:"
    "CollectiveAllReduceExtended._communication_options",
    "tensorflow.python.distribute.collective_all_reduce_strategy:"
    "CollectiveAllReduceExtended._std_server_started",
    "tensorflow.python.distribute.collective_all_reduce_strategy:"
    "CollectiveAllReduceExtended._num_workers",
    "tensorflow.python.eager.context:Context._collective_ops_server_def",
    "tensorflow.python.eager.context:Context._context_handle",
]

# ModelCheckpoint's hooks that tfdist's checkpoint callback overrides (no public hook
# exists for "save to this exact file at this exact step").
MODEL_CHECKPOINT_HOOKS = ("_should_save_on_batch", "_get_file_path", "_save_model")


def resolve(entry: str):
    """Imports ``"module:Attr.path"`` and returns the attribute (AttributeError if gone).

    Instance attributes set in ``__init__`` (``Context._context_handle``) are checked on
    a fresh object by the test; here a class-level lookup is tried first.

    Example:
        >>> resolve("keras.src.tree:map_structure")  # doctest: +SKIP
        <function map_structure at ...>
    """
    module_name, _, path = entry.partition(":")
    obj = importlib.import_module(module_name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- TensorFlow


def tf_context_class():
    """TensorFlow's eager ``Context`` class: tfdist wraps ``ensure_initialized`` to set
    the process up (devices, collectives) before the context exists."""
    from tensorflow.python.eager import context

    return context.Context


def tf_context():
    """The process's eager context (coordination service, key-value store, collectives)."""
    from tensorflow.python.eager import context

    return context.context()


def tf_context_initialized(ctx=None) -> bool:
    """Whether TensorFlow has created its context (after which devices are fixed).

    Reads ``Context._context_handle``: ``tf.executing_eagerly()`` and friends would
    create the context instead of telling whether it exists.
    """
    ctx = tf_context() if ctx is None else ctx
    return getattr(ctx, "_context_handle", None) is not None


def tf_collectives_configured(ctx=None) -> bool:
    """Whether some MultiWorkerMirroredStrategy already configured collective ops."""
    ctx = tf_context() if ctx is None else ctx
    return getattr(ctx, "_collective_leader", None) is not None


def tf_collective_extended_class():
    """``CollectiveAllReduceExtended``: its multi-worker and local-device set-up is where
    the timeouts and logical-CPU fixes hook in."""
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    return cars.CollectiveAllReduceExtended


def tf_extended_num_workers(extended) -> int:
    """How many workers a ``CollectiveAllReduceExtended`` spans (1 without a cluster)."""
    # No default: a renamed attribute must not silently read as "one worker" (the
    # auto-shard fix's guard checks it exists before the fix is applied).
    return int(extended._num_workers)


def tf_is_distributed_variable(value) -> bool:
    """Whether ``value`` is a Mirrored/SyncOnRead variable of a strategy."""
    from tensorflow.python.distribute import distribute_utils

    return distribute_utils.is_distributed_variable(value)


def tf_collective_options(**kwargs):
    """``collective_util.Options`` (the strategy's internal form of CommunicationOptions),
    needed to merge a timeout into options a strategy already holds."""
    from tensorflow.python.distribute import collective_util

    return collective_util.Options(**kwargs)


def tf_in_multi_worker_mode(strategy) -> bool:
    """Whether a MultiWorkerMirroredStrategy really spans several workers (a strategy
    built without a cluster is single-worker; only ``extended`` knows)."""
    import tensorflow as tf

    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


def tf_configure_coordination(cluster_resolver, *, register_ms, heartbeat_ms, shutdown_ms):
    """Configures TensorFlow's coordination service as upstream would, plus timeouts.

    Returns False (and changes nothing) when one is configured already or this task
    does not join it (evaluators). Upstream exposes no timeouts on this path.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util

    ctx = tf_context()
    if ctx.coordination_service is not None:
        return False
    if cluster_resolver.task_type not in ("chief", "worker"):
        return False
    spec = multi_worker_util.normalize_cluster_spec(cluster_resolver.cluster_spec())
    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
        for job in ("chief", "worker")
        if job in spec.jobs
    ]
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=register_ms,
        heartbeat_timeout_in_ms=heartbeat_ms,
        shutdown_barrier_timeout_in_ms=shutdown_ms,
    )
    # Registration then waits at a barrier, so the register timeout also bounds the wait
    # for a peer that never starts (without it, task 0 waits forever).
    ctx.coordination_service.cluster_register_with_barrier = True
    return True


def tf_key_value_set(key: str, value: str) -> None:
    """Publishes ``key=value`` in the coordination service's store (all workers see it)."""
    tf_context().set_config_key_value(key, value)


def tf_key_value_get(key: str, timeout_ms: int) -> str:
    """Waits up to ``timeout_ms`` for ``key`` in the coordination service's store.

    Raises ``tf.errors.DeadlineExceededError`` when it does not appear in time, and
    another ``tf.errors.OpError`` when the service is gone.
    """
    return tf_context().get_config_key_value(key, timeout_in_ms=timeout_ms)


def tf_per_replica_spec_class():
    """``PerReplicaSpec``: the element spec of a distributed dataset, one per replica."""
    from tensorflow.python.distribute.values import PerReplicaSpec

    return PerReplicaSpec


def tf_per_replica_component_spec(spec):
    """The spec of one replica's part of a ``PerReplicaSpec`` (all parts are alike)."""
    return spec._component_specs[0]


def tf_distributed_dataset(iterator):
    """The distributed dataset a Keras ``TFEpochIterator`` step iterator reads, or None."""
    return getattr(iterator, "_distributed_dataset", None)


def tf_dataset_variant(dataset):
    """A dataset's variant tensor, to wrap the same graph in a ``tf.data.Dataset``
    subclass that reports another cardinality."""
    return dataset._variant_tensor


def tf_dataset_inputs(dataset) -> list:
    """The datasets ``dataset`` reads from (empty for a source), to walk a pipeline back."""
    try:
        return list(dataset._inputs())
    except Exception:  # noqa: BLE001 - a dataset that cannot say: treat it as a source
        return []


def tf_dataset_graph_def(dataset, **kwargs):
    """A dataset's serialized graph: the only way to count the files it reads."""
    return dataset._as_serialized_graph(**kwargs)


def tf_legacy_rebatch(dataset, pieces: int):
    """``dataset`` with every batch cut into ``pieces`` slices of ``ceil(size / pieces)``:
    the rebatch tf.distribute itself uses when it cannot find a dataset's batch size (no
    public op cuts one batch into equal parts; its auto-sharding knows this one)."""
    from tensorflow.python.data.experimental.ops import distribute

    return distribute._LegacyRebatchDataset(dataset, pieces)


def tf_distributed_dataset_class():
    """``input_lib.DistributedDataset``: the even-split fix replaces its
    ``_make_rebatch_fn`` (how a global batch is cut into the replicas' batches)."""
    from tensorflow.python.distribute import input_lib

    return input_lib.DistributedDataset


# --------------------------------------------------------------------------- Keras


def keras_tf_trainer_module():
    """``keras.src.backend.tensorflow.trainer``: the symbolic-build and metric-reduction
    fixes replace ``TensorFlowTrainer._maybe_symbolic_build`` and ``reduce_per_replica``."""
    return importlib.import_module("keras.src.backend.tensorflow.trainer")


def keras_loss_module():
    """``keras.src.losses.loss``: the partial-batch fix replaces ``reduce_values``, where
    every Keras loss divides a replica's sum by its own count."""
    return importlib.import_module("keras.src.losses.loss")


def keras_model_class():
    """``keras.Model``'s class as Keras defines it (``keras.src.models.model.Model``):
    the user-save fix wraps its ``save`` and ``save_weights``."""
    return importlib.import_module("keras.src.models.model").Model


def keras_py_dataset_adapter_class():
    """Keras's adapter of a ``PyDataset``: the shuffle-agreement fix wraps its
    ``_finite_generator``, where an epoch's order is drawn (no public hook runs then)."""
    return importlib.import_module(
        "keras.src.trainers.data_adapters.py_dataset_adapter"
    ).PyDatasetAdapter


def keras_tf_optimizer_module():
    """``keras.src.backend.tensorflow.optimizer``: the gradient-accumulation fix."""
    return importlib.import_module("keras.src.backend.tensorflow.optimizer")


def keras_tree():
    """``keras.src.tree``: Keras's own nest utilities, as ``reduce_per_replica`` uses."""
    return importlib.import_module("keras.src.tree")


def keras_backend_variable_class():
    """``keras.src.backend.Variable``: unwrapped to its tf.Variable for strategy updates."""
    return importlib.import_module("keras.src.backend").Variable


def keras_ops():
    """``keras.src.ops`` as the optimizer code being fixed uses it."""
    return importlib.import_module("keras.src.ops")


def keras_progbar_logger_class():
    """``ProgbarLogger``: made silent on non-chief workers."""
    return importlib.import_module("keras.src.callbacks.progbar_logger").ProgbarLogger


def keras_seed_generators(model) -> list:
    """Every ``SeedGenerator`` of a model's layers (dropout, random augmentation), whose
    states a checkpoint must hold for an exact resume. Keras saves none of them."""
    generators = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        generators.extend(getattr(layer, "_seed_generators", ()))
    return generators


def keras_optimizer_learning_rate(optimizer):
    """The optimizer's learning rate as configured: a float variable or a schedule object
    (``optimizer.learning_rate`` evaluates a schedule instead of returning it)."""
    return optimizer._learning_rate


def keras_model_strategy_or_none(model):
    """The strategy a Keras model was built under, or None (``model.distribute_strategy``
    falls back to the default strategy and cannot tell)."""
    return model._distribute_strategy


def keras_symbolic_build(model, data_batch) -> None:
    """Builds a model, its metrics and loss from a (symbolic) batch, as ``fit`` does."""
    model._symbolic_build(data_batch=data_batch)


def keras_optimizer_accumulators(optimizer, variables) -> list:
    """The gradient accumulators of ``variables``, in order."""
    return [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables]


def keras_optimizer_all_accumulators(optimizer) -> list:
    """Every gradient accumulator of ``optimizer`` (empty before it is built)."""
    return list(getattr(optimizer, "_accumulated_gradients", None) or [])


def keras_optimizer_apply_weight_decay(optimizer, variables) -> None:
    """Upstream's weight decay of ``variables`` before an update (``weight_decay``)."""
    optimizer._apply_weight_decay(variables)


def keras_optimizer_update_step(optimizer, grads, variables) -> None:
    """Upstream's update of every variable (the backend's, strategy-aware on TensorFlow)."""
    optimizer._backend_update_step(grads, variables, optimizer.learning_rate)


def keras_loss_scale_optimizer_class():
    """``LossScaleOptimizer``: its ``check_finite`` decides whether a step is skipped."""
    return importlib.import_module("keras.src.optimizers.loss_scale_optimizer").LossScaleOptimizer


def keras_base_optimizer_class():
    """``BaseOptimizer``: its ``_backend_apply_gradients`` holds the EMA overwrite's cond."""
    return importlib.import_module("keras.src.optimizers.base_optimizer").BaseOptimizer


def keras_optimizer_micro_steps(optimizer):
    """``optimizer._iterations``: every ``apply`` call, accumulating or not (the public
    ``iterations`` counts real updates when ``gradient_accumulation_steps`` is set)."""
    return optimizer._iterations


def keras_optimizer_clip(optimizer, grads) -> list:
    """Gradients clipped by the optimizer's ``clipnorm``/``clipvalue``/``global_clipnorm``."""
    return optimizer._clip_gradients(grads)


def keras_optimizer_uses_weight_decay(optimizer, variable) -> bool:
    """Whether weight decay applies to ``variable`` (``exclude_from_weight_decay``)."""
    return optimizer._use_weight_decay(variable)


def keras_optimizer_distributed_update(optimizer, distribution, grads_and_vars, lr) -> None:
    """The TensorFlow optimizer's update of every variable under a strategy."""
    optimizer._distributed_tf_update_step(distribution, grads_and_vars, lr)


def keras_optimizer_ema_step(optimizer) -> None:
    """Upstream's moving average of the weights after an update, if ``use_ema``; under a
    strategy, in replica context, the periodic overwrite runs in cross-replica context
    (``keras_optimizer_ema_overwrite``): upstream's ``ops.cond`` around it fails there."""
    if not optimizer.use_ema:
        return
    optimizer._update_model_variables_moving_average(optimizer._trainable_variables)
    if optimizer.ema_overwrite_frequency:
        keras_optimizer_ema_overwrite(optimizer)


def keras_optimizer_ema_overwrite(optimizer) -> None:
    """Every ``ema_overwrite_frequency`` updates, the weights take their moving average.

    Upstream computes the same condition and calls the same overwrite inside ``ops.cond``.
    In replica context under a tf.distribute strategy, assigning mirrored variables needs
    a ``merge_call``, which is not allowed inside a cond branch; so there the cond runs
    in one ``merge_call``, in cross-replica context, where the assignments update every
    replica's copy with the same (mirrored) average.
    """
    import tensorflow as tf

    def overwrite():
        should = (optimizer.iterations + 1) % optimizer.ema_overwrite_frequency == 0
        keras_ops().cond(
            should,
            lambda: optimizer._overwrite_model_variables_with_average_value(
                optimizer._trainable_variables
            ),
            lambda: None,
        )

    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context() is False:
        tf.distribute.get_replica_context().merge_call(lambda _strategy: overwrite())
    else:
        overwrite()


def tf_communication_options(extended):
    """The ``collective_util.Options`` a collective strategy's ``extended`` holds."""
    return extended._communication_options


def tf_set_communication_options(extended, options) -> None:
    """Replaces them (to merge tfdist's collective timeout in before initialisation)."""
    extended._communication_options = options


def tf_collectives_enabled(ctx=None) -> bool:
    """Whether this process's collective ops (and their gRPC server) are running."""
    ctx = tf_context() if ctx is None else ctx
    return tf_context_initialized(ctx) and ctx._collective_ops_server_def is not None


def tf_mark_server_started(extended) -> None:
    """Tells a collective strategy that the process's gRPC server already runs, so it
    shares it instead of starting a second one on the same port."""
    extended._std_server_started = True


def keras_jax_distribution_lib():
    """``keras.src.backend.jax.distribution_lib``: ``initialize`` (jax's multi-process
    start) and ``initialize_rng`` (a seed agreed across processes) live there."""
    return importlib.import_module("keras.src.backend.jax.distribution_lib")


def keras_trainer_class():
    """``keras.src.trainers.trainer.Trainer``: every model's ``__init__`` runs through it."""
    return importlib.import_module("keras.src.trainers.trainer").Trainer


def keras_distribution_class():
    """``keras.src.distribution.distribution_lib.Distribution``: the base of ``DataParallel``
    and ``ModelParallel``; its ``distribute_tf_dataset`` shards a dataset per process."""
    return importlib.import_module("keras.src.distribution.distribution_lib").Distribution


def keras_jax_trainer_class():
    """``JAXTrainer``: ``fit``/``evaluate``/``predict`` of every model on the JAX backend."""
    return importlib.import_module("keras.src.backend.jax.trainer").JAXTrainer


def keras_jax_epoch_iterator_class():
    """``JAXEpochIterator``: feeds ``fit``'s batches to the devices on the JAX backend."""
    return importlib.import_module("keras.src.backend.jax.trainer").JAXEpochIterator


def tf_wait_at_barrier(name: str, timeout_ms: int) -> None:
    """Waits until every worker of the job reaches barrier ``name`` (coordination service).

    Raises ``tf.errors.DeadlineExceededError`` naming the tasks that did not arrive.
    """
    tf_context().wait_at_barrier(name, timeout_ms)


def jax_wait_at_barrier(name: str, timeout_ms: int) -> None:
    """The same through jax's distributed client (``sync_global_devices`` has no timeout)."""
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(name, timeout_ms)


def jax_key_value_set(key: str, value: str) -> None:
    """Publishes ``key=value`` in jax's coordination service store (every process sees it).

    Raises jax's runtime error (``ALREADY_EXISTS`` in its message) when ``key`` is set.
    """
    from jax._src import distributed

    distributed.global_state.client.key_value_set(key, value)


def jax_key_value_get(key: str, timeout_ms: int) -> str:
    """Waits up to ``timeout_ms`` for ``key`` in jax's coordination service store.

    Raises jax's runtime error (``DEADLINE_EXCEEDED`` in its message) when it does not
    appear in time, another one when the service is gone.
    """
    from jax._src import distributed

    return distributed.global_state.client.blocking_key_value_get(key, timeout_ms)


# The store of jax's distributed runtime (preemption agreement under JAX).
__all__ += ["jax_key_value_set", "jax_key_value_get"]
REQUIRED["jax"] += [
    "jax._src.lib:_jax.DistributedRuntimeClient.key_value_set",
    "jax._src.lib:_jax.DistributedRuntimeClient.blocking_key_value_get",
]


# ======================================== section: chief-only writes of Keras callbacks
# (tfdist.compat.chief_writes) ModelCheckpoint and BackupAndRestore keep their file names,
# decisions and positions in private methods and attributes; no public hook says "where
# and whether this save goes" or "what this backup records".

_CALLBACKS = "keras.src.callbacks."


def keras_checkpoint_file_path(callback, epoch: int, batch, logs) -> str:
    """The file a ``ModelCheckpoint`` save goes to: its ``filepath`` formatted with the
    epoch, batch and logs, by upstream's own code (the name every worker must agree on)."""
    return callback._get_file_path(epoch, batch, logs)


def keras_checkpoint_should_save(callback, epoch: int, batch, logs, filepath: str) -> bool:
    """``ModelCheckpoint``'s decision to save now (``save_best_only``: it also updates
    ``best`` and prints what it decided), by upstream's own code."""
    return bool(callback._should_save_model(epoch, batch, logs, filepath))


def keras_backup_paths(callback) -> tuple[str, str, str, str]:
    """``BackupAndRestore``'s files: weights, training metadata and their ``.bkp`` copies
    (``double_checkpoint``), as upstream derived them from ``backup_dir``."""
    return (
        callback._weights_path,
        callback._training_metadata_path,
        callback._prev_weights_path,
        callback._prev_training_metadata_path,
    )


def keras_backup_position(callback) -> dict:
    """What ``BackupAndRestore`` records with a backup: the epoch to resume at and the
    last batch seen (upstream's ``training_metadata.json``)."""
    return {"epoch": callback._current_epoch, "batch": callback._last_batch_seen}


def keras_backup_load(callback) -> None:
    """``BackupAndRestore``'s restore (weights, optimizer state, the epoch ``fit`` starts
    at), by upstream's own code; raises ``OSError`` for an unreadable weights file."""
    callback._load_model()


def keras_set_initial_epoch(model, epoch: int) -> None:
    """The epoch ``fit`` starts at, set as ``BackupAndRestore`` sets it after a restore
    (``fit`` reads it after ``on_train_begin``; there is no public setter)."""
    model._initial_epoch = int(epoch)


__all__ += [
    "keras_checkpoint_file_path",
    "keras_checkpoint_should_save",
    "keras_backup_paths",
    "keras_backup_position",
    "keras_backup_load",
    "keras_set_initial_epoch",
]
REQUIRED["keras"] += [
    _CALLBACKS + "model_checkpoint:ModelCheckpoint._should_save_model",
    _CALLBACKS + "backup_and_restore:BackupAndRestore._save_model",
    _CALLBACKS + "backup_and_restore:BackupAndRestore._load_model",
]
SOURCE_ATTRIBUTES += [
    _CALLBACKS + "backup_and_restore:BackupAndRestore._weights_path",
    _CALLBACKS + "backup_and_restore:BackupAndRestore._training_metadata_path",
    _CALLBACKS + "backup_and_restore:BackupAndRestore._prev_weights_path",
    _CALLBACKS + "backup_and_restore:BackupAndRestore._prev_training_metadata_path",
    _CALLBACKS + "backup_and_restore:BackupAndRestore._current_epoch",
    _CALLBACKS + "backup_and_restore:BackupAndRestore._last_batch_seen",
    "keras.src.trainers.trainer:Trainer._initial_epoch",
]
# ======================================== end of section: chief-only writes


# ======================================== section: clipping the global gradient
# (tfdist.compat.clipping) Keras clips in its optimizer's private apply path, before the
# private cross-replica update; the fix reorders those steps under a strategy, so it names
# the upstream steps it replaces and the TensorFlow helper Keras uses for its merge_call.

_KERAS_OPTIMIZERS = "keras.src.optimizers."


def tf_maybe_merge_call(fn, strategy, *args) -> None:
    """``fn(strategy, *args)`` through ``merge_call``, or directly where the strategy runs
    without one (XLA on GPUs): how Keras' own TensorFlow optimizer reaches cross-replica
    context for its update, so the fix behaves alike under either mode."""
    from tensorflow.python.distribute import merge_call_interim

    merge_call_interim.maybe_merge_call(fn, strategy, *args)


__all__ += ["tf_maybe_merge_call"]
REQUIRED["tensorflow"] += [
    "tensorflow.python.distribute.merge_call_interim:maybe_merge_call",
]
REQUIRED["keras"] += [
    _KERAS_OPTIMIZERS + "optimizer:Optimizer._backend_apply_gradients",
    _KERAS_OPTIMIZERS + "base_optimizer:BaseOptimizer._backend_apply_gradients",
    "keras.src.backend.tensorflow.optimizer:TFOptimizer._backend_update_step",
    "keras.src.backend.tensorflow.optimizer:TFOptimizer._apply_weight_decay",
    _KERAS_OPTIMIZERS + "loss_scale_optimizer:LossScaleOptimizer._stateful_handle_finite_grads",
]
# ======================================== end of section: clipping the global gradient


# ======================================== section: numpy, PyDataset and generator inputs on JAX
# (tfdist.compat.jax_inputs) Keras picks an input's adapter in a private module function
# (the one place that refuses non-tf.data inputs in a multi-process job); the adapters
# themselves are private classes with no public import path.

_DATA_ADAPTERS = "keras.src.trainers.data_adapters"


def keras_data_adapters_module():
    """``keras.src.trainers.data_adapters``: ``get_data_adapter`` (which adapter an input
    gets, and the multi-process refusal) and ``is_tf_dataset`` live there; every epoch
    iterator calls ``get_data_adapter`` through the module."""
    return importlib.import_module(_DATA_ADAPTERS)


def keras_data_adapter_class():
    """``DataAdapter``: the base of Keras's input adapters (an ``x`` that is one already
    is used as given)."""
    return importlib.import_module(_DATA_ADAPTERS + ".data_adapter").DataAdapter


def keras_shareable_adapter_classes() -> tuple:
    """The adapters of numpy-like arrays, ``PyDataset`` and Python generators: each yields
    whole global batches from ``get_jax_iterator``, which a process can cut its share from."""
    module = keras_data_adapters_module()
    return (module.ArrayDataAdapter, module.PyDatasetAdapter, module.GeneratorDataAdapter)


__all__ += [
    "keras_data_adapters_module",
    "keras_data_adapter_class",
    "keras_shareable_adapter_classes",
]
REQUIRED["keras"] += [
    _DATA_ADAPTERS + ":get_data_adapter",
    _DATA_ADAPTERS + ":is_tf_dataset",
    _DATA_ADAPTERS + ":ArrayDataAdapter.get_jax_iterator",
    _DATA_ADAPTERS + ":PyDatasetAdapter.get_jax_iterator",
    _DATA_ADAPTERS + ":GeneratorDataAdapter.get_jax_iterator",
    _DATA_ADAPTERS + ".data_adapter:DataAdapter",
]
# What the fix relies on (tfdist.compat.jax_inputs's targets): where a shuffled epoch
# draws its order, that on_epoch_begin precedes each epoch's iterator, and that Keras
# assembles the global batch from each process's part.
REQUIRED["keras"] += [
    _DATA_ADAPTERS + ".array_data_adapter:ArrayDataAdapter._get_iterator",
    _DATA_ADAPTERS + ".py_dataset_adapter:PyDatasetAdapter._finite_generator",
    "keras.src.trainers.epoch_iterator:EpochIterator._enumerate_iterator",
]
REQUIRED["jax"] += [
    "keras.src.backend.jax.trainer:JAXTrainer.make_predict_function",
]
SOURCE_ATTRIBUTES += [
    _DATA_ADAPTERS + ".py_dataset_adapter:PyDatasetAdapter.enqueuer",
]
# What keras_tf_generator_batches_copied wraps (tfdist.compat.tf_inputs): the function
# from_generator iterates for a PyDataset, and the generator adapter's batch source.
REQUIRED["keras"] += [
    _DATA_ADAPTERS + ".py_dataset_adapter:PyDatasetAdapter._get_iterator",
    _DATA_ADAPTERS + ".generator_data_adapter:GeneratorDataAdapter.get_tf_dataset",
]
SOURCE_ATTRIBUTES += [
    _DATA_ADAPTERS + ".generator_data_adapter:GeneratorDataAdapter.generator",
]
# ======================================== end of section: numpy, PyDataset and generator inputs


# ======================================== section: the JAX watchdog
# (tfdist.watchdog) Each process of a multi-process JAX job publishes how far it got in
# jax's coordination store, overwriting its previous entry, and reads its peers' entries
# without waiting; jax's public API exposes neither (only a blocking get of a new key).


def jax_key_value_put(key: str, value: str) -> None:
    """Sets ``key=value`` in jax's coordination store, replacing an earlier value."""
    from jax._src import distributed

    distributed.global_state.client.key_value_set(key, value, allow_overwrite=True)


def jax_key_value_try_get(key: str) -> str | None:
    """``key``'s value in jax's coordination store now, or None when it is not set.

    Raises jax's runtime error when the coordination service does not answer.
    """
    from jax._src import distributed

    try:
        return distributed.global_state.client.key_value_try_get(key)
    except Exception as err:  # noqa: BLE001 - jax's one error type; "NOT_FOUND" is no error
        if "NOT_FOUND" in str(err):
            return None
        raise


__all__ += ["jax_key_value_put", "jax_key_value_try_get"]
REQUIRED["jax"] += [
    "jax._src.lib:_jax.DistributedRuntimeClient.key_value_try_get",
]
# ======================================== end of section: the JAX watchdog
