"""``predict_on_batch`` under a tf.distribute strategy with several replicas.

Every private Keras name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["KERAS_TF_PREDICT_ON_BATCH_COPIES", "FIXES", "keras_tf_predict_on_batch_copies"]

# The fixes' names, declared once (other layers import them).
KERAS_TF_PREDICT_ON_BATCH_COPIES = "keras_tf_predict_on_batch_copies"


def _rows(x) -> int | None:
    """The batch size of ``x`` (its first array's leading dimension), or None."""
    leaves = upstream.keras_tree().flatten(x)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    return int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else None


def _first_copy(outputs, rows: int, copies: int):
    """Each output's first ``rows`` rows, where it holds ``copies`` copies of the batch."""
    tree = upstream.keras_tree()

    def first(value):
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) and shape[0] == rows * copies:
            return value[:rows]
        return value

    return tree.map_structure(first, outputs)


def keras_tf_predict_on_batch_copies() -> None:
    """Returns one prediction per example from ``predict_on_batch`` under a strategy.

    Upstream ``TensorFlowTrainer.predict_on_batch`` hands the whole batch to
    ``strategy.run`` without distributing it, so every replica (of every worker) predicts
    the whole batch, and the ``concat`` reduction then stacks those copies: with 2
    replicas, 16 inputs give 32 predictions (the 16 twice), silently, where one device
    gives 16. ``train_on_batch`` and ``test_on_batch`` are right as they are (each
    replica's loss is scaled by the replica count, so the summed gradient and the mean
    metrics equal one device's). The fix keeps upstream's call and returns the first copy:
    every replica computed it from the same weights and the same batch, so it is exactly
    what one device returns. Without a strategy, with one replica, or when an output
    does not hold ``replicas`` copies of the batch, upstream's result is returned as is.
    """

    def make(original):
        def predict_on_batch(self, x):
            outputs = original(self, x)
            strategy = upstream.keras_model_strategy_or_none(self)
            copies = getattr(strategy, "num_replicas_in_sync", 1) if strategy else 1
            rows = _rows(x)
            if copies <= 1 or rows is None:
                return outputs
            return _first_copy(outputs, rows, copies)

        return predict_on_batch

    patch(
        upstream.keras_tf_trainer_module().TensorFlowTrainer,
        "predict_on_batch",
        KERAS_TF_PREDICT_ON_BATCH_COPIES,
        make,
    )


FIXES = [
    Fix(
        KERAS_TF_PREDICT_ON_BATCH_COPIES,
        "Keras 3 predict_on_batch under a tf.distribute strategy with N replicas returns N "
        "stacked copies of the predictions (16 inputs -> 32 rows with 2 replicas)",
        on_keras_backend("tensorflow"),
        keras_tf_predict_on_batch_copies,
        targets=targets(
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.predict_on_batch",
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._distribute_strategy"
            " (instance)",
            "keras.src.tree:flatten",
            "keras.src.tree:map_structure",
        ),
        acts_where=(
            "predict_on_batch of a model built under a strategy with >1 replica; one "
            "replica, no strategy: upstream's result"
        ),
        no_harm=(),  # none yet
    ),
]
