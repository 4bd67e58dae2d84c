"""Every private TensorFlow, Keras, jax and Orbax name tfdist touches, behind one named helper each.

Upstream has no public way to do these things; each helper says why tfdist needs it.
``tests/core/test_private.py`` checks that every name still exists in the installed versions,
so an upgrade that moves one fails that test, naming the helper, instead of breaking
training somewhere else. Nothing outside this package spells a private upstream name: the helpers live in
``tf_names``, ``keras_names`` and ``jax_names`` and are all re-exported here, so callers
write ``upstream.<helper>``.

Heavy imports happen inside the helpers: importing this package is free.

Example:
    >>> from tfdist.core import upstream
    >>> upstream.REQUIRED["tensorflow"][0]
    'tensorflow.python.eager.context:Context.ensure_initialized'
"""

from __future__ import annotations

import importlib

from tfdist.core.upstream import jax_names, keras_names, tf_names
from tfdist.core.upstream.jax_names import (  # noqa: F401 - re-exported, in __all__
    epath_tf_check_cache_clear,
    jax_distributed_client,
    jax_key_value_get,
    jax_key_value_put,
    jax_key_value_set,
    jax_key_value_try_get,
    jax_wait_at_barrier,
    orbax_gcs_utils,
    orbax_tensorstore_utils,
)
from tfdist.core.upstream.keras_names import (  # noqa: F401 - re-exported, in __all__
    keras_array_data_adapter_class,
    keras_backend_variable_class,
    keras_backup_load,
    keras_backup_paths,
    keras_backup_position,
    keras_base_optimizer_class,
    keras_checkpoint_file_path,
    keras_checkpoint_should_save,
    keras_data_adapter_class,
    keras_data_adapters_module,
    keras_distribution_class,
    keras_jax_distribution_lib,
    keras_jax_epoch_iterator_class,
    keras_jax_trainer_class,
    keras_layer_class,
    keras_loss_module,
    keras_loss_scale_optimizer_class,
    keras_model_class,
    keras_model_strategy_or_none,
    keras_ops,
    keras_optimizer_accumulators,
    keras_optimizer_all_accumulators,
    keras_optimizer_apply_weight_decay,
    keras_optimizer_clip,
    keras_optimizer_distributed_update,
    keras_optimizer_ema_overwrite,
    keras_optimizer_ema_step,
    keras_optimizer_learning_rate,
    keras_optimizer_micro_steps,
    keras_optimizer_update_step,
    keras_optimizer_uses_weight_decay,
    keras_ordered_enqueuer_class,
    keras_progbar_logger_class,
    keras_py_dataset_adapter_class,
    keras_save_model_modules,
    keras_seed_generators,
    keras_set_initial_epoch,
    keras_shareable_adapter_classes,
    keras_sum_added_loss,
    keras_symbolic_build,
    keras_tf_optimizer_class,
    keras_tf_optimizer_module,
    keras_tf_trainer_module,
    keras_trainer_class,
    keras_tree,
    keras_warm_save_skipsets,
)
from tfdist.core.upstream.tf_names import (  # noqa: F401 - re-exported, in __all__
    tf_can_reduce_across_replicas_here,
    tf_check_peer_health,
    tf_collective_extended_class,
    tf_collective_key_base,
    tf_collective_options,
    tf_collectives_configured,
    tf_collectives_enabled,
    tf_communication_options,
    tf_configure_coordination,
    tf_context,
    tf_context_class,
    tf_context_initialized,
    tf_dataset_batching,
    tf_dataset_graph_def,
    tf_dataset_inputs,
    tf_dataset_variant,
    tf_distribute_lib,
    tf_distributed_dataset,
    tf_distributed_dataset_class,
    tf_extended_num_workers,
    tf_in_multi_worker_mode,
    tf_is_distributed_variable,
    tf_key_value_get,
    tf_key_value_set,
    tf_mark_server_started,
    tf_maybe_merge_call,
    tf_mirrored_extended_class,
    tf_multi_device_iterator_module,
    tf_per_replica_component_spec,
    tf_per_replica_spec_class,
    tf_process_default_scope,
    tf_set_collective_key_base,
    tf_set_communication_options,
    tf_static_batch_size,
    tf_wait_at_barrier,
)

