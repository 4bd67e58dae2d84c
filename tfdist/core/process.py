"""The one owner of tfdist's process-wide state, with a reset for tests.

Everything tfdist remembers about this process lives in one ``ProcessState``: the
strategy (or JAX distribution) it created, the live seeded pipelines and where the next
one starts, the models restored by ``make_or_restore``, and the fixes applied. Modules
read and change it through ``state()``; none keeps process state of its own.

TensorFlow-free: importing it costs nothing.

Example:
    >>> from tfdist import process
    >>> process.state().applied_fixes
    []
    >>> process.reset()          # tests: forget everything tfdist remembered
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from tfdist.core.position import Position

__all__ = ["ProcessState", "state", "reset"]


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
