"""Restoring: ``make_or_restore``, what a model was restored from, and its resumed epoch.

Restoring puts weights, optimizer state (iterations, slots, learning rate) and RNG state
back, and remembers the position per model (``process.state().resumed``) until the
resumed epoch ends, so that the checkpoint callback makes the data pipeline skip the
batches already trained (``tfdist.data.set_position``): the resumed job neither replays
nor skips a batch.

Example:
    >>> model, initial_epoch = make_or_restore(build_and_compile, "ckpt/")  # doctest: +SKIP
    >>> resume_state(model)                                               # doctest: +SKIP
    ResumeState(path='.../ckpt-3-50.keras', epoch=2, batch=50, step=250)
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import keras

from tfdist import distribute, process, saving, validate
from tfdist.checkpoint.agreement import check_workers_agree
from tfdist.checkpoint.archive import CorruptCheckpoint, inspect_archive
from tfdist.checkpoint.names import (
    CORRUPT_SUFFIX,
    check_dir,
    list_checkpoints,
    parse_checkpoint_name,
)
from tfdist.checkpoint.rng import set_rng_state

__all__ = [
    "ResumeState",
    "make_or_restore",
    "resume_state",
    "is_resumed_partial_epoch",
    "finish_resumed_epoch",
    "forget_resume",
    "set_data_position",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumeState:
    """What ``make_or_restore`` restored a model from.

    Attributes:
        path: the checkpoint file.
        epoch: the 0-based epoch training resumes in (``initial_epoch`` for ``fit``).
        batch: batches of that epoch already trained (0 at an epoch boundary).
        step: the global step at the save, or None for archives without tfdist metadata.
    """

    path: str
    epoch: int
    batch: int = 0
    step: int | None = None


# --------------------------------------------------------------------------- resume state


def resume_state(model) -> ResumeState | None:
    """How ``model`` was restored by ``make_or_restore``, until its resumed epoch ends.

    Example:
        >>> model, epoch = make_or_restore(build, "ckpt/")  # doctest: +SKIP
        >>> resume_state(model).batch                        # doctest: +SKIP
        50
    """
    try:
        return process.state().resumed.get(model)
    except TypeError:  # unhashable objects are never registered
        return None


def is_resumed_partial_epoch(model, epoch: int) -> bool:
    """Whether ``epoch`` is the epoch ``model`` resumes in the middle of.

    Callbacks that act at epoch begin (like ``decay``) use it to leave alone state the
    checkpoint already holds for that epoch.

    Example:
        >>> # model restored from ckpt-3-50.keras: 50 batches into epoch index 2
        >>> is_resumed_partial_epoch(model, 2)  # doctest: +SKIP
        True
    """
    state = resume_state(model)
    return state is not None and state.batch > 0 and epoch == state.epoch


def finish_resumed_epoch(model, epoch: int) -> None:
    """Forgets how ``model`` was restored once ``epoch`` (its resumed epoch or later) ends."""
    state = resume_state(model)
    if state is not None and epoch >= state.epoch:
        forget_resume(model)


def forget_resume(model) -> None:
    """Forgets how ``model`` was restored: a later ``fit`` starts where the last one ended."""
    current = process.state()
    with current.lock, contextlib.suppress(TypeError):
        current.resumed.pop(model, None)


def _remember_resume(model, state: ResumeState) -> None:
    current = process.state()
    with current.lock:
        current.resumed[model] = state


def set_data_position(epoch: int, skip: int) -> None:
    """Tells tfdist.data pipelines which epoch starts and how many batches to skip."""
    # Imported here: tfdist.data is only needed once training starts.
    from tfdist import data

    data.set_position(epoch, batch=skip)
    # Only seeded tfdist.data pipelines can skip; say so when none exists, since the
    # alternative is a silent replay of the batches already trained.
    if skip and not len(process.state().pipelines):
        logger.warning(
            "tfdist: the resumed epoch %d should skip its first %d batch(es), but no seeded "
            "tfdist.data pipeline exists, so they will be trained again. Build the training "
            "data with tfdist.data.pipeline(..., seed=...) for exact resume.",
            epoch,
            skip,
        )


# --------------------------------------------------------------------------- make_or_restore


def make_or_restore(build_fn: Callable, checkpoint_dir: str | os.PathLike, *, strategy=None):
    """Builds the model and restores the newest checkpoint that loads, in the strategy scope.

    ``build_fn`` is called inside the scope of ``strategy`` (the current one by
    default, see ``tfdist.strategy()``) and must return a compiled model. If
    ``checkpoint_dir`` holds checkpoints, the newest one that reads back intact is loaded
    into that model: weights, optimizer state (iterations, slots, learning rate) and the
    dropout RNG state. A truncated or corrupt newest checkpoint is skipped with a warning
    naming it (and renamed to ``*.keras.corrupt`` so it is kept but not tried again);
    the previous one is used. A missing or empty directory gives the fresh model.

    Pass the returned ``initial_epoch`` to ``fit`` together with
    ``tfdist.callbacks.checkpoint(checkpoint_dir)`` (or ``standard``): when the
    checkpoint was taken in the middle of an epoch, that callback makes the data
    pipeline skip the batches already trained.

    Args:
        build_fn: no-argument callable returning a compiled ``keras.Model``.
        checkpoint_dir: the directory the checkpoint callback writes to.
        strategy: the ``tf.distribute.Strategy`` to build in; the current one when None.

    Returns:
        ``(model, initial_epoch)``: ``initial_epoch`` is 0 for a fresh model.

    Raises:
        TypeError, ValueError: ``build_fn`` is not callable or does not return a compiled
            model; a checkpoint reads back intact but does not fit the model (another
            architecture or optimizer); nothing is deleted in either case.
        NotADirectoryError: ``checkpoint_dir`` is a file.
        PermissionError: the chief cannot write to ``checkpoint_dir``.

    Example:
        >>> def build_and_compile():                                  # doctest: +SKIP
        ...     model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])
        ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        ...     return model
        >>> model, initial_epoch = make_or_restore(build_and_compile, "ckpt/")  # doctest: +SKIP
        >>> model.fit(train, epochs=3, initial_epoch=initial_epoch,   # doctest: +SKIP
        ...           callbacks=tfdist.callbacks.standard("ckpt/"))
    """
    where = "make_or_restore"
    if not callable(build_fn):
        raise TypeError(
            validate.message(
                where,
                "build_fn",
                "a callable that returns a compiled keras.Model",
                build_fn,
                "Pass the function itself, e.g. make_or_restore(build_and_compile, 'ckpt/').",
            )
        )
    role = saving.write_role()
    directory = check_dir(checkpoint_dir, where, writable=role.is_chief)
    strategy = distribute.current(strategy)
    with strategy.scope():
        model = _build(build_fn, where)
        chosen = _newest_readable(directory, role)
        # Agree before restoring: a restore may create variables (collectives), and
        # workers that disagree must fail together rather than wait on each other.
        check_workers_agree(strategy, chosen, directory)
        if chosen is None:
            logger.info("tfdist: no checkpoint in %s; starting from a fresh model", directory)
            return model, 0
        state = _restore_into(model, *chosen)
    _remember_resume(model, state)
    logger.info(
        "tfdist: restored %s (epoch %d, %d batch(es) into it, step %s)",
        state.path,
        state.epoch,
        state.batch,
        state.step,
    )
    return model, state.epoch


def _build(build_fn: Callable, where: str):
    """Calls ``build_fn`` (in the scope) and checks that it returned a compiled model."""
    model = build_fn()
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"{where}: build_fn must return a compiled keras.Model. Received: build_fn "
            f"returned {model!r} (type {type(model).__name__}). Return the model after "
            "model.compile(...)."
        )
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            f"{where}: build_fn must return a compiled model (with an optimizer), so its "
            f"optimizer state can be restored. Received: model {model.name!r}, not compiled. "
            "Call model.compile(optimizer=..., loss=...) inside build_fn and return the model."
        )
    if model.built and not model.optimizer.built:
        # Always, not only before a restore: under multi-worker training, creating
        # variables runs collectives, and every worker must run the same ones
        # whatever it finds on disk. Keras would build them in the first step anyway.
        model.optimizer.build(model.trainable_variables)
    return model


def _newest_readable(directory: str, role: saving.WriteRole) -> tuple[str, dict] | None:
    """``(path, info)`` of the newest checkpoint that reads back intact, or None."""
    for _position, path in reversed(list_checkpoints(directory)):
        try:
            return path, inspect_archive(path)
        except CorruptCheckpoint as err:
            _skip_corrupt(path, str(err), role)
    return None


def _skip_corrupt(path: str, reason: str, role: saving.WriteRole) -> None:
    """Warns, and on the chief renames the file ``*.corrupt``: kept, never tried again."""
    warnings.warn(
        f"tfdist.make_or_restore: skipping checkpoint {path!r}, which does not read back "
        f"({reason}); falling back to the previous checkpoint.",
        RuntimeWarning,
        stacklevel=4,  # the caller of make_or_restore
    )
    logger.warning("tfdist: skipping unreadable checkpoint %s (%s)", path, reason)
    if role.is_chief:
        with contextlib.suppress(OSError):
            os.replace(path, path + CORRUPT_SUFFIX)


# --------------------------------------------------------------------------- into a model


def _restore_into(model, path: str, info: dict) -> ResumeState:
    """Loads weights, optimizer state and RNG state of ``path`` into ``model``."""
    _build_from_archive(model, path, info)
    _load_weights(model, path)
    meta = info["resume"]
    if meta is None:
        logger.info(
            "tfdist: %s has no tfdist resume metadata (written by another tool): weights and "
            "optimizer state restored, dropout RNG state not.",
            path,
        )
        position = parse_checkpoint_name(os.path.basename(path))
        return ResumeState(path, position.epoch, position.batch, None)
    set_rng_state(model, meta.get("rng", []), path)
    step = meta.get("step")
    return ResumeState(path, meta["epoch"], meta["batch"], int(step) if step is not None else None)


def _build_from_archive(model, path: str, info: dict) -> None:
    """Builds the model (from the archive's build config) and its optimizer's variables."""
    if not model.built:
        build_config = info["config"].get("build_config")
        if build_config:
            model.build_from_config(build_config)
        if not model.built:
            raise ValueError(
                f"make_or_restore: the model from build_fn is not built and {path!r} does "
                "not say how to build it. Give the model a keras.Input, or call "
                "model.build(input_shape) inside build_fn."
            )
    if not model.optimizer.built:
        # Keras skips optimizer state, with only a warning, when the optimizer has no
        # variables yet: build them so that iterations and slots are restored.
        model.optimizer.build(model.trainable_variables)


def _load_weights(model, path: str) -> None:
    """``model.load_weights(path)``; a checkpoint that does not fit is an error, not a warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.load_weights(path)
        except (ValueError, KeyError, TypeError) as err:
            # The bytes are intact (checked before): the model is not the one that
            # wrote them. Starting fresh would later prune the real checkpoints.
            said = " ".join(str(err).split())
            raise ValueError(
                f"make_or_restore: checkpoint {path!r} reads back intact but does not fit "
                "the model build_fn returns (another architecture or optimizer). Restore "
                "with the build_fn that wrote it, or pass a new checkpoint_dir; nothing was "
                f"deleted. Keras said: {said[:400]}"
            ) from err
    for warning in caught:
        if "Skipping variable loading for optimizer" in str(warning.message):
            raise ValueError(
                f"make_or_restore: the optimizer state in {path!r} does not fit the optimizer "
                f"of the model from build_fn ({warning.message}). Use the optimizer that "
                "wrote the checkpoint, or a new checkpoint_dir."
            )
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
