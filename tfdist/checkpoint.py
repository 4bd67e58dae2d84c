"""Restartable training: ``make_or_restore``, the checkpoint callback, exact resume, preemption.

A restartable script is a plain Keras script::

    model, initial_epoch = tfdist.make_or_restore(build_and_compile, "ckpt/")
    model.fit(train, epochs=12, initial_epoch=initial_epoch,
              callbacks=[tfdist.callbacks.checkpoint("ckpt/", save_freq=100)])

Checkpoints are ``ckpt-{epoch}.keras`` after an epoch (the Keras guides' naming; they
load with ``keras.models.load_model``) and ``ckpt-{epoch}-{batch}.keras`` after
``batch`` batches of epoch ``epoch`` (1-based, like Keras's ``{epoch}``/``{batch}``).
Each archive also carries ``tfdist/resume.json``: the position (epoch, batches done),
the global step and the dropout RNG state (Keras's ``SeedGenerator`` variables, which
``.keras``/``.weights.h5`` files leave out). Restoring puts weights, optimizer state
(iterations, slots, learning rate) and RNG state back, and tells the data pipeline
(``tfdist.data.set_position``) to skip the batches already trained in the resumed
epoch, so the resumed job neither replays nor skips a batch (Keras's
``BackupAndRestore`` restarts an interrupted epoch at batch 0).

Writes are atomic (staging file in the same directory, fsync, rename) and only the
chief's files land in the checkpoint directory. On SIGTERM the callback saves at the
next step boundary (all workers agree on which) and exits with
``tfdist.cluster.RESTART_EXIT_CODE`` (75), which ``tfdist launch`` treats as "restart me".

Example:
    >>> model, initial_epoch = make_or_restore(build_and_compile, "ckpt/")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
import warnings
import weakref
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from tfdist import cluster as _cluster
from tfdist import saving as _saving

__all__ = [
    "Position",
    "ResumeState",
    "ResumableCheckpoint",
    "make_or_restore",
    "list_checkpoints",
    "checkpoint_name",
    "parse_checkpoint_name",
    "resume_state",
    "is_resumed_partial_epoch",
    "read_resume_metadata",
    "RESUME_MEMBER",
    "CORRUPT_SUFFIX",
]

logger = logging.getLogger(__name__)

RESUME_MEMBER = "tfdist/resume.json"
_FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^ckpt-(\d+)(?:-(\d+))?\.keras$")
# Suffix given to a checkpoint that does not load, so that it is kept for inspection but
# neither restored nor counted (or pruned) as a checkpoint again.
CORRUPT_SUFFIX = ".corrupt"


# --------------------------------------------------------------------------- positions


@dataclass(frozen=True, order=True)
class Position:
    """Where training stands: ``batch`` batches done in (0-based) epoch ``epoch``.

    ``Position(3, 0)`` is "3 epochs done" (file ``ckpt-3.keras``); ``Position(2, 50)``
    is "50 batches into the third epoch" (file ``ckpt-3-50.keras``).
    """

    epoch: int
    batch: int = 0

    @property
    def filename(self) -> str:
        """The checkpoint file name of this position."""
        return checkpoint_name(self.epoch, self.batch)


def checkpoint_name(epoch: int, batch: int = 0) -> str:
    """The file name of the checkpoint ``batch`` batches into 0-based epoch ``epoch``.

    Example:
        >>> checkpoint_name(1), checkpoint_name(2, 50)
        ('ckpt-1.keras', 'ckpt-3-50.keras')
    """
    for name, value in (("epoch", epoch), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"checkpoint_name: {name} must be an int >= 0. Received: {name}={value!r}"
            )
    return f"ckpt-{epoch}.keras" if batch == 0 else f"ckpt-{epoch + 1}-{batch}.keras"


def parse_checkpoint_name(name: str) -> Position | None:
    """The position a checkpoint file name stands for, or None for other names.

    Example:
        >>> parse_checkpoint_name("ckpt-3-50.keras")
        Position(epoch=2, batch=50)
        >>> parse_checkpoint_name("notes.txt") is None
        True
    """
    match = _NAME_RE.match(name)
    if not match:
        return None
    epoch, batch = int(match.group(1)), match.group(2)
    if batch is None:
        return Position(epoch, 0)
    if epoch < 1 or int(batch) < 1:
        return None
    return Position(epoch - 1, int(batch))


def list_checkpoints(checkpoint_dir: str | os.PathLike) -> list[tuple[Position, str]]:
    """The checkpoints in a directory as (position, path), oldest first.

    Staging files, quarantined ``.corrupt`` files and other names are ignored; a missing
    directory has none.

    Example:
        >>> list_checkpoints("ckpt/")  # doctest: +SKIP
        [(Position(epoch=1, batch=0), 'ckpt/ckpt-1.keras')]
    """
    directory = os.fspath(checkpoint_dir)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        position = parse_checkpoint_name(name)
        path = os.path.join(directory, name)
        if position is not None and os.path.isfile(path):
            found.append((position, path))
    return sorted(found)


# --------------------------------------------------------------------------- resume state


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


_resumed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def resume_state(model) -> ResumeState | None:
    """How ``model`` was restored by ``make_or_restore``, until its resumed epoch ends.

    Example:
        >>> model, epoch = make_or_restore(build, "ckpt/")  # doctest: +SKIP
        >>> resume_state(model).batch                        # doctest: +SKIP
        50
    """
    try:
        return _resumed.get(model)
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


def _finish_resumed_epoch(model, epoch: int) -> None:
    state = resume_state(model)
    if state is not None and epoch >= state.epoch:
        _resumed.pop(model, None)


def read_resume_metadata(path: str | os.PathLike) -> dict | None:
    """The ``tfdist/resume.json`` of a checkpoint archive, or None when it has none.

    Example:
        >>> read_resume_metadata("ckpt/ckpt-3-50.keras")["step"]  # doctest: +SKIP
        250
    """
    data = _saving.read_archive_member(os.fspath(path), RESUME_MEMBER)
    return None if data is None else json.loads(data.decode("utf-8"))


class _CorruptCheckpoint(Exception):
    """The archive cannot be read back (truncated, bad CRC, missing members)."""


def _inspect_archive(path: str) -> dict | None:
    """Checks a checkpoint's bytes end to end; returns its resume metadata (or None)."""
    try:
        with zipfile.ZipFile(path, "r") as zf:
            bad = zf.testzip()  # reads every member and checks its CRC
            if bad is not None:
                raise _CorruptCheckpoint(f"member {bad!r} fails its CRC check")
            names = set(zf.namelist())
            missing = {"config.json", "model.weights.h5"} - names
            if missing:
                raise _CorruptCheckpoint(f"missing {sorted(missing)}")
            config = json.loads(zf.read("config.json").decode("utf-8"))
            meta = None
            if RESUME_MEMBER in names:
                meta = json.loads(zf.read(RESUME_MEMBER).decode("utf-8"))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as err:
        raise _CorruptCheckpoint(f"{type(err).__name__}: {err}") from None
    if meta is not None and not (
        isinstance(meta, dict)
        and isinstance(meta.get("epoch"), int)
        and isinstance(meta.get("batch"), int)
    ):
        raise _CorruptCheckpoint(f"{RESUME_MEMBER} is malformed: {meta!r}")
    return {"config": config, "resume": meta}


