"""Keras 3 on TensorFlow prints progress bars on the chief only in a multi-worker job (``keras_tf_progbar_chief_only``).

Every private Keras/TensorFlow name used comes from ``tfdist.core.upstream``.

Example:
    >>> [fix.name for fix in FIXES]
    ['keras_tf_progbar_chief_only']
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["KERAS_TF_PROGBAR_CHIEF_ONLY", "FIXES", "keras_tf_progbar_chief_only"]

# The fix's name, declared once (other layers import it).
KERAS_TF_PROGBAR_CHIEF_ONLY = "keras_tf_progbar_chief_only"


# ------------------------------------------------- fix: progress bars on the chief only


def keras_tf_progbar_chief_only() -> None:
    """Silences Keras' progress bar on the non-chief workers of a multi-worker job.

    Every worker of a MultiWorkerMirroredStrategy job runs the same ``fit`` and computes
    the same global metrics (the epoch logs come from all-reduced metric variables), so
    N workers print N copies of every progress bar and epoch summary. Keras 3 has no
    chief logic. The fix sets ``verbose=0`` on ``keras.callbacks.ProgbarLogger`` when
    the model's strategy spans several workers and this worker is not the one that
    writes summaries (``strategy.extended.should_save_summary``, True on the chief
    only). Nothing else changes: callbacks, History and the returned logs are the same
    on every worker.
    """

    def make(original):
        def set_params(self, params):
            original(self, params)
            strategy = getattr(getattr(self, "model", None), "distribute_strategy", None)
            if strategy is not None and upstream.tf_in_multi_worker_mode(strategy):
                if not strategy.extended.should_save_summary:
                    self.verbose = 0

        return set_params

    patch(upstream.keras_progbar_logger_class(), "set_params", KERAS_TF_PROGBAR_CHIEF_ONLY, make)


_CARS = "tensorflow.python.distribute.collective_all_reduce_strategy:"

FIXES: list[Fix] = [
    Fix(
        KERAS_TF_PROGBAR_CHIEF_ONLY,
        "Keras 3 prints progress bars on every worker of a multi-worker job",
        on_keras_backend("tensorflow"),
        keras_tf_progbar_chief_only,
        targets=targets(
            "keras.src.callbacks.progbar_logger:ProgbarLogger.set_params",
            _CARS + "CollectiveAllReduceExtended._in_multi_worker_mode",
        ),
        acts_where=(
            "ProgbarLogger (verbose != 0) on a non-chief worker of "
            "MultiWorkerMirroredStrategy with >1 worker; the chief, one worker: untouched"
        ),
        no_harm=(),  # none yet
    ),
]
