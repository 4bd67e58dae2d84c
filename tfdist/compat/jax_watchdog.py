"""The JAX watchdog's hook into Keras: ``fit``/``evaluate``/``predict`` report their batches.

``tfdist.core.watchdog`` owns the mechanism (the thread, the verdict, the exit); this hook (a
``Patch``, not a fix: it repairs no upstream defect, it adds tfdist's watchdog) only runs
each call inside ``watchdog.watched`` and adds two callbacks that report to it:
one first in the list (an epoch's end starts a longer allowance, before any other
callback saves) and one last (a batch is finished when all its callbacks are).

Example:
    >>> HOOK.name
    'keras_jax_watchdog'
"""

from __future__ import annotations

import functools
import inspect

from tfdist.core import upstream, watchdog
from tfdist.core.fix_registry import Patch, on_keras_backend, targets, wrap

__all__ = ["HOOK", "NAME", "install"]

NAME = "keras_jax_watchdog"

_ENTRY_POINTS = ("fit", "evaluate", "predict")
_KJ = "keras.src.backend.jax.trainer:"


def _callback_classes():
    import keras

    class _EpochEnd(keras.callbacks.Callback):
        """First in the list: an epoch's end (saves, the next epoch's input) may take long."""

        async_safe = True  # keeps Keras's asynchronous batch-end dispatch as it was

        def on_epoch_end(self, epoch, logs=None):
            watchdog.allowance()

    class _BatchEnd(keras.callbacks.Callback):
        """Last in the list: a batch counts as finished once all its callbacks ran."""

        async_safe = True

        def on_train_batch_end(self, batch, logs=None):
            watchdog.progress()

        def on_test_batch_end(self, batch, logs=None):
            watchdog.progress()

        def on_predict_batch_end(self, batch, logs=None):
            watchdog.progress()

    return _EpochEnd, _BatchEnd


def _with_reporters(callbacks, first, last):
    """``callbacks`` with the reporters around them, and how to take them out again.

    A ``CallbackList`` (what ``fit`` hands its validation ``evaluate``) is changed in place
    and restored afterwards; a list is copied.
    """
    import keras

    if not isinstance(callbacks, keras.callbacks.CallbackList):
        items = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        return [first, *(c for c in items if c is not None), last], lambda: None
    inner = callbacks.callbacks
    if any(isinstance(c, type(last)) for c in inner):
        return callbacks, lambda: None  # fit's own list, already reporting
    inner.insert(0, first)
    inner.append(last)

    def restore():
        for callback in (first, last):
            if callback in inner:
                inner.remove(callback)

    return callbacks, restore


def _with_callbacks(position: int, args: tuple, kwargs: dict, first, last):
    """``args``/``kwargs`` with the reporters added to ``callbacks``, passed by keyword or
    at ``position``."""
    if len(args) > position:
        callbacks, restore = _with_reporters(args[position], first, last)
        args = (*args[:position], callbacks, *args[position + 1 :])
    else:
        kwargs["callbacks"], restore = _with_reporters(kwargs.get("callbacks"), first, last)
    return args, kwargs, restore


def install() -> None:
    """Ends every process of a multi-process JAX job when one is stuck or lost in a step.

    Upstream, a process that stays alive but never joins the next collective (stuck in
    a callback, a data read, a lock) leaves every other process waiting in that
    collective forever: jax's CPU collectives have no timeout (jax#38503) and its
    heartbeats still arrive from the stuck process. And a peer that dies mid-step ends
    the others with a gloo traceback, then jax's abort at exit. The hook runs
    ``fit``/``evaluate``/``predict`` of a multi-process job inside
    ``tfdist.core.watchdog.watched`` with two callbacks reporting each finished batch and
    each epoch's end; the watchdog's thread ends the process with one line naming the
    peers it waits for after ``TFDIST_JAX_STALL_TIMEOUT`` s without progress (default
    45; 0 turns it off), and a lost peer's failed collective with one line naming
    that peer. The callbacks read nothing and change nothing (``async_safe``: Keras keeps
    dispatching batch ends as it did), so training gives the same model; in one process,
    or with the watchdog off, upstream runs unchanged.
    """
    trainer_class = upstream.keras_jax_trainer_class()
    reporters = _callback_classes()  # made once: fit's own list is recognised by its class
    for name in _ENTRY_POINTS:
        wrap(trainer_class, name, NAME, functools.partial(_watched, name, reporters))


def _watched(entry: str, reporters, original, self, *args, **kwargs):
    """``original`` (``fit``/``evaluate``/``predict``) run inside ``watchdog.watched``, with
    the two reporters around its callbacks; upstream's call when the watchdog is off."""
    if not watchdog.enabled():
        return original(self, *args, **kwargs)
    # Where `callbacks` is among the positional arguments (after self).
    position = list(inspect.signature(original).parameters).index("callbacks") - 1
    first_class, last_class = reporters
    args, kwargs, restore = _with_callbacks(position, args, kwargs, first_class(), last_class())
    try:
        with watchdog.watched(entry):
            return original(self, *args, **kwargs)
    finally:
        restore()


# A hook, not a fix: applied by tfdist.compat.HOOKS through the same guard as the fixes;
# TFDIST_COMPAT_EXCLUDE=keras_jax_watchdog still turns it off.
HOOK = Patch(
    NAME,
    install,
    purpose="a stuck or lost process of a multi-process JAX job ends the job with one line "
    "(jax's CPU collectives have no timeout, https://github.com/jax-ml/jax/issues/38503)",
    applies=on_keras_backend("jax"),
    targets=targets(
        _KJ + "JAXTrainer.fit",
        _KJ + "JAXTrainer.evaluate",
        _KJ + "JAXTrainer.predict",
        "jax._src.distributed:State.client",
        "jax._src.lib:_jax.DistributedRuntimeClient.key_value_set",
        "jax._src.lib:_jax.DistributedRuntimeClient.key_value_try_get",
    ),
)
