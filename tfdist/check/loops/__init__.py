"""The custom-loop side of ``tfdist check``'s hook: a script's own loop stopped after N steps.

One watcher per backend, chosen by ``tfdist.check.hook``: ``tensorflow`` counts the
batches a loop draws from ``tf.distribute``'s distributed datasets; ``jax`` counts the
calls of the loop's ``jax.jit``-compiled training step. What they share is here: the one
record of what the loop did (``LOOP``), how a watcher is applied (``install_watcher``),
the script's models and optimizers (``models``, ``instances``, ``unique``) and the
result, written as ``fit``'s is (``finish``).

Example:
    $ TFDIST_CHECK_DIR=/tmp/c TFDIST_CHECK_STEPS=5 python -m tfdist.bootstrap loop.py
"""

from __future__ import annotations

import atexit
import sys
from dataclasses import dataclass, field
from typing import Any

from tfdist.check import model

__all__ = ["LOOP", "install_watcher", "noting_failure", "models", "instances", "unique", "finish"]


@dataclass
class _Loop:
    """What this process's loop did (a checked run is one process running one script).

    ``counted``: TensorFlow, the batches drawn from the training data; JAX, the calls of
    the training step. ``candidates``: what the script made that could be its loop
    (distributed datasets; its own jitted functions called with arrays), for the line
    that says none was counted. ``source`` and ``traced`` are TensorFlow's watcher's;
    ``step``, ``state``, ``not_steps`` and ``last`` are JAX's.
    """

    counted: int = 0
    candidates: int = 0
    replicas: int | None = None
    failed: bool = False  # the script raised: no result at exit
    initial: dict = field(default_factory=dict)
    first: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    source: int | None = None  # id() of the dataset the script drew from first
    traced: bool = False  # a batch was drawn inside a tf.function
    step: Any = None  # the step (a compiled function of the script)
    state: Any = None  # where the model's state lies among the step's arrays
    not_steps: set = field(default_factory=set)  # id() of compiled functions that are not
    last: list | None = None  # the state the step last returned (its leaves)


LOOP = _Loop()


def install_watcher(name, what, package, target, patch, at_exit) -> None:
    """Applies a loop watcher the one way every patch is (``fix_registry.apply_fix``):
    ``patch()``, then ``at_exit`` at the process's exit and a ``sys.excepthook`` that
    notes a failing script in ``LOOP``; a clear error when it cannot be applied."""
    from tfdist.core import fix_registry

    def apply() -> None:
        patch()
        atexit.register(at_exit)
        sys.excepthook = noting_failure(sys.excepthook, LOOP)

    record = fix_registry.Fix(
        name, f"tfdist check stops {what}", lambda: True, apply, package=package
    )
    reason = fix_registry.apply_fix(record)
    if reason is not None:
        raise RuntimeError(f"tfdist check cannot hook {target}: {reason}")


def noting_failure(excepthook, loop):
    """``sys.excepthook`` that first notes on ``loop`` (its ``failed``) that the script
    failed: it runs before ``atexit``, where no result is then written."""

    def noted(kind, value, traceback):
        loop.failed = True
        model.progress("failed", error=f"{kind.__name__}: {value}"[:500])
        excepthook(kind, value, traceback)

    return noted


def models() -> list:
    """The Keras models the script built (those not inside another), by name."""
    return _outermost(instances("Model"))


def instances(kind: str) -> list:
    """Every live ``keras.Model`` (``kind="Model"``) or Keras optimizer."""
    import gc

    import keras

    wanted = keras.Model if kind == "Model" else keras.optimizers.Optimizer
    return [o for o in gc.get_objects() if isinstance(o, wanted)]


def _outermost(found: list) -> list:
    inner = {id(layer) for m in found for layer in model.all_layers(m)}
    return sorted((m for m in found if id(m) not in inner), key=lambda m: m.name)


def unique(variables) -> list:
    """Each variable once (a ``Sequential`` holds a functional model of the same ones)."""
    seen: dict = {}
    for variable in variables:
        seen.setdefault(id(variable), variable)
    return list(seen.values())


def finish(final: dict, steps: int) -> None:
    """Writes the loop's result as ``fit``'s is: ``final`` (``{key: array}``) after
    ``steps`` steps, beside ``LOOP``'s initial weights and those after the first step."""
    first = LOOP.first or {k: v for k, v in final.items() if k in LOOP.initial}
    facts = {
        **LOOP.facts,
        "loop": True,
        "replicas": LOOP.replicas,
        "steps_per_epoch": None,
        "history": {},
    }
    model.write_result(final, LOOP.initial, first, facts, steps)
