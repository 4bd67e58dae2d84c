"""``compile(jit_compile=True)`` under a tf.distribute strategy: a clear error before the
first step instead of a graph-execution traceback.

Keras's TensorFlow trainer XLA-compiles the function that calls ``strategy.run``, so XLA
places the whole distributed step (every replica's pass, the all-reduce, the update) on
one device: on 2 devices ``Trying to access resource .../replica_1 located in device
CPU:1 from device CPU:0`` (keras#19005), on 2 workers ``Collectives are not yet
implemented for CPU devices``, both deep in a traceback after the data pipeline started.
``predict`` compiles each replica's step alone and works, so it is left as it is.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "KERAS_TF_JIT_COMPILE_REFUSED_UNDER_STRATEGY",
    "FIXES",
    "keras_tf_jit_compile_refused_under_strategy",
    "model_replicas",
]

# The fixes' names, declared once (other layers import them).
KERAS_TF_JIT_COMPILE_REFUSED_UNDER_STRATEGY = "keras_tf_jit_compile_refused_under_strategy"


def model_replicas(model) -> int:
    """Replicas of the strategy ``model`` was built under (1 without one)."""
    strategy = upstream.keras_model_strategy_or_none(model)
    return 1 if strategy is None else int(strategy.num_replicas_in_sync)


def keras_tf_jit_compile_refused_under_strategy() -> None:
    """Refuses ``jit_compile=True`` for ``fit``/``evaluate`` on several replicas, naming
    ``jit_compile=False``, when Keras builds the step function (before the first step).

    Upstream's ``_make_function`` wraps the function that calls ``strategy.run`` in
    ``tf.function(jit_compile=True)``: XLA then owns the whole distributed step and puts
    it on one device, which cannot reach the other replicas' variables (or, across
    workers, run CPU collectives), so the first step fails inside the graph after the
    input pipeline and the workers have started. Refusing it where Keras builds that
    function turns this into one error, raised on every worker at the same point, that
    says what to pass instead. With one replica, ``run_eagerly=True``, or
    ``jit_compile`` False or ``"auto"`` (which Keras resolves to False under a
    strategy), upstream's function is built unchanged; ``predict`` builds its function
    elsewhere (each replica's step alone) and is not touched.
    """

    def make(original):
        def _make_function(self, step_function):
            replicas = model_replicas(self)
            if self.jit_compile is True and not self.run_eagerly and replicas > 1:
                strategy = type(upstream.keras_model_strategy_or_none(self)).__name__
                raise ValueError(
                    f"tfdist: compile(jit_compile=True) cannot train or evaluate under "
                    f"{strategy} with {replicas} replicas: Keras XLA-compiles the whole "
                    "distributed step (every replica's pass, the all-reduce and the "
                    "update) onto one device, which fails (keras#19005; on CPU workers "
                    "'Collectives are not yet implemented'). Compile with "
                    "jit_compile=False, or 'auto' (Keras's default, which turns XLA off "
                    "under a strategy); predict works with jit_compile=True. Received: "
                    f"jit_compile=True, strategy={strategy}, replicas={replicas}."
                )
            return original(self, step_function)

        return _make_function

    patch(
        upstream.keras_tf_trainer_module().TensorFlowTrainer,
        "_make_function",
        KERAS_TF_JIT_COMPILE_REFUSED_UNDER_STRATEGY,
        make,
    )


FIXES = [
    Fix(
        KERAS_TF_JIT_COMPILE_REFUSED_UNDER_STRATEGY,
        "Keras 3 compile(jit_compile=True) under a tf.distribute strategy with several "
        "replicas: fit/evaluate fail after start-up with a graph-execution error",
        on_keras_backend("tensorflow"),
        keras_tf_jit_compile_refused_under_strategy,
        targets=targets(
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._make_function",
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._distribute_strategy (instance)",
        ),
        acts_where=(
            "fit/evaluate and `*_on_batch` with jit_compile=True, not run_eagerly, on a model "
            "built under a strategy with >1 replica (raises); otherwise upstream's"
        ),
        no_harm=(),  # none yet
        upstream_issue="https://github.com/keras-team/keras/issues/19005",
    ),
]