# --------------------------------------------------------------------------- validation


def _check_dir(checkpoint_dir, where: str, *, writable: bool) -> str:
    """Validates a checkpoint directory; on the chief (``writable``) creates and probes it."""
    if (
        isinstance(checkpoint_dir, bool)
        or not isinstance(checkpoint_dir, (str, os.PathLike))
        or not os.fspath(checkpoint_dir)
    ):
        raise TypeError(
            f"{where}: checkpoint_dir must be a directory path (str or os.PathLike). "
            f"Received: checkpoint_dir={checkpoint_dir!r}"
        )
    directory = os.path.abspath(os.fspath(checkpoint_dir))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(
            f"{where}: checkpoint_dir is a file, not a directory. "
            f"Received: checkpoint_dir={os.fspath(checkpoint_dir)!r}. Pass a directory "
            "path (it is created when missing); the file was left untouched."
        )
    if not writable:
        return directory
    try:
        os.makedirs(directory, exist_ok=True)
        # A real write, not os.access: permission bits do not tell the whole story
        # (read-only mounts, root, ACLs). The name matches the staging pattern, so a
        # crash here leaves nothing that the next start does not clean up.
        fd, probe = tempfile.mkstemp(prefix=f".tmp-{_saving._staging_tag()}-probe-", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise PermissionError(
            f"{where}: checkpoint_dir is not writable ({err.strerror or err}). "
            f"Received: checkpoint_dir={os.fspath(checkpoint_dir)!r}. Pass a directory this "
            "process can create files in; nothing in it was changed."
        ) from None
    return directory


def _positive_int_or(value, allowed: tuple, name: str, where: str, hint: str):
    if value in allowed and not isinstance(value, bool):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be {hint}. Received: {name}={value!r}")
    return value


# --------------------------------------------------------------------------- RNG state


def _seed_generators(model) -> list:
    """The model's ``keras.random.SeedGenerator``s (dropout, noise...), in layer order."""
    found, seen = [], set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        for generator in getattr(layer, "_seed_generators", ()):
            if id(generator) not in seen:
                seen.add(id(generator))
                found.append(generator)
    return found


def _numpy(value) -> np.ndarray:
    """A variable's or tensor's value on the host (``tf.Variable.numpy``, no array protocol)."""
    value = getattr(value, "value", value)  # keras.Variable -> the backend variable
    if hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(keras.ops.convert_to_numpy(value))


def _rng_state(model) -> list[list[int]]:
    return [_numpy(g.state).tolist() for g in _seed_generators(model)]


def _set_rng_state(model, states: list, path: str) -> None:
    generators = _seed_generators(model)
    if len(generators) != len(states):
        raise ValueError(
            f"make_or_restore: checkpoint {path!r} holds {len(states)} random-seed "
            f"state(s) but the model from build_fn has {len(generators)} (dropout or "
            "other random layers differ). Restore with the build_fn that wrote it, or use a "
            "new checkpoint_dir."
        )
    for generator, state in zip(generators, states, strict=True):
        generator.state.assign(np.asarray(state, dtype=generator.state.dtype))


# --------------------------------------------------------------------------- make_or_restore


def _build(build_fn: Callable, where: str):
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
    return model


def _restore_into(model, path: str, info: dict) -> ResumeState:
    """Loads weights, optimizer state and RNG state of ``path`` into ``model``."""
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
    meta = info["resume"]
    position = parse_checkpoint_name(os.path.basename(path))
    if meta is None:
        logger.info(
            "tfdist: %s has no tfdist resume metadata (written by another tool): weights and "
            "optimizer state restored, dropout RNG state not.",
            path,
        )
        return ResumeState(path, position.epoch, position.batch, None)
    _set_rng_state(model, meta.get("rng", []), path)
    step = meta.get("step")
    return ResumeState(path, meta["epoch"], meta["batch"], int(step) if step is not None else None)


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
            f"{where}: build_fn must be a callable that returns a compiled keras.Model. "
            f"Received: build_fn={build_fn!r}. Pass the function itself, e.g. "
            "make_or_restore(build_and_compile, 'ckpt/')."
        )
    role = _saving.write_role()
    directory = _check_dir(checkpoint_dir, where, writable=role.is_chief)
    from tfdist.strategy import _current

    strategy = _current(strategy)
    with strategy.scope():
        model = _build(build_fn, where)
        if model.built and not model.optimizer.built:
            # Always, not only before a restore: under multi-worker training, creating
            # variables runs collectives, and every worker must run the same ones
            # whatever it finds on disk. Keras would build them in the first step anyway.
            model.optimizer.build(model.trainable_variables)
        chosen = None
        for _position, path in reversed(list_checkpoints(directory)):
            try:
                chosen = (path, _inspect_archive(path))
                break
            except _CorruptCheckpoint as err:
                _skip_corrupt(path, str(err), role)
        # Agree before restoring: a restore may create variables (collectives), and
        # workers that disagree must fail together rather than wait on each other.
        _check_workers_agree(strategy, chosen and _archive_position(*chosen), directory)
        if chosen is None:
            logger.info("tfdist: no checkpoint in %s; starting from a fresh model", directory)
            return model, 0
        state = _restore_into(model, *chosen)
        _resumed[model] = state
        logger.info(
            "tfdist: restored %s (epoch %d, %d batch(es) into it, step %s)",
            state.path,
            state.epoch,
            state.batch,
            state.step,
        )
        return model, state.epoch


