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

from tfdist import backends, distribute
from tfdist.checkpoint.agreement import check_workers_agree
from tfdist.checkpoint.archive import CorruptCheckpoint, inspect_archive, weights_file
from tfdist.checkpoint.names import (
    check_save_target,
    checkpoint_entries,
    parse_checkpoint_name,
    quarantine_path,
)
from tfdist.checkpoint.rng import set_rng_state
from tfdist.checkpoint.sharded import (
    assign_sharded,
    read_sharded,
    saved_variables,
    sharded_entries,
)
from tfdist.core import atomic, process, storage, validate

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
    dropout RNG state. A newest checkpoint that cannot be read back, for any reason of the
    file (truncated, garbage, missing members, unreadable, a dangling link...), is skipped
    with a warning naming it and renamed ``*.keras.corrupt`` (kept, never tried again);
    the previous one is used, or the fresh model when none reads back. A missing or
    empty directory gives the fresh model.

    Pass the returned ``initial_epoch`` to ``fit`` together with
    ``tfdist.callbacks.checkpoint(checkpoint_dir)`` (or ``standard``): when the
    checkpoint was taken in the middle of an epoch, that callback makes the data
    pipeline skip the batches already trained.

    Args:
        build_fn: no-argument callable returning a compiled ``keras.Model``.
        checkpoint_dir: the directory the checkpoint callback writes to: a local path or
            a URL (``gs://``, ``s3://``, any fsspec filesystem; see ``tfdist.core.storage``),
            whose candidate is downloaded once, checked and loaded from that copy.
        strategy: the ``tf.distribute.Strategy`` to build in; the current one when None.

    Returns:
        ``(model, initial_epoch)``: ``initial_epoch`` is 0 for a fresh model.

    Raises:
        TypeError, ValueError: ``build_fn`` is not callable or does not return a compiled
            model; a checkpoint reads back intact but does not fit the model (another
            architecture or optimizer); nothing is deleted in either case.
        NotADirectoryError: ``checkpoint_dir`` is a file.
        PermissionError: the chief cannot write to ``checkpoint_dir``, or a file with a
            checkpoint's name is immutable (a save would fail after training).
        IsADirectoryError: a directory has a checkpoint's name (a save would fail).

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
    _check_build_fn(build_fn, where)
    role = atomic.write_role()
    # Before building: a path that would make a later save fail is reported now.
    directory = check_save_target(checkpoint_dir, where, writable=role.is_chief)
    strategy = distribute.current(strategy)
    with strategy.scope(), contextlib.ExitStack() as downloads:
        model = _build(build_fn, where)
        chosen = _newest_readable(directory, role, downloads, model)
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


def _check_build_fn(build_fn, where: str) -> None:
    """A function that builds the model, not a model (which is callable too)."""
    hint = "Pass the function itself, e.g. make_or_restore(build_and_compile, 'ckpt/')."
    if isinstance(build_fn, keras.layers.Layer):
        what = "a function that builds and compiles the model, not a model instance"
        hint = (
            "Move the model's construction and compile() into a function that returns it, "
            "and pass that function: make_or_restore(build_and_compile, 'ckpt/') (it is "
            "called inside the strategy scope, where the variables must be created)."
        )
        raise TypeError(validate.message(where, "build_fn", what, build_fn, hint))
    if not callable(build_fn):
        what = "a callable that returns a compiled keras.Model"
        raise TypeError(validate.message(where, "build_fn", what, build_fn, hint))


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


def _newest_readable(
    directory: str, role: atomic.WriteRole, downloads: contextlib.ExitStack, model
) -> tuple[str, dict] | None:
    """``(path, info)`` of the newest checkpoint that reads back intact, or None.

    Archives and sharded checkpoints (``.orbax`` directories, JAX) are candidates alike,
    newest position first. Deterministic given the bytes, so workers on shared storage
    skip the same files.
    """
    return _newest(
        directory,
        role,
        lambda path: inspect_copy(path, downloads),
        lambda path: _read_sharded(path, model),
    )


def _newest(
    directory: str,
    role: atomic.WriteRole,
    inspect: Callable,
    inspect_sharded: Callable | None,
    where: str = "tfdist.make_or_restore",
) -> tuple[str, dict] | None:
    """The one restore rule: newest first, a candidate its reader rejects
    (``CorruptCheckpoint``) skipped with a warning naming ``where`` and, on the chief,
    renamed ``*.corrupt``. Sharded candidates only with ``inspect_sharded``."""
    for _position, path, sharded in reversed(_candidates(directory, inspect_sharded is not None)):
        try:
            if sharded:
                assert inspect_sharded is not None  # _candidates lists them only then
                return path, inspect_sharded(path)
            return path, inspect(path)
        except CorruptCheckpoint as err:
            _skip_corrupt(path, str(err), role, where)
    return None


def _candidates(directory: str, with_sharded: bool = True) -> list[tuple]:
    """``(position, path, sharded)`` of every restore candidate, oldest first."""
    found = [(position, path, False) for position, path in checkpoint_entries(directory)]
    if not with_sharded:
        return found
    sharded = sharded_entries(directory)
    if sharded and not backends.get().saves_sharded():
        logger.warning(
            "tfdist: %s holds %d sharded checkpoint(s) (.orbax, written on JAX), which the "
            "%s backend cannot read; they are left alone.",
            directory,
            len(sharded),
            backends.name(),
        )
        return found
    # At one position the sharded checkpoint sorts last: it is preferred.
    every = found + [(position, path, True) for position, path in sharded]
    return sorted(every, key=lambda entry: (entry[0], entry[2]))


def _read_sharded(path: str, model) -> dict:
    if not model.built:
        raise ValueError(
            f"make_or_restore: the model from build_fn is not built, and the sharded "
            f"checkpoint {path!r} is restored into the variables it has. Give the model a "
            "keras.Input, or call model.build(input_shape) inside build_fn."
        )
    return read_sharded(path, saved_variables(model))


def inspect_copy(path: str, downloads: contextlib.ExitStack) -> dict:
    """``inspect_archive(path)``; a URL is downloaded once, checked, and its local copy
    kept (``info["local"]``, until ``downloads`` closes) so the restore loads those bytes.

    A failed download (network, credentials) is raised as it is, not counted against the
    file: quarantining a good checkpoint on a transient error would lose it.
    """
    if not storage.is_url(path):
        return inspect_archive(path, keep=downloads)
    with contextlib.ExitStack() as attempt:
        try:
            local = attempt.enter_context(storage.local_copy(path))
        except FileNotFoundError:
            raise CorruptCheckpoint("gone before it could be read") from None
        info = dict(inspect_archive(local, keep=attempt), local=local)
        downloads.enter_context(attempt.pop_all())
    return info


def _skip_corrupt(path: str, reason: str, role: atomic.WriteRole, where: str) -> None:
    """Warns once (one RuntimeWarning, no second log line), and on the chief renames the
    file ``*.corrupt``: kept, never tried again."""
    warnings.warn(
        f"{where}: skipping checkpoint {path!r}, which does not read back "
        f"({reason}); falling back to the previous checkpoint.",
        RuntimeWarning,
        stacklevel=5,  # the caller of make_or_restore (or of Checkpointer.restore)
    )
    if not role.is_chief:
        return
    target = quarantine_path(path)
    try:
        storage.move(path, target)
    except FileNotFoundError:
        pass  # gone already (another process moved it)
    except OSError as err:
        # Not fatal: it is skipped again at the next start, and a save onto its name
        # is checked at train begin (check_save_target).
        logger.warning("tfdist: could not move %s to %s: %s", path, target, err)


# --------------------------------------------------------------------------- into a model


def _restore_into(model, path: str, info: dict) -> ResumeState:
    """Loads weights, optimizer state and RNG state of ``path`` into ``model``."""
    if info.get("sharded"):
        assign_sharded(saved_variables(model), info)
    else:
        _build_from_archive(model, path, info)
        _load_weights(model, path, info)
    meta = info["resume"]
    if meta is None:
        logger.info(
            "tfdist: %s has no tfdist resume metadata (written by another tool): weights and "
            "optimizer state restored, dropout RNG state not.",
            path,
        )
        position = parse_checkpoint_name(os.path.basename(path))
        assert position is not None  # a restore candidate's path: a checkpoint name
        return ResumeState(path, position.epoch, position.batch, None)
    set_rng_state(model, meta.get("rng", []), path)
    step = meta.get("step")
    return ResumeState(path, meta["epoch"], meta["batch"], int(step) if step is not None else None)


def _build_from_archive(model, path: str, info: dict) -> None:
    """Builds the model (from the archive's build config) and its optimizer's variables."""
    if not model.built:
        build_config = info["config"].get("build_config")
        if build_config:
            try:
                model.build_from_config(build_config)
            except Exception as err:  # noqa: BLE001 - the file reads back: it does not fit
                raise _does_not_fit(model, path, err) from err
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


def _does_not_fit(model, path: str, err: Exception) -> ValueError:
    said = " ".join(f"{type(err).__name__}: {err}".split())
    return ValueError(
        f"make_or_restore: checkpoint {path!r} reads back intact but does not fit the "
        f"model build_fn returns ({model.name!r}: another architecture or optimizer). "
        "Restore with the build_fn that wrote it, or pass a new checkpoint_dir; nothing "
        f"was deleted. Keras said: {said[:400]}"
    )


def _changed_while_restoring(path: str, err: OSError) -> RuntimeError:
    # It read back whole a moment before: the file changed or the storage fails. Not
    # skipped here (the workers already agreed on it); the next start reads it again.
    return RuntimeError(
        f"make_or_restore: checkpoint {path!r} read back intact, then failed to load "
        f"({type(err).__name__}: {err}); it changed meanwhile or the storage is failing. "
        "Restart the job: a checkpoint that no longer reads back is then skipped."
    )


def _load_weights(model, path: str, info: dict) -> None:
    """``model.load_weights`` of ``path``'s checked bytes; not fitting is an error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # The weights member inspect_archive checked and copied out (or a local copy).
            with weights_file(info.get("local", path), info) as weights:
                model.load_weights(weights)
        except MemoryError:
            raise
        except OSError as err:
            raise _changed_while_restoring(path, err) from err
        except Exception as err:  # noqa: BLE001 - the file reads back: it does not fit
            # The file read back whole (inspect_archive): the model is not the one that
            # wrote it. Starting fresh would later prune the real checkpoints.
            raise _does_not_fit(model, path, err) from err
    for warning in caught:
        if "Skipping variable loading for optimizer" in str(warning.message):
            raise ValueError(
                f"make_or_restore: the optimizer state in {path!r} does not fit the optimizer "
                f"of the model from build_fn ({warning.message}). Use the optimizer that "
                "wrote the checkpoint, or a new checkpoint_dir."
            )
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


# --------------------------------------------------------------------------- reusable by loops


def newest_readable(
    directory: str,
    role: atomic.WriteRole,
    inspect: Callable = inspect_archive,
    inspect_sharded: Callable | None = None,
    where: str = "tfdist.make_or_restore",
):
    """``(path, info)`` of the newest checkpoint ``inspect`` reads back, or None.

    ``make_or_restore``'s rule for any reader (``tfdist.loops.Checkpointer``): newest first,
    a file ``inspect`` rejects (``CorruptCheckpoint``) is skipped with a warning and, on the
    chief, renamed ``*.corrupt``. With ``inspect_sharded`` (JAX), ``.orbax`` directories
    are candidates too, read by it (``read_sharded``). ``where`` names the caller in the
    warning. For a URL ``directory``, ``inspect`` must read URLs (``inspect_copy`` does).

    Raises:
        ValueError: ``directory`` is a URL and ``inspect`` is ``inspect_archive``, which
            reads local files only (every good checkpoint would fail it and be moved aside).

    Example:
        >>> newest_readable("ckpt/", atomic.write_role())  # doctest: +SKIP
        ('/abs/ckpt/ckpt-1-4.keras', {'config': {...}, 'resume': {...}})
    """
    if storage.is_url(directory) and inspect is inspect_archive:
        raise ValueError(
            "newest_readable: inspect_archive reads a local path only, and directory is a "
            f"URL. Received: directory={directory!r}. Pass inspect=lambda path: "
            "inspect_copy(path, downloads), which downloads each candidate once."
        )
    return _newest(directory, role, inspect, inspect_sharded, where)


__all__ += ["inspect_copy", "newest_readable"]