# Module prefixes of the private names below.
_CALLBACKS = "keras.src.callbacks."
_KERAS_OPTIMIZERS = "keras.src.optimizers."
_DATA_ADAPTERS = "keras.src.trainers.data_adapters"


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
    "tf_dataset_batching",
    "tf_dataset_graph_def",
    "tf_dataset_inputs",
    "keras_tf_trainer_module",
    "keras_loss_module",
    "keras_model_class",
    "keras_ordered_enqueuer_class",
    "keras_py_dataset_adapter_class",
    "keras_save_model_modules",
    "keras_warm_save_skipsets",
    "tf_distributed_dataset_class",
    "tf_multi_device_iterator_module",
    "tf_static_batch_size",
    "keras_tf_optimizer_module",
    "keras_tree",
    "keras_array_data_adapter_class",
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
    "tf_check_peer_health",
    "jax_wait_at_barrier",
    "orbax_tensorstore_utils",
    "orbax_gcs_utils",
    "epath_tf_check_cache_clear",
    "jax_distributed_client",
    "keras_trainer_class",
    "keras_jax_trainer_class",
    "keras_distribution_class",
    "keras_layer_class",
    "keras_sum_added_loss",
    "keras_tf_optimizer_class",
    "tf_distribute_lib",
    "tf_process_default_scope",
    "tf_mirrored_extended_class",
    "tf_collective_key_base",
    "tf_set_collective_key_base",
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
        "CollectiveAllReduceExtended._initialize_strategy",
        "tensorflow.python.distribute.collective_all_reduce_strategy:"
        "CollectiveAllReduceExtended._in_multi_worker_mode",
        "tensorflow.python.distribute.collective_util:Options",
        "tensorflow.python.distribute.multi_worker_util:normalize_cluster_spec",
        "tensorflow.python.distribute.multi_worker_util:coordination_leader",
        "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2:CoordinatedJob",
        "tensorflow.python.data.ops.dataset_ops:DatasetV2._variant_tensor",
        "tensorflow.python.data.ops.dataset_ops:DatasetV2._as_serialized_graph",
        # tfdist.core.full_epochs.FullEpochs implements this abstract method of tf.data.Dataset.
        "tensorflow.python.data.ops.dataset_ops:DatasetV2._inputs",
        "tensorflow.python.distribute.values:PerReplicaSpec._component_specs",
        "tensorflow.python.distribute.collective_all_reduce_strategy:"
        "CollectiveAllReduceExtended._experimental_distribute_dataset",
        "tensorflow.python.distribute.input_lib:DistributedDataset._make_rebatch_fn",
        "tensorflow.python.data.experimental.ops.distribute:compute_batch_size",
        "tensorflow.python.distribute.input_lib:DistributedDataset."
        "_create_cloned_datasets_from_dataset",
        # tf_multi_device_iterators_end_promptly (tfdist.compat.epoch_start)
        "tensorflow.python.data.ops.multi_device_iterator_ops:OwnedMultiDeviceIterator.__init__",
        "tensorflow.python.data.ops.multi_device_iterator_ops:_create_device_dataset",
        # tfdist.unscoped: the process default strategy, and a script's own strategy beside it
        "tensorflow.python.distribute.distribute_lib:"
        "_require_cross_replica_or_default_context_extended",
        "tensorflow.python.distribute.distribute_lib:StrategyBase.scope",
        "tensorflow.python.framework.ops:Graph._global_distribute_strategy_scope",
        # tf_mirrored_collective_keys_apart (tfdist.compat.collective_keys)
        "tensorflow.python.distribute.mirrored_strategy:"
        "MirroredExtended._make_collective_ops_with_fallbacks",
    ],
    "keras": [
        "keras.src.saving.saving_api:save_model",
        "keras.src.saving.saving_lib:get_attr_skipset",
        "keras.src.backend.common.global_state:get_global_attribute",
        "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._maybe_symbolic_build",
        "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._symbolic_build",
        "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._make_function",
        "keras.src.backend.tensorflow.trainer:reduce_per_replica",
        "keras.src.losses.loss:reduce_weighted_values",
        "keras.src.losses.loss:apply_mask",
        "keras.src.losses.loss:standardize_reduction",
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
        "keras.src.callbacks.model_checkpoint:ModelCheckpoint._get_file_path",
        "keras.src.callbacks.model_checkpoint:ModelCheckpoint._save_model",
        "keras.src.layers.layer:Layer.__init__",
        # keras_tf_added_loss_scaled_once (tfdist.compat.added_losses)
        "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._aggregate_additional_loss",
        "keras.src.trainers.trainer:Trainer._aggregate_additional_loss",
        "keras.src.backend.tensorflow.optimizer:TFOptimizer.__init__",
    ],
}