def _archive_position(path: str, info: dict) -> tuple[int, int, int]:
    """(epoch, batch, step) of an inspected archive, from its metadata or its name."""
    meta = info["resume"]
    if meta is not None:
        return meta["epoch"], meta["batch"], int(meta.get("step") or 0)
    position = parse_checkpoint_name(os.path.basename(path))
    return position.epoch, position.batch, 0


def _check_workers_agree(strategy, position: tuple | None, directory: str) -> None:
    """Under multi-worker training, fails unless every worker found the same checkpoint.

    Workers that restore different checkpoints (or some none at all: a checkpoint
    directory on local disks instead of shared storage) would train diverging replicas
    or wait forever in a collective. One small all-gather of positions tells.
    """
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return
    if not strategy.extended._in_multi_worker_mode():
        return
    mine = [-1, -1, -1] if position is None else list(position)
    value = tf.constant([mine], tf.int64)
    # Every replica contributes its worker's position; gather them all on every worker.
    positions = strategy.gather(strategy.run(lambda: tf.identity(value)), axis=0).numpy()
    seen = sorted({tuple(row) for row in positions.tolist()})
    if len(seen) > 1:
        raise RuntimeError(
            "make_or_restore: the workers found different checkpoints (epoch, batch, step): "
            f"{seen}; (-1, -1, -1) means no checkpoint. Received: checkpoint_dir="
            f"{directory!r}. Put checkpoint_dir on storage every worker shares (all workers "
            "read the chief's checkpoints)."
        )


