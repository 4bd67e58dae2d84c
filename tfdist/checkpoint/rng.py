"""Training state Keras does not save: the dropout RNG state, and a step's phantom updates.

Keras's ``SeedGenerator`` variables (dropout, noise, random augmentation) are in no
``.keras`` or ``.weights.h5`` file; a checkpoint stores them in its resume metadata so a
resumed job draws the same masks as an uninterrupted one.

Example:
    >>> states = rng_state(model)              # doctest: +SKIP
    >>> set_rng_state(model, states, "ckpt-1.keras")  # doctest: +SKIP
"""

from __future__ import annotations

import keras
import numpy as np

from tfdist import backends
from tfdist.core import upstream

__all__ = [
    "seed_generators",
    "numpy_value",
    "rng_state",
    "set_rng_state",
    "phantom_prone_variables",
]


def seed_generators(model) -> list:
    """The model's ``keras.random.SeedGenerator``s (dropout, noise...), in layer order.

    Example:
        >>> len(seed_generators(model))  # doctest: +SKIP
        1
    """
    found, seen = [], set()
    for generator in upstream.keras_seed_generators(model):
        if id(generator) not in seen:  # a generator shared by two layers is one state
            seen.add(id(generator))
            found.append(generator)
    return found


def numpy_value(value) -> np.ndarray:
    """A variable's or tensor's value on the host (``tf.Variable.numpy``, no array protocol).

    Example:
        >>> int(numpy_value(model.optimizer.iterations))  # doctest: +SKIP
        4
    """
    value = getattr(value, "value", value)  # keras.Variable -> the backend variable
    if hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(keras.ops.convert_to_numpy(value))


def rng_state(model, read=numpy_value) -> list[list[int]]:
    """The state of every seed generator of ``model``, as JSON-ready lists.

    ``read(variable)``: its value on the host (a custom loop reads its train state's).
    """
    return [np.asarray(read(g.state)).tolist() for g in seed_generators(model)]


def set_rng_state(model, states: list, path: str) -> None:
    """Puts ``states`` (from ``rng_state``, read from checkpoint ``path``) back.

    Raises:
        ValueError: the model has another number of seed generators than the writer.
    """
    generators = seed_generators(model)
    if len(generators) != len(states):
        raise ValueError(
            f"make_or_restore: checkpoint {path!r} holds {len(states)} random-seed "
            f"state(s) but the model from build_fn has {len(generators)} (dropout or "
            "other random layers differ). Restore with the build_fn that wrote it, or use a "
            "new checkpoint_dir."
        )
    for generator, state in zip(generators, states, strict=True):
        generator.state.assign(np.asarray(state, dtype=generator.state.dtype))


# When an epoch's data ends before Keras expected (a resumed epoch, which skips the
# batches already trained; or any dataset of unknown length: ``from_generator``,
# ``flat_map``...), Keras calls the train step once more; its ``get_next`` fails, but
# the ops that do not depend on the batch, the optimizer's ``iterations.assign_add(1)``
# and the dropout seed generators' advance, sometimes run anyway (a race). The weights
# are untouched, but the step counter (learning-rate schedules, Adam's bias correction)
# and the dropout masks of later epochs then differ from run to run, and a resumed job
# could not match an uninterrupted one. The checkpoint callback copies that state after
# every real step (on the device, no host sync) and puts the copy back at epoch end.


def phantom_prone_variables(model) -> list:
    """State a train step changes without reading its batch: the step counter, RNG states.

    The backend says which (``Backend.phantom_prone_variables``). Empty on JAX: its train
    step runs only once Python holds the batch, so no phantom step exists (and reading variables mid-epoch would force a device-to-host sync).

    Example:
        >>> len(phantom_prone_variables(model))  # doctest: +SKIP
        2
    """
    return backends.get().phantom_prone_variables(model)
