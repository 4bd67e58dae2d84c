"""The private Keras names tfdist uses, one helper each (listed in ``tfdist.core.upstream``)."""

from __future__ import annotations

import importlib

_DATA_ADAPTERS = "keras.src.trainers.data_adapters"


def keras_tf_trainer_module():
    """``keras.src.backend.tensorflow.trainer``: the symbolic-build and metric-reduction
    fixes replace ``TensorFlowTrainer._maybe_symbolic_build`` and ``reduce_per_replica``."""
    return importlib.import_module("keras.src.backend.tensorflow.trainer")


def keras_loss_module():
    """``keras.src.losses.loss``: the partial-batch fix replaces ``reduce_weighted_values``,
    where every Keras loss divides a replica's sum by its own count."""
    return importlib.import_module("keras.src.losses.loss")


def keras_model_class():
    """``keras.Model``'s class as Keras defines it (``keras.src.models.model.Model``):
    the user-save fix wraps its ``save`` and ``save_weights``."""
    return importlib.import_module("keras.src.models.model").Model


def keras_save_model_modules():
    """``keras.src.saving.saving_api`` (where ``Model.save`` finds ``save_model``) and the
    public ``keras.saving`` module that re-exports it: the user-save fix wraps both, so a
    script's ``keras.saving.save_model(model, path)`` is routed like ``model.save``."""
    import keras

    return [importlib.import_module("keras.src.saving.saving_api"), keras.saving]


# The reference objects Keras's saving builds once per process (``get_attr_skipset``).
_SAVE_SKIPSET_TYPES = ("Operation", "Layer", "Functional", "Sequential", "Metric", "Optimizer")


def keras_warm_save_skipsets() -> None:
    """Builds the reference objects Keras's saving builds in every save
    (``saving_lib.get_attr_skipset``) in a thread of their own, and caches them as
    upstream meant to.

    Its ``Optimizer(1.0)`` creates variables under the calling thread's
    ``keras.distribution`` or ``tf.distribute`` scope: on several JAX processes that is a
    cross-process ``device_put`` (a collective), so a process saving alone, as
    ``if rank == 0: model.save(p)`` does, waits in it for the others. Upstream caches each
    set under ``saving_attr_skipset_<type>`` but looks it up under
    ``saving_attr_skiplist_<type>`` (Keras 3.15.1), so it builds the objects on every
    save. Here they are built once, in a new thread (Keras's global state and TF's
    strategy scopes are per thread: no distribution, no scope), and stored where upstream
    looks: the sets of attribute names are the ones upstream computes.
    """
    import threading

    saving_lib = importlib.import_module("keras.src.saving.saving_lib")
    global_state = importlib.import_module("keras.src.backend.common.global_state")
    if all(
        global_state.get_global_attribute(f"saving_attr_skiplist_{name}") is not None
        for name in _SAVE_SKIPSET_TYPES
    ):
        return
    built: dict = {}

    def build() -> None:
        for name in _SAVE_SKIPSET_TYPES:
            built[name] = saving_lib.get_attr_skipset(name)

    thread = threading.Thread(target=build, name="tfdist-save-skipsets")
    thread.start()
    thread.join()
    for name, skipset in built.items():
        global_state.set_global_attribute(f"saving_attr_skiplist_{name}", skipset)


def keras_ordered_enqueuer_class():
    """Keras's ``OrderedEnqueuer``, which feeds a ``PyDataset`` with ``workers > 1`` or
    ``use_multiprocessing``: it draws each epoch's order in ``_run``, its own thread."""
    return importlib.import_module(
        "keras.src.trainers.data_adapters.py_dataset_adapter"
    ).OrderedEnqueuer


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


def keras_unpack_x_y_sample_weight(data) -> tuple:
    """``(x, y, sample_weight)`` of a step's ``data``, as Keras's own steps unpack it."""
    return importlib.import_module(_DATA_ADAPTERS + ".data_adapter_utils").unpack_x_y_sample_weight(
        data
    )


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
    generators: list = []
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


def keras_array_data_adapter_class():
    """Keras's ``ArrayDataAdapter`` (numpy, jax and tf tensors, pandas): its batch size
    and partial last batch are known before the first step."""
    return importlib.import_module(
        "keras.src.trainers.data_adapters.array_data_adapter"
    ).ArrayDataAdapter


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


def keras_layer_class():
    """Keras's ``Layer``: ``tfdist.unscoped`` wraps its ``__init__``, the first thing a
    script's model does, to give a model built outside any scope the job's strategy."""
    from keras.src.layers.layer import Layer

    return Layer


def keras_tf_optimizer_class():
    """Keras's TensorFlow optimizer base: it binds the strategy current at construction."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def keras_sum_added_loss(model, loss):
    """Keras's own sum of an added loss, without the TensorFlow trainer's division by the
    replicas (``Trainer._aggregate_additional_loss``; tfdist.compat.added_losses)."""
    from keras.src.trainers.trainer import Trainer

    return Trainer._aggregate_additional_loss(model, loss)