def _skip_corrupt(path: str, reason: str, role: _saving.WriteRole) -> None:
    warnings.warn(
        f"tfdist.make_or_restore: skipping checkpoint {path!r}, which does not read back "
        f"({reason}); falling back to the previous checkpoint.",
        RuntimeWarning,
        stacklevel=3,
    )
    logger.warning("tfdist: skipping unreadable checkpoint %s (%s)", path, reason)
    if role.is_chief:
        with contextlib.suppress(OSError):
            os.replace(path, path + CORRUPT_SUFFIX)


# --------------------------------------------------------------------------- data position


def _set_data_position(epoch: int, skip: int) -> None:
    """Tells tfdist.data pipelines which epoch starts and how many batches to skip."""
    # Imported here: tfdist.data is only needed once training starts.
    from tfdist import data as _data

    _data.set_position(epoch, skip)
    # Only seeded tfdist.data pipelines can skip; say so when none exists, since the
    # alternative is a silent replay of the batches already trained.
    if skip and not len(getattr(_data, "_registry", (None,))):
        logger.warning(
            "tfdist: the resumed epoch %d should skip its first %d batch(es), but no seeded "
            "tfdist.data pipeline exists, so they will be trained again. Build the training "
            "data with tfdist.data.pipeline(..., seed=...) for exact resume.",
            epoch,
            skip,
        )


def _phantom_prone_variables(model) -> list:
    """State a train step changes without reading its batch: the step counter, RNG states."""
    return [model.optimizer.iterations] + [g.state for g in _seed_generators(model)]


# When an epoch's data ends before Keras expected (a resumed epoch, which skips the
# batches already trained; or any dataset of unknown length: ``from_generator``,
# ``flat_map``...), Keras calls the train step once more; its ``get_next`` fails, but
# the ops that do not depend on the batch, the optimizer's ``iterations.assign_add(1)``
# and the dropout seed generators' advance, sometimes run anyway (a race). The weights
# are untouched, but the step counter (learning-rate schedules, Adam's bias correction)
# and the dropout masks of later epochs then differ from run to run, and a resumed job
# could not match an uninterrupted one. The checkpoint callback copies that state after
# every real step (on the device, no host sync) and puts the copy back at epoch end.


