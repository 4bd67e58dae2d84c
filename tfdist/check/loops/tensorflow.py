"""The custom-loop side of ``tfdist check``'s hook: a TensorFlow loop stopped after N steps.

A custom loop in the guides' style draws one batch per step, in Python, from
``strategy.experimental_distribute_dataset(ds)`` (``tfdist.loops.distribute``) or
``strategy.distribute_datasets_from_function(fn)`` and runs the step with
``strategy.run`` inside a ``tf.function``. ``install()`` wraps those two methods of
``tf.distribute.Strategy`` (the calls Keras's own ``fit``, ``evaluate`` and ``predict``
make are left alone): the dataset they return counts the batches its iterators give
(``next(iterator)``, ``for batch in dataset``, ``iterator.get_next()``), eagerly. The
first dataset the script draws from is the training data (a test set iterated later is
not counted). At its

1. first batch: the models' weights before the first step (and the re-runs' switches:
   ``BatchNormalization`` synchronized, random layers inert, read when the step traces);
2. second batch: the weights after the first step (the ``loss_per_replica`` cause
   compares this first update with one device's);
3. batch N+1 (``TFDIST_CHECK_STEPS``): N steps are done; the weights of every Keras model
   and optimizer the script built are written as ``fit``'s are, the process waits for
   its peers and ends (``os._exit(0)``).

A loop that ends sooner is measured at the process's exit, with the steps it ran
(unless the script raised: ``sys.excepthook`` notes it, and no result is written). A
batch drawn inside a ``tf.function`` (``next(iterator)`` traced once, run every call; an
iterator passed to it is rebuilt there) cannot be counted: the process then says so at exit, and the check reports that it
could not stop the script. A loop's loss is not recorded (it lives inside the traced
step): loops are compared by their weights.

Example:
    $ TFDIST_CHECK_DIR=/tmp/c TFDIST_CHECK_STEPS=5 python -m tfdist.bootstrap loop.py
"""

from __future__ import annotations

import functools
import os
import sys

from tfdist.check import loops, model
from tfdist.check.loops import LOOP

__all__ = ["install"]

_FIX_NAME = "tfdist_check_loop"
_METHODS = ("experimental_distribute_dataset", "distribute_datasets_from_function")


def install() -> None:
    """Wraps ``tf.distribute.Strategy``'s two dataset methods (TensorFlow backend)."""
    import tensorflow as tf

    from tfdist.core import fix_registry

    def patch() -> None:
        for name in _METHODS:
            fix_registry.patch(tf.distribute.Strategy, name, _FIX_NAME, _wrap_distribute)

    loops.install_watcher(
        _FIX_NAME, "a custom loop", "tensorflow", "tf.distribute.Strategy", patch, _at_exit
    )


def _wrap_distribute(original):
    @functools.wraps(original)
    def distribute(self, *args, **kwargs):
        made = original(self, *args, **kwargs)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] == "keras":
            return made  # fit's, evaluate's or predict's own input: not the loop's
        LOOP.candidates += 1
        LOOP.replicas = LOOP.replicas or self.num_replicas_in_sync
        return _counting(made, "__iter__", _iterating)

    return distribute


_SUBCLASSES: dict = {}


def _counting(obj, name: str, make):
    """``obj`` as an instance of a subclass of its own class whose ``name`` methods (of
    those the class has) are ``make(base method)``: everything else, ``isinstance``
    and ``tf.function``'s handling included, stays the class's."""
    base = type(obj)
    names = tuple(n for n in name.split() if hasattr(base, n))
    key = (base, names)
    if key not in _SUBCLASSES:
        methods = {n: make(getattr(base, n)) for n in names}
        _SUBCLASSES[key] = type(base.__name__, (base,), {"__slots__": (), **methods})
    obj.__class__ = _SUBCLASSES[key]
    return obj


def _iterating(base_iter):
    def __iter__(self):
        iterator = base_iter(self)
        object.__setattr__(iterator, "_tfdist_check_source", id(self))
        return _counting(iterator, "__next__ get_next", _drawing)

    return __iter__


def _drawing(base_next):
    def draw(self, *args, **kwargs):
        if getattr(self, "_tfdist_check_busy", False):  # __next__ calling get_next
            return base_next(self, *args, **kwargs)
        object.__setattr__(self, "_tfdist_check_busy", True)
        try:
            batch = base_next(self, *args, **kwargs)  # StopIteration: no step drawn
        finally:
            object.__setattr__(self, "_tfdist_check_busy", False)
        _drew(self._tfdist_check_source)
        return batch

    return draw


def _drew(source: int) -> None:
    import tensorflow as tf

    if not tf.executing_eagerly():
        LOOP.traced = True  # traced once, run at every call: not countable
        return
    if LOOP.source is None:
        LOOP.source = source
    if source != LOOP.source:
        return  # another dataset (a test set): not a training step
    LOOP.counted += 1
    steps = int(os.environ.get(model.STEPS_ENV, "20"))
    if LOOP.counted == 1:
        models = loops.models()
        LOOP.facts = model.model_facts(models)
        LOOP.initial = model.values(loops.unique(v for m in models for v in m.weights))
    elif LOOP.counted == 2:
        LOOP.first = _snapshot()
    if LOOP.counted > steps:
        _finish(steps)
        model.wait_for_peers()
        os._exit(0)
    model.progress("loop", step=LOOP.counted - 1)


def _snapshot() -> dict:
    """Every model's weights, then every optimizer's variables (their steps, slots)."""
    optimizers = sorted(loops.instances("Optimizer"), key=lambda o: o.name)
    variables = [v for m in loops.models() for v in m.weights]
    return model.values(loops.unique([*variables, *(v for o in optimizers for v in o.variables)]))


def _finish(steps: int) -> None:
    loops.finish(_snapshot(), steps)


def _at_exit() -> None:
    """The loop ended before N steps (the script's own end), or never drew a batch."""
    if LOOP.failed:
        return
    if LOOP.counted:
        _finish(LOOP.counted)
        model.wait_for_peers()
    elif LOOP.candidates or LOOP.traced:
        model.progress(
            "no-loop",
            reason=f"it made {LOOP.candidates} distributed dataset(s) but drew no batch of them "
            "in Python: its loop draws them inside a tf.function (next(iterator) in the "
            "traced step, or an iterator passed to it), where they cannot be counted; draw "
            "them in Python (for batch in dataset: step(batch)) to check it",
        )
