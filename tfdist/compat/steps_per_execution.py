"""``compile(steps_per_execution=K)`` under a tf.distribute strategy with several replicas:
K steps per call, as on one device.

Keras's TensorFlow trainer runs K steps in one ``tf.function``: a ``tf.while_loop`` whose
body calls ``strategy.run`` inside a ``tf.cond`` (run this step only if the iterator still
has data). On several replicas (MirroredStrategy on 2 devices, MultiWorkerMirroredStrategy
on 2 workers) the first ``fit`` or ``evaluate`` fails: ``You must feed a value for
placeholder tensor 'while/body/.../while/cond/Placeholder'`` (keras#19246): ``strategy.run``
cannot be traced inside a conditional branch. ``predict`` builds its K steps elsewhere (no
conditional) and works.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

from tfdist.compat.jit_compile import model_replicas
from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "FIXES",
    "KERAS_TF_STEPS_PER_EXECUTION_UNDER_STRATEGY",
    "keras_tf_steps_per_execution_under_strategy",
    "take",
]

KERAS_TF_STEPS_PER_EXECUTION_UNDER_STRATEGY = "keras_tf_steps_per_execution_under_strategy"


def take(iterator, count: int) -> list:
    """Up to ``count`` next elements of ``iterator`` (fewer where it runs out).

    Example:
        >>> take(iter([1, 2, 3]), 2)
        [1, 2]
        >>> take(iter([1]), 4)
        [1]
    """
    import tensorflow as tf

    elements = []
    for _ in range(count):
        try:
            elements.append(next(iterator))
        except (StopIteration, tf.errors.OutOfRangeError):
            break
    return elements


def _is_iterator(value) -> bool:
    import tensorflow as tf

    return isinstance(value, (tf.data.Iterator, tf.distribute.DistributedIterator))


def keras_tf_steps_per_execution_under_strategy() -> None:
    """Runs the K steps of one execution in one ``tf.function`` with no conditional.

    Upstream's function, given an iterator, traces ``strategy.run`` inside a ``tf.cond``
    (keras#19246); given a list of batches, it calls its one-step function on each, in
    order, and returns the last step's outputs. The fix takes up to K batches from the
    distributed iterator (fewer at the end of the data: each is a whole global batch,
    exactly what upstream's loop would have consumed) and hands that list to upstream's
    own function for the last one, traced once per list length in a ``tf.function``: the
    K steps run in one call with K ``strategy.run`` and no conditional. Only the last
    step's logs are reduced across replicas, since Keras returns only those for K > 1
    (upstream reduces every step's and drops all but the last: between workers, one
    gRPC collective per step). The steps, their order, the logs (the last step's) and
    the ``StopIteration`` when no batch is left are upstream's;
    the epoch loop and the callbacks (once per execution) are not touched. With one
    replica, K == 1, ``run_eagerly=True`` or input that is not an iterator, upstream's
    function is returned unchanged.
    """

    def make(original):
        def _make_function(self, step_function):
            function = original(self, step_function)
            if self.run_eagerly or model_replicas(self) <= 1:
                return function
            import tensorflow as tf

            strategy = self.distribute_strategy

            def run_steps(batches):
                # Keras returns the last step's logs only: the steps before it run without
                # reducing theirs across replicas (one collective fewer per step).
                for data in batches[:-1]:
                    strategy.run(step_function, args=(data,))
                return function(batches[-1:])

            fused = tf.function(run_steps, reduce_retracing=True)

            def multi_step_on_iterator(iterator):
                steps = int(self.steps_per_execution or 1)  # read per call, as upstream does
                if steps <= 1 or not _is_iterator(iterator):
                    return function(iterator)
                batches = take(iterator, steps)
                if not batches:
                    raise StopIteration
                return fused(batches)

            return multi_step_on_iterator

        return _make_function

    patch(
        upstream.keras_tf_trainer_module().TensorFlowTrainer,
        "_make_function",
        KERAS_TF_STEPS_PER_EXECUTION_UNDER_STRATEGY,
        make,
    )


FIXES = [
    Fix(
        KERAS_TF_STEPS_PER_EXECUTION_UNDER_STRATEGY,
        "Keras 3 compile(steps_per_execution>1) under Mirrored/MultiWorkerMirroredStrategy "
        "with several replicas: fit/evaluate fail with 'You must feed a value for "
        "placeholder tensor ... while/cond/Placeholder' (keras#19246)",
        on_keras_backend("tensorflow"),
        keras_tf_steps_per_execution_under_strategy,
        targets=targets(
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._make_function",
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._distribute_strategy (instance)",
        ),
        acts_where=(
            "fit/evaluate with steps_per_execution > 1, not run_eagerly, of a model built "
            "under a strategy with >1 replica; K = 1, one replica: upstream's function"
        ),
        no_harm=(),  # none yet
        upstream_issue="https://github.com/keras-team/keras/issues/19246",
    ),
]
