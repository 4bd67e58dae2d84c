"""Every private TensorFlow, Keras, jax and Orbax name tfdist touches, behind one named helper each.

Upstream has no public way to do these things; each helper says why tfdist needs it.
``tests/core/test_private.py`` checks that every name still exists in the installed versions,
so an upgrade that moves one fails that test, naming the helper, instead of breaking
training somewhere else. Nothing outside this package spells a private upstream name: the helpers live in
``tensorflow``, ``keras`` and ``jax`` and are all re-exported here, so callers
write ``upstream.<helper>``.

Heavy imports happen inside the helpers: importing this package is free.

Example:
    >>> from tfdist.core import upstream
    >>> "keras.src.tree:flatten" in upstream.REQUIRED["keras"]
    True
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from tfdist.core.upstream import jax as jax_names
from tfdist.core.upstream import keras as keras_names
from tfdist.core.upstream import tensorflow as tf_names
from tfdist.core.upstream.jax import (  # noqa: F401 - re-exported, in __all__
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
from tfdist.core.upstream.keras import (  # noqa: F401 - re-exported, in __all__
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
    keras_unpack_x_y_sample_weight,
    keras_warm_save_skipsets,
)
from tfdist.core.upstream.tensorflow import (  # noqa: F401 - re-exported, in __all__
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
    tf_distributed_delegate_class,
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
_DATA_ADAPTERS = "keras.src.trainers.data_adapters"


__all__ = [
    "REQUIRED",
    "OTHER_USES",
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
    "tf_distributed_delegate_class",
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
    "keras_unpack_x_y_sample_weight",
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


# The private names tfdist uses besides the fixes' targets, with who uses them. The targets
# (of tfdist.compat.FIXES and of the hooks applied the same way) are the entries of
# fingerprints.json, which tools/fix_fingerprints.py writes from them and prunes.
OTHER_USES = [
    # sharded checkpoints in a bucket (tfdist.checkpoint.remote_orbax; epath_tf_check_cache_clear)
    "etils.epath.gpath:_is_tf_installed",
    "orbax.checkpoint._src.path.gcs_utils:get_kvstore_for_gcs",
    "orbax.checkpoint._src.serialization.tensorstore_utils:_normalize_path",
    "orbax.checkpoint._src.serialization.tensorstore_utils:_use_gcs_driver",
    # jax's coordination store (preemption agreement, the JAX watchdog)
    "jax._src.lib:_jax.DistributedRuntimeClient.blocking_key_value_get",
    # TensorFlow's coordination service: key-value store and barriers
    "tensorflow.python.eager.context:Context.get_config_key_value",
    "tensorflow.python.eager.context:Context.set_config_key_value",
    "tensorflow.python.eager.context:Context.wait_at_barrier",
    # a process default strategy (tf_process_default_scope, for tfdist.unscoped)
    "tensorflow.python.framework.ops:Graph._global_distribute_strategy_scope",
    # where a cross-replica reduction may be issued (tf_can_reduce_across_replicas_here)
    "tensorflow.python.distribute.mirrored_run:_MirroredReplicaThread",
    # a tf.data batch's size (tf_dataset_batching, for tfdist.core.batch_order)
    "tensorflow.python.data.experimental.ops.distribute:compute_batch_size",
    # Keras's saves, its global state, a model's seed generators (upstream/keras.py)
    "keras.src.saving.saving_lib:get_attr_skipset",
    "keras.src.backend.common.global_state:get_global_attribute",
    "keras.src.layers.layer:Layer._flatten_layers",
    # the adapters tfdist.compat.inputs.jax shares between processes on JAX
    "keras.src.trainers.data_adapters:ArrayDataAdapter.get_jax_iterator",
    "keras.src.trainers.data_adapters:GeneratorDataAdapter.get_jax_iterator",
    "keras.src.trainers.data_adapters:PyDatasetAdapter.get_jax_iterator",
]

# The file of the fixes' targets (tfdist.core.fix_registry reads it too).
TARGETS_FILE = Path(__file__).resolve().parents[1] / "fingerprints.json"
# The package a name belongs to -> its group in REQUIRED.
_GROUPS = {
    "tensorflow": "tensorflow",
    "keras": "keras",
    "jax": "jax",
    "orbax": "jax",
    "etils": "jax",
}


# "module:attribute.path" of every private name tfdist uses, per package (tested): derived,
# OTHER_USES and the fixes' targets (jax's group holds orbax and etils).
REQUIRED: dict[str, list[str]] = {"tensorflow": [], "keras": [], "jax": []}
for _entry in sorted(set(json.loads(TARGETS_FILE.read_text())) | set(OTHER_USES)):
    REQUIRED[_GROUPS[_entry.split(".", 1)[0]]].append(_entry)


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


# ======================================== section: chief-only writes of Keras callbacks
# (tfdist.compat.chief_checkpoints) ModelCheckpoint and BackupAndRestore keep their file names,
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


# ======================================== end of section: clipping the global gradient


# ======================================== section: numpy, PyDataset and generator inputs on JAX
# (tfdist.compat.inputs.jax) Keras picks an input's adapter in a private module function
# (the one place that refuses non-tf.data inputs in a multi-process job); the adapters
# themselves are private classes with no public import path.


__all__ += [
    "keras_data_adapters_module",
    "keras_data_adapter_class",
    "keras_shareable_adapter_classes",
]


SOURCE_ATTRIBUTES += [
    _DATA_ADAPTERS + ".py_dataset_adapter:PyDatasetAdapter.enqueuer",
]
SOURCE_ATTRIBUTES += [
    _DATA_ADAPTERS + ".py_dataset_adapter:OrderedEnqueuer.future_queue",
    _DATA_ADAPTERS + ".py_dataset_adapter:OrderedEnqueuer.shuffle",
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


# The modules that define the helpers (tests/core/test_private.py checks each is exported).
HELPER_MODULES = (jax_names, keras_names, tf_names)
