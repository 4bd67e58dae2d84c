"""The JAX custom-loop side of ``tfdist check``'s hook: a jitted training step stopped after N steps.

A custom loop in the style of Keras's "Distributed training with JAX" guide holds its
train state itself, as arrays: ``state = (trainable_variables, non_trainable_variables,
optimizer_variables)``, passed to a ``jax.jit``-compiled step (``model.stateless_call``,
``optimizer.stateless_apply``) that returns the next state. The model's variables are
only written back after the loop, if ever, so the check reads the state where the loop
hands it over: ``install()`` wraps ``jax.jit`` for the script's own functions (those
Keras, jax and tfdist compile are left alone), and a compiled function of the script is
the loop's **step** when, at its first call, its arguments hold the state of a Keras
model and its optimizer (the arrays of ``model.trainable_variables``,
``model.non_trainable_variables`` and ``optimizer.variables``, in that order and of
their shapes, anywhere in the arguments' leaves) and its result holds a state of the
same shapes. The step's calls are counted:

1. first call: the state it is given is the initial weights (and the re-runs' switches
   are set before the step is traced: random layers inert);
2. second call: its state is the weights after the first step;
3. call N+1 (``TFDIST_CHECK_STEPS``): its state is the one after N steps; it is written
   as ``fit``'s weights are (the model's variables, then the optimizer's), the process
   waits for its peers and ends (``os._exit(0)``) before the call runs.

A loop that ends sooner is measured at the process's exit, from the state its step last
returned. The models are looked for (a scan of the interpreter's objects) once per
compiled function of the script, at its first call with arrays. A jitted function made
before Keras is imported, a step that is not ``jax.jit`` of a Python function, or a
state in another order or form (a dict keyed otherwise, the variables split between
several functions) is not found: the process then says so at exit, and the check reports
that it could not stop the script.

Example:
    $ KERAS_BACKEND=jax TFDIST_CHECK_DIR=/tmp/c TFDIST_CHECK_STEPS=5 python -m tfdist.bootstrap loop.py
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field

from tfdist.check import loops, model
from tfdist.check.loops import LOOP

__all__ = ["install"]

_FIX_NAME = "tfdist_check_jax_loop"
# A function compiled by one of these packages is not the script's step.
_LIBRARIES = frozenset(
    {"jax", "jaxlib", "keras", "tfdist", "flax", "optax", "orbax", "tensorflow", "numpy"}
)


@dataclass(frozen=True)
class _State:
    """Where a model's and its optimizer's variables are: their keys and shapes, in order."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    weights: int  # the first ``weights`` are the model's (trainable, then non-trainable)
    model: object = field(compare=False)


def install() -> None:
    """Wraps ``jax.jit`` (JAX backend): the script's compiled functions are watched."""
    import jax

    from tfdist.core import fix_registry

    def patch() -> None:
        fix_registry.patch(jax, "jit", _FIX_NAME, _wrap_jit)

    loops.install_watcher(_FIX_NAME, "a JAX custom loop", "jax", "jax.jit", patch, _at_exit)


def _wrap_jit(original):
    @functools.wraps(original)
    def jit(*args, **kwargs):
        made = original(*args, **kwargs)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] in _LIBRARIES:
            return made
        if not args and "fun" not in kwargs:  # jax.jit(static_argnums=...) as a decorator
            return lambda fun: _Watched(made(fun))
        return _Watched(made)

    return jit


class _Watched:
    """A compiled function of the script: calls the compiled one; counts it if it is the step.

    Everything else (``lower``, ``trace``, ``eval_shape``...) is the compiled function's.
    """

    def __init__(self, jitted):
        self._jitted = jitted
        functools.update_wrapper(self, jitted)

    def __getattr__(self, name):
        return getattr(self._jitted, name)

    def __get__(self, instance, owner=None):  # a compiled method: bound as jax's is
        return self if instance is None else functools.partial(self, instance)

    def __call__(self, *args, **kwargs):
        if LOOP.step is self and LOOP.state is not None:
            return _step(self, LOOP.state, args, kwargs)
        if LOOP.step is not None or id(self) in LOOP.not_steps:
            return self._jitted(*args, **kwargs)
        return _maybe_the_step(self, args, kwargs)


def _arrays(tree) -> list | None:
    """The array leaves of ``tree``; None when it is being traced (a call inside another
    transform: not a step of the loop)."""
    import jax

    leaves = [leaf for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "shape")]
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return None
    return leaves


