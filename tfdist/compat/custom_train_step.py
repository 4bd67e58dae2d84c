"""Models with their own ``train_step`` (the Keras examples' VAE and GAN) under a strategy.

Two upstream defects stop these models from training as one device does on N replicas:

1. A ``keras.Model`` subclass with its own ``train_step`` and no ``call()`` cannot be
   built by ``fit`` under a strategy: Keras builds a model symbolically there (only
   there: without a strategy it defers to the step) by calling it, and ``call`` is not
   implemented, so ``fit`` fails with "Unable to automatically build the model".
   ``keras_tf_fit_builds_models_without_call`` skips that symbolic build for such a model,
   as one device does; its step builds what it uses (an unbuilt optimizer is built
   across the replicas by ``keras_tf_optimizer_built_across_replicas``).
2. A ``train_step`` of the user's own computes its loss as one device would, a mean over
   its batch, which on N replicas is each replica's own part of the batch. Keras's own
   losses divide a mean by N under a strategy (``scale_loss_for_distribution``) before
   the optimizer sums the replicas' gradients; a loss written with ``ops.mean`` (the VAE
   example's) is not divided, so every update is N times one device's.
   ``keras_tf_custom_train_step_averages_gradients`` divides the gradients of such a step
   by N at ``optimizer.apply``: only inside ``fit`` of a model whose class overrides
   ``train_step``, on a strategy of more than one replica, and only when no loss of that
   replica's step went through Keras's scaling since the last ``apply`` (a step that
   calls ``self.compute_loss`` or a Keras loss object is left as upstream computes it).

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import collections
import threading

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "FIXES",
    "KERAS_TF_FIT_BUILDS_MODELS_WITHOUT_CALL",
    "KERAS_TF_CUSTOM_TRAIN_STEP_AVERAGES_GRADIENTS",
]

KERAS_TF_FIT_BUILDS_MODELS_WITHOUT_CALL = "keras_tf_fit_builds_models_without_call"
KERAS_TF_CUSTOM_TRAIN_STEP_AVERAGES_GRADIENTS = "keras_tf_custom_train_step_averages_gradients"

# Strategies (by id) whose fit trains a model with its own train_step now: the replica
# threads of MirroredStrategy do not see the fit's context, so they look here.
_CUSTOM_FITS: collections.Counter[int] = collections.Counter()
# Per replica thread: whether a loss went through Keras's scaling since the last apply.
_SCALED = threading.local()


def _has_no_call(model) -> bool:
    import keras

    return type(model).call is keras.Model.call


def _has_own_train_step(model) -> bool:
    trainer = upstream.keras_tf_trainer_module().TensorFlowTrainer
    return type(model).train_step is not trainer.train_step


def keras_tf_fit_builds_models_without_call() -> None:
    """Skips fit's symbolic build for a model that has no ``call`` of its own.

    Upstream's ``_maybe_symbolic_build`` returns at once without a strategy (the step
    builds what it uses) and under one calls ``_symbolic_build``, which calls the model:
    for a model without ``call`` that raises ``NotImplementedError``, reported as "Unable
    to automatically build the model". The fix makes ``_symbolic_build`` of such a model
    do what the no-strategy path does: nothing. Its optimizers are built by their first
    ``apply`` (``keras_tf_optimizer_built_across_replicas`` builds them across the
    replicas). Every model with a ``call`` is built as upstream builds it.
    """

    def make(original):
        def _symbolic_build(self, *args, **kwargs):
            if _has_no_call(self):
                return None  # as without a strategy: the step builds what it uses
            return original(self, *args, **kwargs)

        return _symbolic_build

    trainer = upstream.keras_tf_trainer_module().TensorFlowTrainer
    patch(trainer, "_symbolic_build", KERAS_TF_FIT_BUILDS_MODELS_WITHOUT_CALL, make)


def keras_tf_custom_train_step_averages_gradients() -> None:
    """Divides by N the gradients of a user's train_step whose loss Keras did not scale.

    Upstream sums the replicas' gradients in ``optimizer.apply``, which is right for a loss
    Keras divided by N (``scale_loss_for_distribution``: its own ``train_step``, a Keras
    loss object, ``compute_loss``) and N times one device's update for a loss the user
    averaged over the replica's batch alone (``ops.mean``). The fix notes, per replica
    thread, whether a loss was scaled since the last ``apply``; inside ``fit`` of a model
    whose class overrides ``train_step``, on more than one replica, an ``apply`` after an
    unscaled loss gets its gradients divided by N first. Elsewhere upstream's ``apply``
    runs as it is.
    """
    trainer = upstream.keras_tf_trainer_module().TensorFlowTrainer
    patch(trainer, "fit", KERAS_TF_CUSTOM_TRAIN_STEP_AVERAGES_GRADIENTS, _noting_custom_fits)
    patch(
        upstream.keras_loss_module(),
        "scale_loss_for_distribution",
        KERAS_TF_CUSTOM_TRAIN_STEP_AVERAGES_GRADIENTS,
        _noting_scale,
    )
    # TFOptimizer.apply, where keras_tf_optimizer_built_across_replicas wraps it too
    # (Keras's optimizers reach BaseOptimizer.apply through it).
    optimizer = upstream.keras_tf_optimizer_module().TFOptimizer
    patch(optimizer, "apply", KERAS_TF_CUSTOM_TRAIN_STEP_AVERAGES_GRADIENTS, _averaging_apply)


def _noting_custom_fits(original):
    def fit(self, *args, **kwargs):
        if not _has_own_train_step(self):
            return original(self, *args, **kwargs)
        key = id(self.distribute_strategy)
        _CUSTOM_FITS[key] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _CUSTOM_FITS[key] -= 1
            if not _CUSTOM_FITS[key]:
                del _CUSTOM_FITS[key]

    return fit


def _noting_scale(original):
    def scale_loss_for_distribution(value):
        _SCALED.done = True
        return original(value)

    return scale_loss_for_distribution


def _averaging_apply(original):
    def apply(self, grads, trainable_variables=None):
        scaled, _SCALED.done = getattr(_SCALED, "done", False), False
        replicas = _replicas_of_a_custom_fit()
        if replicas > 1 and not scaled:
            grads = [_divided(g, replicas) for g in grads]
        return original(self, grads, trainable_variables)

    return apply


def _replicas_of_a_custom_fit() -> int:
    """N in the replica context of a custom-train_step fit's strategy, else 1."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or id(context.strategy) not in _CUSTOM_FITS:
        return 1
    return int(context.num_replicas_in_sync)