# Private attributes that exist only on instances: "what: attribute" (the test builds
# each instance and checks the attribute).
INSTANCE_ATTRIBUTES = {
    "eager context": ["_context_handle", "_collective_leader", "_collective_ops_server_def"],
    "CollectiveAllReduceExtended": ["_communication_options"],
    "PerReplicaSpec": ["_component_specs"],
    "keras TFEpochIterator": ["_distributed_dataset"],
    "tf.data batch": ["_batch_size", "_drop_remainder"],
    "keras optimizer": ["_learning_rate", "_accumulated_gradients", "_trainable_variables"],
    "keras model": ["_distribute_strategy"],
    "keras layer": ["_seed_generators"],
}


# Private attributes that instances get in upstream's own code (``self.<name> = ...`` in
# the class or a base): the fixes' guards check them in the source (tfdist.core.fix_registry),
# since some exist only in a multi-worker job (the test checks them the same way).
SOURCE_ATTRIBUTES = [
    "tensorflow.python.distribute.mirrored_strategy:MirroredExtended._collective_key_base",
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


# --------------------------------------------------------------------------- Keras


# The store of jax's distributed runtime (preemption agreement under JAX).
__all__ += ["jax_key_value_set", "jax_key_value_get"]

REQUIRED["jax"] += [
    # Sharded checkpoints in an s3:// bucket (tfdist.checkpoint.remote_orbax).
    "orbax.checkpoint._src.serialization.tensorstore_utils:_normalize_path",
    "orbax.checkpoint._src.serialization.tensorstore_utils:_use_gcs_driver",
    "orbax.checkpoint._src.path.gcs_utils:get_kvstore_for_gcs",
    "etils.epath.gpath:_is_tf_installed",
    "jax._src.lib:_jax.DistributedRuntimeClient.key_value_set",
    "jax._src.lib:_jax.DistributedRuntimeClient.blocking_key_value_get",
]


# ======================================== section: chief-only writes of Keras callbacks
# (tfdist.compat.chief_writes) ModelCheckpoint and BackupAndRestore keep their file names,
# decisions and positions in private methods and attributes; no public hook says "where
# and whether this save goes" or "what this backup records".


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


__all__ += ["tf_maybe_merge_call", "tf_can_reduce_across_replicas_here"]

REQUIRED["tensorflow"] += [
    "tensorflow.python.distribute.merge_call_interim:maybe_merge_call",
    "tensorflow.python.distribute.mirrored_run:_MirroredReplicaThread",
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
# keras_tf_workers_agree_shuffle (tfdist.compat.tf_inputs): where a PyDataset fed by an
# enqueuer draws its order, and where that thread reports an error.
REQUIRED["keras"] += [
    _DATA_ADAPTERS + ".py_dataset_adapter:OrderedEnqueuer._run",
    "keras.src.backend.tensorflow.trainer:TFEpochIterator.__init__",
]
SOURCE_ATTRIBUTES += [
    _DATA_ADAPTERS + ".py_dataset_adapter:OrderedEnqueuer.future_queue",
    _DATA_ADAPTERS + ".py_dataset_adapter:OrderedEnqueuer.shuffle",
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
# (tfdist.core.watchdog) Each process of a multi-process JAX job publishes how far it got in
# jax's coordination store, overwriting its previous entry, and reads its peers' entries
# without waiting; jax's public API exposes neither (only a blocking get of a new key).


__all__ += ["jax_key_value_put", "jax_key_value_try_get"]

REQUIRED["jax"] += [
    "jax._src.lib:_jax.DistributedRuntimeClient.key_value_try_get",
]

# The modules that define the helpers (tests/core/test_private.py checks each is exported).
HELPER_MODULES = (jax_names, keras_names, tf_names)
