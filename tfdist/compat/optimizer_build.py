"""A custom loop's optimizer built on its first ``apply_gradients`` inside ``strategy.run``.

TensorFlow's "Custom training with tf.distribute.Strategy" guide creates the optimizer in
``strategy.scope()`` and lets its first ``apply_gradients`` (inside ``strategy.run``,
inside a ``tf.function``) build it. With Keras 3 optimizers on 2 or more replicas the
first step then fails: Keras's lazy ``build`` creates the slot variables while the step
is being traced in a replica context, ``tf.function`` has to guard their initializers
with a ``cond`` it cannot feed, and the step ends in ``You must feed a value for
placeholder tensor 'cond/else/_1/cond/Placeholder'`` (Adam and SGD with momentum alike;
plain ``MirroredStrategy`` and Keras, without tfdist). Calling
``optimizer.build(model.trainable_variables)`` in the scope first works, and ``fit``
builds it that way.

``keras_tf_optimizer_built_across_replicas`` does what that call does, at the moment
Keras would build: the first ``apply`` in the replica context of a strategy with several
replicas builds the optimizer once, in the cross-replica context (``merge_call``), in the
strategy's scope, outside the function being traced (``tf.init_scope``). The variables are
then the ones an explicit ``build`` makes, and training equals one device's.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "KERAS_TF_OPTIMIZER_BUILT_ACROSS_REPLICAS",
    "FIXES",
    "keras_tf_optimizer_built_across_replicas",
]

KERAS_TF_OPTIMIZER_BUILT_ACROSS_REPLICAS = "keras_tf_optimizer_built_across_replicas"


def _replica_context_of_several():
    """The replica context of a strategy with more than one replica, or None."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()  # None in the cross-replica context
    if context is None or context.num_replicas_in_sync < 2:
        return None
    return context


def keras_tf_optimizer_built_across_replicas() -> None:
    """Builds an unbuilt optimizer in the cross-replica context before its first ``apply``
    on several replicas.

    Upstream's ``BaseOptimizer.apply`` builds on the first call that passes the variables,
    wherever that call is: inside ``strategy.run`` in a ``tf.function`` the slot variables
    are created while the replica step is traced and the first step fails to run (a
    placeholder of ``tf.function``'s initialization ``cond``). The fix builds them as an
    explicit ``optimizer.build(variables)`` in the strategy's scope would: in a
    ``merge_call``, in ``strategy.scope()``, under ``tf.init_scope()``. A built optimizer,
    a call without variables, one replica, and the cross-replica context keep upstream's
    path; ``fit`` builds its optimizer before the step and never reaches the fix.
    """

    def make(original):
        def apply(self, grads, trainable_variables=None):
            context = None if self.built else _replica_context_of_several()
            if context is not None and trainable_variables is not None:
                trainable_variables = list(trainable_variables)
                variables = trainable_variables
                context.merge_call(lambda strategy: _build_in_scope(strategy, self, variables))
            return original(self, grads, trainable_variables)

        return apply

    patch(
        upstream.keras_tf_optimizer_module().TFOptimizer,
        "apply",
        KERAS_TF_OPTIMIZER_BUILT_ACROSS_REPLICAS,
        make,
    )


def _build_in_scope(strategy, optimizer, variables) -> None:
    import tensorflow as tf

    if optimizer.built:  # another replica's merge_call came first (a strategy's threads)
        return
    with tf.init_scope(), strategy.scope():
        optimizer.build(variables)
    optimizer.built = True


_KB = "keras.src.optimizers.base_optimizer:BaseOptimizer."

FIXES = [
    Fix(
        KERAS_TF_OPTIMIZER_BUILT_ACROSS_REPLICAS,
        "Keras 3 optimizers built by their first apply_gradients inside strategy.run (the "
        "tf.distribute custom-loop guide) on several replicas: the first step fails with "
        "'You must feed a value for placeholder tensor'",
        on_keras_backend("tensorflow"),
        keras_tf_optimizer_built_across_replicas,
        targets=targets(
            _KB + "apply",
            _KB + "build",
            "keras.src.backend.tensorflow.optimizer:TFOptimizer",
        ),
        acts_where=(
            "the first apply/apply_gradients of an unbuilt optimizer, with its variables, in "
            "the replica context of a strategy with >1 replica (a custom loop); fit, a built "
            "optimizer, one replica: upstream's path"
        ),
        no_harm=(
            "tests/compat/test_optimizer_build.py::test_a_loop_whose_optimizer_builds_itself_equals_one_device",
        ),
    ),
]
