"""The one owner of tfdist's process-wide state, with a reset for tests.

Everything tfdist remembers about this process lives in one ``ProcessState``: the
strategy (or JAX distribution) it created, the live seeded pipelines and where the next
one starts, the models restored by ``make_or_restore``, and the fixes applied. Modules
read and change it through ``state()``. What lives outside it on purpose (import hooks,
threads, per-thread guards, call counters, caches) is named in ``OUTSIDE_STATE`` with the
reason; tests/project/test_structure.py fails on any module-level state not listed there.

TensorFlow-free: importing it costs nothing.

Example:
    >>> from tfdist.core import process
    >>> process.reset()          # tests: forget everything tfdist remembered
    >>> process.state().applied_fixes
    []
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from tfdist.core.position import Position

__all__ = ["OUTSIDE_STATE", "ProcessState", "state", "reset"]


@dataclass
class ProcessState:
    """What tfdist remembers about this process.

    Attributes:
        lock: held while changing any field below (re-entrant).
        distribution: ``(plan, object)`` the backend created for this process (a
            ``tf.distribute.Strategy`` or a ``keras.distribution.Distribution``), or None.
        pipelines: live seeded pipelines' position holders (weak: a dropped dataset
            disappears from here).
        data_start: the position the next iteration of every seeded pipeline starts at.
        resumed: model -> how ``make_or_restore`` restored it (weak keys).
        applied_fixes: names of the compat fixes applied, in order.
        skipped_fixes: fix name -> why it was not applied (a target missing or changed).
        batch_plans: pipeline -> ``(global_batch, replicas, per_replica_given)`` as
            built (weak keys), checked when a distribution with another data axis starts.
        devices_configured: logical CPU devices configured before the framework
            started, or None.
        multi_worker_timeouts: the ``MultiWorkerTimeouts`` the next (or current)
            MultiWorkerMirroredStrategy uses; None means from the environment.
        auto_strategy: whether a multi-worker process creates its strategy just before
            TensorFlow's first op, or joins jax's distributed runtime when jax is imported
            (see ``tfdist.startup``); ``tfdist info`` turns it off.
        jax_initialized: whether tfdist called ``jax.distributed.initialize`` (JAX).
        barriers: unnamed ``tfdist.barrier()`` calls so far (names them in call order).
        version_warnings: packages already warned about as outside the verified range.
        chief_values: values shared from the chief so far (names their keys in call
            order, as ``barriers`` does for unnamed barriers).
        unscoped_models: ``job`` when models built outside any scope train on the job
            (``tfdist.unscoped.enable``, under bootstrap), ``local`` or None otherwise.
        unscoped_default: what the first unscoped model made the process default (one
            line), or None before it.
        unscoped_strategy: the strategy (JAX: distribution) made the process default, set
            again after ``keras.backend.clear_session()`` drops it; or None.
    """

    lock: threading.RLock = field(default_factory=threading.RLock)
    distribution: tuple[Any, Any] | None = None
    pipelines: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    data_start: Position = field(default_factory=Position)
    resumed: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    applied_fixes: list[str] = field(default_factory=list)
    skipped_fixes: dict[str, str] = field(default_factory=dict)
    batch_plans: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    devices_configured: int | None = None
    multi_worker_timeouts: Any = None
    auto_strategy: bool = True
    jax_initialized: bool = False
    barriers: int = 0
    version_warnings: set[str] = field(default_factory=set)
    chief_values: int = 0
    unscoped_models: str | None = None
    unscoped_default: str | None = None
    unscoped_strategy: Any = None


_STATE = ProcessState()


def state() -> ProcessState:
    """This process's tfdist state (one object per process)."""
    return _STATE


def reset() -> None:
    """Forgets everything tfdist remembered, for tests.

    The framework itself is not reset: patches already installed stay installed (they
    are idempotent and version-guarded), devices TensorFlow fixed stay fixed, and a
    strategy object that was created lives on in the objects that hold it.
    """
    global _STATE
    _STATE = ProcessState()


# Module-level state kept outside ``ProcessState`` on purpose: name -> why ``reset()`` must
# not (or cannot) forget it.
_COUNTER = (
    "a counter naming collective meetings in call order since the interpreter started "
    "(every worker makes the same calls in the same order, so the n-th meeting has one "
    "name everywhere); it never restarts, so no name is used twice"
)
OUTSIDE_STATE = {
    "tfdist.compat.added_losses._SCALED": "per replica thread, the loss tensors Keras "
    "scaled for the replicas while the step is traced, as tf.distribute's own replica "
    "contexts are per thread",
    "tfdist.compat.collective_keys._MADE": "MirroredStrategy objects that made collective "
    "keys since the interpreter started: TensorFlow's collective runtime remembers their "
    "keys for the process's life, so the count must never restart",
    "tfdist.startup._installed": "the import hooks sit on sys.meta_path for the "
    "interpreter's life; reset() cannot take them off, so it must not forget them",
    "tfdist.startup._setting_up": "a per-thread re-entry guard while set-up runs (set-up "
    "itself initialises TensorFlow's context)",
    "tfdist.core.exit_hold._HOLD": "an atexit registration for the interpreter's life "
    "(the exit barrier, once the job used the coordination service) and how the script "
    "ended; reset() cannot unregister it",
    "tfdist.check.loops.LOOP": "what the checked script's custom loop did (TensorFlow's or "
    "JAX's), recorded for `tfdist check`'s report at exit; a checked run is one process "
    "running one script",
    "tfdist.core.watchdog._dog": "the process's one watchdog thread, running; reset() "
    "cannot stop a thread",
    "tfdist.batchnorm._warned": "a once-per-process warning latch, as Python's own "
    "warnings registry keeps one",
    "tfdist.batchnorm._SYNC": "per thread and task, as tf.distribute's own scopes are",
    "tfdist.core.atomic._WRITING": "per thread: inside atomic_output, a Keras save is the "
    "staging write itself",
    "tfdist.core.fix_registry._journal": "per thread: the undo journal while one fix applies",
    "tfdist.core.fix_registry._fingerprints_cache": "a read-through cache of "
    "fingerprints.json, a file shipped with the package",
    "tfdist.core.fix_registry._apply_all": "a registration: tfdist.compat.apply_all, set "
    "when tfdist.compat is imported",
    "tfdist.compat.chief_writes._TENSORBOARD_STAGING": "weak, per callback object: its "
    "staging folder lives and dies with the callback",
    "tfdist.compat.inputs.jax._AGREEMENTS": _COUNTER,
    "tfdist.compat.inputs.jax.INFERENCE": "a context variable, per evaluate or predict "
    "call on JAX: a batch the replicas cannot split evenly is fed whole there",
    "tfdist.compat.partial_batches.tensorflow._TRAINING_INPUT": "a context variable, per fit call: "
    "which dataset that fit trains on, until tf.distribute cuts it",
    "tfdist.compat.partial_batches.tensorflow._FIT_CUT": "a context variable, per fit call: how "
    "tf.distribute cut that fit's training data",
    "tfdist.compat.loss_weights._FITS": "the fits running now, per strategy, popped when "
    "each returns: what a replica thread (outside the fit's context) reads",
    "tfdist.compat.loss_weights._TRAINED_WITH": "weak, per model: the cut its train "
    "function was traced for, forgotten with the model",
    "tfdist.compat.inputs.tensorflow._AGREEMENTS": _COUNTER,
    "tfdist.saving._SYNCS": _COUNTER,
}
