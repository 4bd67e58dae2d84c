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

import atexit
import functools
import os
import sys
from dataclasses import dataclass, field

from tfdist.check import model

__all__ = ["install", "install_watcher", "noting_failure"]

_FIX_NAME = "tfdist_check_loop"
_METHODS = ("experimental_distribute_dataset", "distribute_datasets_from_function")


@dataclass
class _Loop:
    """What this process's loop did: the batches drawn from its training data."""

    source: int | None = None  # id() of the dataset the script drew from first
    drawn: int = 0
    replicas: int | None = None
    traced: bool = False  # a batch was drawn inside a tf.function
    failed: bool = False  # the script raised: no result at exit
    made: int = 0  # distributed datasets the script made
    initial: dict = field(default_factory=dict)
    first: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)


_LOOP = _Loop()


def install() -> None:
    """Wraps ``tf.distribute.Strategy``'s two dataset methods (TensorFlow backend)."""
    import tensorflow as tf

    from tfdist.core import fix_registry

    def patch() -> None:
        for name in _METHODS:
            fix_registry.patch(tf.distribute.Strategy, name, _FIX_NAME, _wrap_distribute)

    install_watcher(
        _FIX_NAME, "a custom loop", "tensorflow", "tf.distribute.Strategy", patch, _at_exit, _LOOP
    )


def install_watcher(name, what, package, target, patch, at_exit, state) -> None:
    """Applies a loop watcher the one way every patch is (``fix_registry.apply_fix``):
    ``patch()``, then ``at_exit`` at the process's exit and a ``sys.excepthook`` that
    notes a failing script in ``state``; a clear error when it cannot be applied."""
    from tfdist.core import fix_registry

    def apply() -> None:
        patch()
        atexit.register(at_exit)
        sys.excepthook = noting_failure(sys.excepthook, state)

    record = fix_registry.Fix(
        name, f"tfdist check stops {what}", lambda: True, apply, package=package
    )
    reason = fix_registry.apply_fix(record)
    if reason is not None:
        raise RuntimeError(f"tfdist check cannot hook {target}: {reason}")


def _wrap_distribute(original):
    @functools.wraps(original)
    def distribute(self, *args, **kwargs):
        made = original(self, *args, **kwargs)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] == "keras":
            return made  # fit's, evaluate's or predict's own input: not the loop's
        _LOOP.made += 1
        _LOOP.replicas = _LOOP.replicas or self.num_replicas_in_sync
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
        _LOOP.traced = True  # traced once, run at every call: not countable
        return
    if _LOOP.source is None:
        _LOOP.source = source
    if source != _LOOP.source:
        return  # another dataset (a test set): not a training step
    _LOOP.drawn += 1
    steps = int(os.environ.get(model.STEPS_ENV, "20"))
    if _LOOP.drawn == 1:
        models = _models()
        _LOOP.facts = model.model_facts(models)
        _LOOP.initial = model.values(_unique(v for m in models for v in m.weights))
    elif _LOOP.drawn == 2:
        _LOOP.first = _snapshot()
    if _LOOP.drawn > steps:
        _finish(steps)
        model.wait_for_peers()
        os._exit(0)
    model.progress("loop", step=_LOOP.drawn - 1)


def _models() -> list:
    """The Keras models the script built (those not inside another), by name."""
    return _outermost(_instances("Model"))


def _instances(kind: str) -> list:
    import gc

    import keras

    wanted = keras.Model if kind == "Model" else keras.optimizers.Optimizer
    return [o for o in gc.get_objects() if isinstance(o, wanted)]


def _outermost(models: list) -> list:
    inner = {id(layer) for m in models for layer in model.all_layers(m)}
    return sorted((m for m in models if id(m) not in inner), key=lambda m: m.name)


def _snapshot() -> dict:
    """Every model's weights, then every optimizer's variables (their steps, slots)."""
    optimizers = sorted(_instances("Optimizer"), key=lambda o: o.name)
    variables = [v for m in _models() for v in m.weights]
    return model.values(_unique([*variables, *(v for o in optimizers for v in o.variables)]))


def _unique(variables) -> list:
    """Each variable once (a ``Sequential`` holds a functional model of the same ones)."""
    seen: dict = {}
    for variable in variables:
        seen.setdefault(id(variable), variable)
    return list(seen.values())


def _finish(steps: int) -> None:
    final = _snapshot()
    model_keys = set(_LOOP.initial)
    first = _LOOP.first or {k: v for k, v in final.items() if k in model_keys}
    facts = {
        **_LOOP.facts,
        "loop": True,
        "replicas": _LOOP.replicas,
        "steps_per_epoch": None,
        "history": {},
    }
    model.write_result(final, _LOOP.initial, first, facts, steps)


def noting_failure(excepthook, loop):
    """``sys.excepthook`` that first notes on ``loop`` (its ``failed``) that the script
    failed: it runs before ``atexit``, where no result is then written."""

    def noted(kind, value, traceback):
        loop.failed = True
        model.progress("failed", error=f"{kind.__name__}: {value}"[:500])
        excepthook(kind, value, traceback)

    return noted


def _at_exit() -> None:
    """The loop ended before N steps (the script's own end), or never drew a batch."""
    if _LOOP.failed:
        return
    if _LOOP.drawn:
        _finish(_LOOP.drawn)
        model.wait_for_peers()
    elif _LOOP.made or _LOOP.traced:
        model.progress(
            "no-loop",
            reason=f"it made {_LOOP.made} distributed dataset(s) but drew no batch of them "
            "in Python: its loop draws them inside a tf.function (next(iterator) in the "
            "traced step, or an iterator passed to it), where they cannot be counted; draw "
            "them in Python (for batch in dataset: step(batch)) to check it",
        )
