"""``compile`` called outside the model's strategy scope (a second compile, the TensorFlow
guide's layout): the training state it makes belongs to the model's strategy.

Keras 3's ``Trainer.compile`` makes the loss tracker (``metrics.Mean(name="loss")``, whose
``result()`` is the ``loss`` of History and of ``evaluate``) and a string-named optimizer
in whatever scope it is called from. A model built in ``with tfdist.scope():`` and compiled
again after it (the transfer-learning recompile), or compiled outside it (as the
TensorFlow guide writes it, which tf-keras allowed: its ``compile`` entered the model's
strategy scope itself) gets a tracker of plain variables. Under MultiWorkerMirroredStrategy
each worker's copy sums its own replicas only, and Keras takes the epoch's ``loss`` from the
tracker: every worker's History and ``evaluate`` report its own loss (2 workers: 58.93 and
58.01 where one device gives their mean 58.47) while the weights agree. Callbacks that read
it (``EarlyStopping``, ``ReduceLROnPlateau``, ``save_best_only``) then decide differently
on different workers. The same state made in the scope is correct: the fix makes it there.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import functools

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["FIXES", "KERAS_TF_COMPILE_IN_MODEL_SCOPE", "keras_tf_compile_in_model_scope"]

KERAS_TF_COMPILE_IN_MODEL_SCOPE = "keras_tf_compile_in_model_scope"


def keras_tf_compile_in_model_scope() -> None:
    """Runs ``compile`` in the scope of the strategy the model was built under, when it is
    called outside any strategy scope.

    Upstream ``Trainer.compile`` creates ``self._loss_tracker`` (and the optimizer, when
    it is named by a string) in the scope it is called from. Outside the model's scope
    the tracker's variables are plain ``tf.Variable``s, not the on-read variables that
    sum every replica of every worker; at the end of each epoch and of ``evaluate`` Keras
    reports ``get_metrics_result()`` read from them (``_get_metrics_result_or_logs``):
    under MultiWorkerMirroredStrategy, each worker's own loss. In one process the
    replicas share the one plain variable, so the loss is whole there, but the named
    optimizer is made outside the scope: ``"adam"`` fails ("Mixing different
    tf.distribute.Strategy objects") and an ``"sgd"`` counts each replica's step in
    ``iterations``. Entering the model's scope first makes compile create exactly what
    ``compile`` written inside ``with scope():`` creates (the documented layout, and what
    tf-keras's ``compile`` did itself); nothing else of compile changes. Objects the
    user made outside the scope before calling compile (an optimizer or metric instance)
    are not remade. Without a model strategy, or inside any strategy's scope, upstream's
    compile runs as it is.
    """
    import tensorflow as tf

    def make(original):
        @functools.wraps(original)
        def compile(self, *args, **kwargs):
            strategy = upstream.keras_model_strategy_or_none(self)
            if strategy is None or tf.distribute.has_strategy():
                return original(self, *args, **kwargs)
            with strategy.scope():
                return original(self, *args, **kwargs)

        return compile

    # Trainer.compile itself, not an override on TensorFlowTrainer: Keras's loading skips
    # compile_from_config when ``cls.compile != Trainer.compile`` ("compile() was not
    # called as part of model loading"), which an override would make every model fail.
    patch(upstream.keras_trainer_class(), "compile", KERAS_TF_COMPILE_IN_MODEL_SCOPE, make)


FIXES = [
    Fix(
        KERAS_TF_COMPILE_IN_MODEL_SCOPE,
        "Keras 3 compile() outside the model's strategy scope (a second compile, or the "
        "TensorFlow guide's layout) under MultiWorkerMirroredStrategy: History's and "
        "evaluate's loss is each worker's own, not the global mean; under MirroredStrategy "
        "optimizer='adam' fails ('Mixing different tf.distribute.Strategy objects')",
        on_keras_backend("tensorflow"),
        keras_tf_compile_in_model_scope,
        targets=targets(
            "keras.src.trainers.trainer:Trainer.compile",
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._distribute_strategy (instance)",
        ),
        acts_where=(
            "compile() outside any strategy scope of a model built under a tf.distribute "
            "strategy; inside a scope, no model strategy: upstream's compile"
        ),
        no_harm=(),  # none yet
    ),
]