def _divided(gradient, replicas: int):
    import tensorflow as tf

    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values / tf.cast(replicas, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient / tf.cast(replicas, gradient.dtype)


_TRAINER = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer."

FIXES = [
    Fix(
        KERAS_TF_FIT_BUILDS_MODELS_WITHOUT_CALL,
        "Keras 3 fit under a tf.distribute strategy of a Model subclass with its own "
        "train_step and no call() (the Keras examples' VAE, GAN): 'Unable to automatically "
        "build the model'",
        on_keras_backend("tensorflow"),
        keras_tf_fit_builds_models_without_call,
        targets=targets(_TRAINER + "_symbolic_build", "keras.src.models.model:Model.call"),
        acts_where=(
            "fit, evaluate and predict of a model whose class has no call() of its own, under "
            "a strategy; every other model: upstream's symbolic build"
        ),
        no_harm=(
            "tests/compat/test_custom_train_step.py::test_examples_own_train_steps_equal_one_device",
        ),
    ),
    Fix(
        KERAS_TF_CUSTOM_TRAIN_STEP_AVERAGES_GRADIENTS,
        "Keras 3 fit under a tf.distribute strategy of a model with its own train_step whose "
        "loss is a plain mean (the VAE example's ops.mean): the replicas' gradients are "
        "summed, so every update is N times one device's",
        on_keras_backend("tensorflow"),
        keras_tf_custom_train_step_averages_gradients,
        targets=targets(
            _TRAINER + "fit",
            _TRAINER + "train_step",
            "keras.src.losses.loss:scale_loss_for_distribution",
            "keras.src.optimizers.base_optimizer:BaseOptimizer.apply",
        ),
        acts_where=(
            "optimizer.apply in fit of a model with its own train_step, on >1 replica, when no "
            "loss of the step was scaled by Keras; Keras's train_step, custom loops: upstream's"
        ),
        no_harm=(
            "tests/compat/test_custom_train_step.py::test_examples_own_train_steps_equal_one_device",
        ),
    ),
]
