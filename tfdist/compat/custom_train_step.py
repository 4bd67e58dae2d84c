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
   losses divide that mean by N under a strategy (``scale_loss_for_distribution``)
   before the optimizer sums the replicas' gradients, and a loss written with
   ``ops.mean`` (the VAE example's) is not divided: every update is N times one
   device's. The Keras loss objects' values the step logs (the GAN's and the
   distiller's) are 1/N of one device's. ``keras_tf_custom_train_step_averages_gradients``
   makes one rule inside ``fit`` of a model whose class overrides ``train_step``, on a
   strategy of more than one replica: no loss is scaled (``scale_loss_for_distribution``
   and ``unscale_loss_for_distribution`` return their value), and ``optimizer.apply``
   divides the gradients by N. Each replica's loss is then its own mean, as it logs it,
   and the update is the mean of the replicas' gradients, as one device's.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import collections

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


def _has_no_call(model) -> bool:
    import keras

    return type(model).call is keras.Model.call


def _has_own_train_step(model) -> bool:
    trainer = upstream.keras_tf_trainer_module().TensorFlowTrainer
    return type(model).train_step is not trainer.train_step


def _has_own_test_step(model) -> bool:
    trainer = upstream.keras_tf_trainer_module().TensorFlowTrainer
    return type(model).test_step is not trainer.test_step


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
    """Averages the replicas' gradients of a user's train_step, whose losses stay unscaled.

    Upstream divides a Keras loss by N on N replicas (``scale_loss_for_distribution``: its
    own ``train_step``, a Keras loss object, ``compute_loss``) and sums the replicas'
    gradients in ``optimizer.apply``. A user's step that averages with ``ops.mean`` then
    takes N times one device's update, and one that logs a Keras loss object's value logs
    1/N of one device's. Inside ``fit`` of a model whose class overrides ``train_step``,
    on more than one replica, the fix scales no loss (and unscales none: a step that
    calls ``super().train_step`` tracks the replica's own mean) and divides every
    ``apply``'s gradients by N. ``evaluate`` of a model whose class overrides
    ``test_step`` scales no loss either, so it reports one device's. Keras's own steps,
    custom loops and one replica run upstream's code unchanged.
    """
    trainer = upstream.keras_tf_trainer_module().TensorFlowTrainer
    patch(trainer, "fit", KERAS_TF_CUSTOM_TRAIN_STEP_AVERAGES_GRADIENTS, _noting_custom_fits)
    patch(
        trainer,
        "evaluate",
        KERAS_TF_CUSTOM_TRAIN_STEP_AVERAGES_GRADIENTS,
        lambda original: _noting_custom_fits(original, _has_own_test_step),
    )
    loss_module = upstream.keras_loss_module()
    for name in ("scale_loss_for_distribution", "unscale_loss_for_distribution"):
        patch(loss_module, name, KERAS_TF_CUSTOM_TRAIN_STEP_AVERAGES_GRADIENTS, _unscaled)
    # TFOptimizer.apply, where keras_tf_optimizer_built_across_replicas wraps it too
    # (Keras's optimizers reach BaseOptimizer.apply through it).
    optimizer = upstream.keras_tf_optimizer_module().TFOptimizer
    patch(optimizer, "apply", KERAS_TF_CUSTOM_TRAIN_STEP_AVERAGES_GRADIENTS, _averaging_apply)


def _noting_custom_fits(original, own=_has_own_train_step):
    """``fit`` (of a model whose class overrides ``train_step``) or ``evaluate`` (``own``:
    one that overrides ``test_step``) noted for the replica threads while it runs."""

    def fit(self, *args, **kwargs):
        if not own(self):
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


def _unscaled(original):
    def scale(value):
        if _replicas_of_a_custom_fit() > 1:
            return value  # the replica's own mean: apply averages its gradients
        return original(value)

    return scale


def _averaging_apply(original):
    def apply(self, grads, trainable_variables=None):
        replicas = _replicas_of_a_custom_fit()
        if replicas > 1:
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
        "Keras 3 fit under a strategy of a model with its own train_step: an ops.mean loss "
        "takes N times one device's update, a Keras loss object logs 1/N of its value",
        on_keras_backend("tensorflow"),
        keras_tf_custom_train_step_averages_gradients,
        targets=targets(
            _TRAINER + "fit",
            _TRAINER + "train_step",
            _TRAINER + "evaluate",
            _TRAINER + "test_step",
            "keras.src.losses.loss:scale_loss_for_distribution",
            "keras.src.losses.loss:unscale_loss_for_distribution",
            "keras.src.optimizers.base_optimizer:BaseOptimizer.apply",
        ),
        acts_where=(
            "fit (evaluate) of a model with its own train_step (test_step) on >1 replica: "
            "losses unscaled, gradients averaged; Keras's steps, custom loops: upstream's"
        ),
        no_harm=(
            "tests/compat/test_custom_train_step.py::test_examples_own_train_steps_equal_one_device",
        ),
    ),
]