def _maybe_the_step(watched: _Watched, args: tuple, kwargs: dict):
    leaves = _arrays((args, kwargs))
    if not leaves:
        return watched._jitted(*args, **kwargs)
    LOOP.candidates += 1
    found = next(((s, at) for s in _states() if (at := _find(leaves, s)) is not None), None)
    if found is None:
        LOOP.not_steps.add(id(watched))
        return watched._jitted(*args, **kwargs)
    state, at = found
    facts = model.model_facts([state.model])  # before the step is traced below
    initial = _host(leaves[at : at + state.weights], state)
    out = watched._jitted(*args, **kwargs)
    returned = _arrays(out) or []
    at_out = _find(returned, state)
    if at_out is None:  # takes the state but returns none: an evaluation, a loss
        LOOP.not_steps.add(id(watched))
        return out
    LOOP.step, LOOP.state, LOOP.counted = watched, state, 1
    LOOP.initial, LOOP.facts = initial, facts
    LOOP.last = returned[at_out : at_out + len(state.shapes)]
    LOOP.replicas = len(getattr(leaves[at].sharding, "device_set", ())) or None
    model.progress("loop", step=0)
    return out


def _step(watched: _Watched, state: _State, args: tuple, kwargs: dict):
    """A call of the step: the state it is given is the one after ``calls`` steps."""
    leaves = _arrays((args, kwargs))
    at = None if leaves is None else _find(leaves, state)
    if leaves is None or at is None:  # traced, or called with another state: not counted
        return watched._jitted(*args, **kwargs)
    given = leaves[at : at + len(state.shapes)]
    steps = int(os.environ.get(model.STEPS_ENV, "20"))
    if LOOP.counted == 1:
        LOOP.first = _host(given[: state.weights], state)
    if LOOP.counted >= steps:
        _finish(given, state, steps)
        model.wait_for_peers()
        os._exit(0)
    LOOP.counted += 1
    model.progress("loop", step=LOOP.counted - 1)
    out = watched._jitted(*args, **kwargs)
    returned = _arrays(out) or []
    at_out = _find(returned, state)
    if at_out is not None:
        LOOP.last = returned[at_out : at_out + len(state.shapes)]
    return out


def _states() -> list[_State]:
    """The state of every Keras model with every built optimizer the script made."""
    models = loops.models()
    optimizers = sorted(
        (o for o in loops.instances("Optimizer") if o.variables), key=lambda o: o.name
    )
    return [_state_of(m, o) for m in models for o in optimizers]


def _state_of(keras_model, optimizer) -> _State:
    weights = [*keras_model.trainable_variables, *keras_model.non_trainable_variables]
    variables = [*weights, *optimizer.variables]
    keys: list[str] = []
    for variable in variables:  # a repeated path gets #2, #3... as model.values names it
        key, n = variable.path, 1
        while key in keys:
            n += 1
            key = f"{variable.path}#{n}"
        keys.append(key)
    shapes = tuple(tuple(v.shape) for v in variables)
    return _State(tuple(keys), shapes, len(weights), keras_model)


def _find(leaves: list, state: _State) -> int | None:
    """Where the state's arrays lie, in order, among ``leaves``; None if nowhere."""
    count = len(state.shapes)
    for start in range(len(leaves) - count + 1):
        if all(tuple(leaves[start + i].shape) == state.shapes[i] for i in range(count)):
            return start
    return None


def _host(leaves: list, state: _State) -> dict:
    """``{variable key: numpy array}`` for the state's first ``len(leaves)`` arrays."""
    from tfdist.loops.jax import to_host

    return {key: to_host(leaf) for key, leaf in zip(state.keys, leaves, strict=False)}


def _finish(leaves: list, state: _State, steps: int) -> None:
    loops.finish(_host(leaves, state), steps)


def _at_exit() -> None:
    """The loop ended before N steps (the script's own end), or no step was found."""
    if LOOP.failed:
        return
    if LOOP.state is not None and LOOP.last is not None:
        _finish(LOOP.last, LOOP.state, LOOP.counted)
        model.wait_for_peers()
    elif LOOP.candidates:
        model.progress(
            "no-loop",
            reason=f"it called {LOOP.candidates} jitted function(s) of its own, but none took "
            "and returned the state of a Keras model and its optimizer as the Keras "
            "guide's training step does: (trainable_variables, non_trainable_variables, "
            "optimizer_variables), arrays of the model's and optimizer's variables in that "
            "order, given to a jax.jit-compiled step that returns the next state",
        )