# --------------------------------------------------------------------------- preemption


class _PreemptionWatch:
    """Turns SIGTERM into "save at an agreed step, then exit with RESTART_EXIT_CODE".

    One process: the step is the next step boundary. Several workers: the first worker
    that gets SIGTERM publishes "save after step s+1" through TensorFlow's coordination
    service key-value store and waits (with a timeout) until every worker's watcher
    thread has acknowledged it; since synchronous workers are at most one step apart,
    every worker then saves after the same step. This is the protocol of
    ``tf.distribute.experimental.PreemptionCheckpointHandler``, which tfdist does not use
    directly: it saves only ``tf.train.Checkpoint``s, and its constructor probes the GCE
    metadata server over the network.
    """

    def __init__(
        self, *, multi_worker: bool, rank: int, num_workers: int, key: str, timeout: float
    ):
        self.multi_worker = multi_worker
        self.rank = rank
        self.num_workers = num_workers
        self.key = key
        self.timeout = timeout
        self._received = threading.Event()
        self._stop = threading.Event()
        self._target: int | None = None
        self._announced = False
        self._previous = None
        self._installed = False
        self._thread: threading.Thread | None = None

    @property
    def received(self) -> bool:
        return self._received.is_set()

    def start(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "tfdist: fit runs outside the main thread, so SIGTERM cannot be caught; "
                "preemption saves are off (periodic checkpoints still work)."
            )
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        if self.multi_worker:
            self._thread = threading.Thread(
                target=self._watch_peers, name=f"tfdist-preemption-{self.rank}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._installed = False
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _on_sigterm(self, signum, frame) -> None:
        if self._received.is_set():
            # A second SIGTERM: stop waiting for a save point and terminate as asked.
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._received.set()
        logger.warning("tfdist: SIGTERM received; saving at the next step, then exiting")

    def should_save(self, step: int) -> bool:
        """Whether to save and exit after ``step`` (the global step just finished)."""
        if not self.multi_worker:
            return self._received.is_set()
        if self._target is not None:
            return step >= self._target
        if self._received.is_set() and not self._announced:
            self._announced = True
            self._announce(step + 1)
        return self._target is not None and step >= self._target

    def _announce(self, step: int) -> None:
        from tensorflow.python.eager import context
        from tensorflow.python.framework import errors

        ctx = context.context()
        try:
            ctx.set_config_key_value(self.key, str(step))
        except errors.AlreadyExistsError:
            return  # another worker announced first; our watcher thread will read it
        deadline = time.monotonic() + self.timeout
        for rank in range(self.num_workers):
            remaining_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            try:
                ctx.get_config_key_value(f"{self.key}/ack/{rank}", timeout_in_ms=remaining_ms)
            except errors.OpError as err:
                logger.error(
                    "tfdist: worker %d did not acknowledge the preemption save step within "
                    "%.0f s (%s); saving and exiting anyway.",
                    rank,
                    self.timeout,
                    type(err).__name__,
                )
                self._target = step
                return

    def _watch_peers(self) -> None:
        from tensorflow.python.eager import context
        from tensorflow.python.framework import errors

        ctx = context.context()
        while not self._stop.is_set():
            try:
                value = ctx.get_config_key_value(self.key, timeout_in_ms=500)
            except errors.DeadlineExceededError:
                continue
            except errors.OpError as err:  # the coordination service is gone: job ending
                logger.debug("tfdist: preemption watcher stops: %s", err)
                return
            # Set the target before acknowledging: the announcer resumes training only
            # after every acknowledgement, so every worker knows the step in time.
            self._target = int(value)
            with contextlib.suppress(errors.OpError):
                ctx.set_config_key_value(f"{self.key}/ack/{self.rank}", "1")
            return


# --------------------------------------------------------------------------- the callback


class ResumableCheckpoint(keras.callbacks.ModelCheckpoint):
    """``ModelCheckpoint`` for restartable jobs: atomic, chief-only, exact resume, SIGTERM.

    Use ``tfdist.callbacks.checkpoint(...)`` to create one. Compared with Keras's
    ``ModelCheckpoint`` it writes each file atomically, lets only the chief's file land
    (other workers still run the save, for its collectives, into a temporary directory
    they remove), counts ``save_freq`` in global steps (aligned across restarts), stores
    the resume position and RNG state in each archive, prunes to ``max_to_keep``, drives
    ``tfdist.data.set_position`` for exact resume, and on SIGTERM saves and exits with
    ``RESTART_EXIT_CODE``. Every epoch end is saved; an int ``save_freq`` adds saves
    every that many steps.
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike,
        *,
        save_freq: str | int = "epoch",
        max_to_keep: int | None = 5,
        preemption: bool = True,
        preemption_timeout: float = 60.0,
        verbose: int = 0,
    ):
        where = "tfdist.callbacks.checkpoint"
        save_freq = _positive_int_or(
            save_freq, ("epoch",), "save_freq", where, "'epoch' or a positive int (steps)"
        )
        if max_to_keep is not None:
            _positive_int_or(max_to_keep, (), "max_to_keep", where, "None or a positive int")
        if not isinstance(preemption, bool):
            raise TypeError(
                f"{where}: preemption must be a bool. Received: preemption={preemption!r}"
            )
        if (
            isinstance(preemption_timeout, bool)
            or not isinstance(preemption_timeout, (int, float))
            or not preemption_timeout > 0
        ):
            raise ValueError(
                f"{where}: preemption_timeout must be a positive number of seconds. "
                f"Received: preemption_timeout={preemption_timeout!r}"
            )
        self.role = _saving.write_role()
        self.checkpoint_dir = _check_dir(checkpoint_dir, where, writable=self.role.is_chief)
        super().__init__(
            filepath=os.path.join(self.checkpoint_dir, "ckpt-{epoch}.keras"),
            save_freq=save_freq,
            verbose=verbose,
        )
        self.max_to_keep = max_to_keep
        self.preemption = preemption
        self.preemption_timeout = float(preemption_timeout)
        self._fits = 0
        self._watch: _PreemptionWatch | None = None
        self._resume: ResumeState | None = None
        self._first_epoch = True
        self._skip = 0
        self._step = 0
        self._step_at_epoch_begin = 0
        self._phantom_prone: list = []
        self._snapshot: list | None = None
        self._epoch_length: int | None = None  # batches in a full epoch, once seen
        self._quiet = None  # a warnings.catch_warnings() open during a resumed partial epoch
        self._current_epoch = 0

    # -- Keras hooks

    def on_train_begin(self, logs=None):
        self.role = _saving.write_role()
        if self.role.is_chief:
            os.makedirs(self.checkpoint_dir, exist_ok=True)
            _saving.remove_stale_staging(self.checkpoint_dir)
        self._resume = resume_state(self.model)
        if self._resume is not None and self._resume.step is not None:
            self._step = self._resume.step
        else:
            self._step = int(_numpy(self.model.optimizer.iterations))
        self._first_epoch = True
        self._fits += 1
        self._phantom_prone = _phantom_prone_variables(self.model)
        self._snapshot = None
        if self.preemption:
            info = _cluster.cluster_from_env()
            multi = info.is_multi_worker and isinstance(
                self.model.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy
            )
            self._watch = _PreemptionWatch(
                multi_worker=multi,
                rank=info.rank,
                num_workers=info.num_workers,
                key=f"tfdist/preempt/{self._fits}",
                timeout=self.preemption_timeout,
            )
            self._watch.start()

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        skip = 0
        resume = self._resume
        if self._first_epoch and resume is not None:
            if epoch == resume.epoch:
                skip = resume.batch
            else:
                logger.warning(
                    "tfdist: fit started at epoch %d but the model was restored from %s, "
                    "which resumes at epoch %d; pass initial_epoch=%d to fit (the value "
                    "make_or_restore returned).",
                    epoch,
                    resume.path,
                    resume.epoch,
                    resume.epoch,
                )
        self._first_epoch = False
        self._skip = skip
        self._step_at_epoch_begin = self._step
        if skip:
            # The resumed epoch ends early on purpose (its first batches were trained
            # before the restart); Keras's "Your input ran out of data" warning would
            # say otherwise.
            self._quiet = warnings.catch_warnings()
            self._quiet.__enter__()
            warnings.filterwarnings("ignore", message="Your input ran out of data")
        _set_data_position(epoch, skip)

    def on_train_batch_end(self, batch, logs=None):
        self._snapshot = [tf.identity(v.value) for v in self._phantom_prone]
        previous = self._step
        self._step = self._step_at_epoch_begin + batch + 1
        if self._watch is not None and self._watch.should_save(self._step):
            self._save_model(epoch=self._current_epoch, batch=batch, logs=logs)
            self._exit_for_restart()
        if self._due(previous, batch):
            self._save_model(epoch=self._current_epoch, batch=batch, logs=logs)

    def on_epoch_end(self, epoch, logs=None):
        self._end_quiet()
        if self._snapshot is not None:
            for variable, value in zip(self._phantom_prone, self._snapshot, strict=True):
                variable.assign(value)
            self._snapshot = None
        trained = self._step - self._step_at_epoch_begin
        if self._skip == 0 and trained > 0:
            self._epoch_length = trained
        self._save_model(epoch=epoch, batch=None, logs=logs)
        _finish_resumed_epoch(self.model, epoch)
        self._resume = None
        if self._watch is not None and self._watch.should_save(self._step):
            self._exit_for_restart()

    def on_train_end(self, logs=None):
        self._end_quiet()
        self._resume = None
        _resumed.pop(self.model, None)  # a later fit of this model starts where this one ended
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def _end_quiet(self) -> None:
        if self._quiet is not None:
            self._quiet.__exit__(None, None, None)
            self._quiet = None

    # -- ModelCheckpoint's extension points

    def _due(self, previous_step: int, batch: int) -> bool:
        if self.save_freq == "epoch":
            return False
        if self._step // self.save_freq <= previous_step // self.save_freq:
            return False
        steps = (self.params.get("steps") if self.params else None) or self._epoch_length
        # The epoch-end save follows right away: do not write the same state twice.
        return not (steps and self._skip + batch + 1 >= steps)

    def _should_save_on_batch(self, batch):  # ModelCheckpoint's hook; ours is _due
        return False

    def _position(self, epoch: int, batch: int | None) -> Position:
        if batch is None:
            return Position(epoch + 1, 0)
        done = self._skip + batch + 1
        steps = self.params.get("steps") if self.params else None
        if steps and done >= steps:
            return Position(epoch + 1, 0)
        return Position(epoch, done)

    def _get_file_path(self, epoch, batch, logs):
        return os.path.join(self.checkpoint_dir, self._position(epoch, batch).filename)

    def _save_model(self, epoch, batch, logs):
        position = self._position(epoch, batch)
        path = os.path.join(self.checkpoint_dir, position.filename)
        meta = {
            "format": _FORMAT_VERSION,
            "epoch": position.epoch,
            "batch": position.batch,
            "step": self._step,
            "rng": _rng_state(self.model),
            "replicas": self.model.distribute_strategy.num_replicas_in_sync,
            "keras": keras.__version__,
            "saved_at": time.time(),
        }
        started = time.perf_counter()
        with _saving.atomic_output(path, role=self.role) as staging:
            self.model.save(staging)
            _saving.add_archive_member(staging, RESUME_MEMBER, json.dumps(meta).encode())
        if not self.role.is_chief:
            return
        self._prune(keep=path)
        logger.info("tfdist: saved %s in %.2f s", path, time.perf_counter() - started)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: saved checkpoint {path}", flush=True)

    def _prune(self, keep: str) -> None:
        if self.max_to_keep is None:
            return
        found = list_checkpoints(self.checkpoint_dir)
        for _position, path in found[: max(len(found) - self.max_to_keep, 0)]:
            if os.path.abspath(path) != os.path.abspath(keep):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)

    def _exit_for_restart(self) -> None:
        if self._watch is not None:
            self._watch._stop.set()
        logger.warning(
            "tfdist: preemption checkpoint saved at step %d; exiting with code %d (restart me)",
            self._step,
            _cluster.RESTART_EXIT_CODE,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(_cluster.RESTART_EXIT_CODE)
