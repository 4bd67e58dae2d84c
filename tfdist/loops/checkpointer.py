"""``Checkpointer``: ``make_or_restore``'s guarantees for a custom training loop.

Atomic ``.keras`` archives written by the chief only (with the optimizer state, the step
and the RNG state in extra members), a damaged newest archive skipped for the previous
one, every worker agreeing on what it restores, the data pipeline moved to the step's
batch, and SIGTERM turned into a save at an agreed step and exit ``RESTART_EXIT_CODE``
(75). With ``sharded=True`` (JAX) the same, with sharded, asynchronous Orbax checkpoints
(``tfdist.checkpoint.sharded``: the writer and reader ``fit``'s callback and
``make_or_restore`` use): each worker writes its own shards, training goes on while
they are written, and a write a kill interrupts never becomes a checkpoint.

Example:
    >>> ckpt = Checkpointer("ckpt/", model=model, optimizer=opt, pipeline=train)  # doctest: +SKIP
    >>> step = ckpt.restore()                                                    # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
from typing import Any

import keras
import numpy as np

from tfdist import backends, compat
from tfdist import distribute as _distribute
from tfdist.checkpoint.agreement import check_workers_agree
from tfdist.checkpoint.archive import CorruptCheckpoint, resume_metadata, weights_file
from tfdist.checkpoint.names import check_save_target
from tfdist.checkpoint.preemption import PreemptionWatch
from tfdist.checkpoint.restore import inspect_copy, newest_readable, set_data_position
from tfdist.checkpoint.rng import numpy_value, rng_state, set_rng_state
from tfdist.checkpoint.sharded import (
    ShardedWriter,
    assign_sharded,
    check_sharded_target,
    prune_sharded,
    read_sharded,
    remove_stale_writes,
    saved_variables,
    sharded_name,
)
from tfdist.checkpoint.writer import ArchiveWriter, exit_for_restart
from tfdist.compat.gradient_accumulation import KERAS_TF_GRADIENT_ACCUMULATION
from tfdist.core import atomic, config, cross_replica, roles, storage, validate
from tfdist.core.position import Position
from tfdist.loops.jax import replicate, to_host

__all__ = ["Checkpointer", "OPTIMIZER_MEMBER"]

logger = logging.getLogger(__name__)

# The archive member holding the optimizer's variables (a loop's model is not compiled,
# so ``model.save`` leaves the optimizer out); Keras ignores members it does not know.
OPTIMIZER_MEMBER = "tfdist/optimizer.npz"

_WHERE = "tfdist.loops.Checkpointer"


def _steps_per_epoch(pipeline, steps_per_epoch) -> int | None:
    if steps_per_epoch is not None:
        return validate.positive_int(steps_per_epoch, "steps_per_epoch", _WHERE)
    if pipeline is None:
        return None
    from tfdist import data

    data.position(pipeline)  # a seeded pipeline, or a clear error
    count = int(pipeline.cardinality())
    if count <= 0:
        raise ValueError(
            f"{_WHERE}: the pipeline's number of batches per epoch is unknown. Received: "
            f"cardinality={count}. Pass steps_per_epoch=... as well."
        )
    return count


def _optimizer_bytes(optimizer) -> bytes:
    if KERAS_TF_GRADIENT_ACCUMULATION in compat.applied():
        # Mid-window, each replica's accumulator copy holds its own share: made equal
        # (the window's sum so far) before they are read, as Keras saves do under the fix.
        cross_replica.consolidate_accumulators(optimizer)
    buffer = io.BytesIO()
    # Any: mypy would match the arrays against savez's allow_pickle keyword as well.
    values: dict[str, Any] = {
        f"v{i:05d}": numpy_value(v) for i, v in enumerate(optimizer.variables)
    }
    np.savez(buffer, **values)
    return buffer.getvalue()


def _read_optimizer(path: str) -> list[np.ndarray]:
    data = atomic.read_archive_member(path, OPTIMIZER_MEMBER)
    if data is None:
        raise CorruptCheckpoint(f"missing {OPTIMIZER_MEMBER!r}")
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        return [arrays[name] for name in sorted(arrays.files)]


def _inspect(path: str, downloads: contextlib.ExitStack) -> dict:
    """``inspect_archive`` plus the optimizer member and the loop's resume metadata; a URL
    is downloaded once (``info["local"]``, kept until ``downloads`` closes)."""
    info = inspect_copy(path, downloads)
    try:
        info["optimizer"] = _read_optimizer(info.get("local", path))
    except CorruptCheckpoint:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to read is the file's
        raise CorruptCheckpoint(f"{OPTIMIZER_MEMBER}: {type(err).__name__}: {err}") from None
    if info["resume"] is None or info["resume"].get("step") is None:
        raise CorruptCheckpoint("no tfdist resume metadata with a step")
    return info


def _spanning(value):
    """``value`` as Orbax can write it from every process: under several processes, a
    process-local array (a variable not in the loop's state) is placed on ``mesh()``."""
    if roles.jax_process().count > 1 and getattr(value, "is_fully_addressable", False):
        return replicate(value)
    return value


class Checkpointer:
    """Exact resume for a custom training loop: ``restore() -> step``, ``maybe_save(step)``.

    Args:
        directory: the checkpoint directory (shared by every worker).
        model, optimizer: what the loop trains (the optimizer built, or built here).
        pipeline: the seeded ``tfdist.data.pipeline`` the loop iterates; its length
            gives ``steps_per_epoch`` and restoring moves it to the step's batch.
        steps_per_epoch: batches per epoch when ``pipeline`` does not know it.
        max_to_keep: checkpoints kept (None: all).
        preemption: turn SIGTERM into a save at an agreed step and exit 75.
        strategy: TensorFlow: the loop's strategy (``tfdist.strategy()`` when None).
        sharded: JAX: write sharded, asynchronous Orbax checkpoints
            (``ckpt-{epoch}[-{batch}].orbax``, every worker its own shards) instead of
            archives; training goes on while a checkpoint is written.

    Example:
        >>> ckpt = Checkpointer("ckpt/", model=model, optimizer=opt, pipeline=train)  # doctest: +SKIP
        >>> step = ckpt.restore()  # doctest: +SKIP
        >>> for epoch in range(step // ckpt.steps_per_epoch, EPOCHS):  # doctest: +SKIP
        ...     for batch in dist_train:
        ...         train_step(batch); step += 1
        ...         ckpt.maybe_save(step, every=100)
    """

    def __init__(
        self,
        directory,
        *,
        model,
        optimizer,
        pipeline=None,
        steps_per_epoch: int | None = None,
        max_to_keep: int | None = 5,
        preemption: bool = True,
        preemption_timeout: float = config.PREEMPTION_TIMEOUT_S,
        strategy=None,
        sharded: bool = False,
    ):
        validate.instance(model, keras.Model, "model", _WHERE, "a keras.Model")
        what = "a keras.optimizers.Optimizer"
        validate.instance(optimizer, keras.optimizers.Optimizer, "optimizer", _WHERE, what)
        steps = _steps_per_epoch(pipeline, steps_per_epoch)
        if steps is None:
            raise ValueError(
                f"{_WHERE}: pass the pipeline the loop iterates (or steps_per_epoch), so a "
                "step can be turned into (epoch, batch). Received: pipeline=None, "
                "steps_per_epoch=None."
            )
        self.steps_per_epoch: int = steps
        if max_to_keep is not None:
            validate.positive_int(max_to_keep, "max_to_keep", _WHERE)
        validate.instance(preemption, bool, "preemption", _WHERE, "a bool")
        self.timeout = validate.positive_number(preemption_timeout, "preemption_timeout", _WHERE)
        validate.instance(sharded, bool, "sharded", _WHERE, "a bool")
        self.role = atomic.write_role()
        self.directory = check_save_target(directory, _WHERE, writable=self.role.is_chief)
        if sharded:
            check_sharded_target(self.directory, _WHERE)
        self.model, self.optimizer = model, optimizer
        self.max_to_keep, self.preemption, self.sharded = max_to_keep, preemption, sharded
        self.restored_from: str | None = None
        self.strategy = strategy
        self._watch: PreemptionWatch | None = None
        self._archives = ArchiveWriter(self.directory, max_to_keep=max_to_keep, role=self.role)
        self._writer: ShardedWriter | None = None
        self._closing_at_exit = False

    # -- restore

    def restore(self) -> int:
        """Restores the newest checkpoint that reads back (every worker the same one) and
        moves the data pipelines to its step; returns that step (0: fresh start).

        Call it once, after building the model and optimizer and before the loop. On JAX,
        ``.orbax`` checkpoints are candidates too (whatever ``sharded`` says), as for
        ``make_or_restore``.
        """
        reads_sharded = backends.get().saves_sharded()
        self._archives.prepare()
        if self.role.is_chief and reads_sharded:
            remove_stale_writes(self.directory)  # a killed job's unfinished writes
        with self._scope(), contextlib.ExitStack() as downloads:
            self._build_optimizer()
            inspect_sharded = self._read_sharded if reads_sharded else None
            chosen = newest_readable(
                self.directory,
                self.role,
                lambda path: _inspect(path, downloads),
                inspect_sharded,
                where=_WHERE,
            )
            check_workers_agree(self._strategy(), chosen, self.directory)
            step = 0 if chosen is None else self._load(*chosen)
        epoch, batch = divmod(step, self.steps_per_epoch)
        set_data_position(epoch, batch)
        self._start_watch()
        logger.info("tfdist: custom loop resumes at step %d (%s)", step, self.restored_from)
        return step

    def _strategy(self):
        """The tf.distribute strategy whose scope restores run in, or None (a
        keras.distribution places variables itself)."""
        distribution = _distribute.current(self.strategy)
        return distribution if hasattr(distribution, "experimental_distribute_dataset") else None

    def _scope(self):
        strategy = self._strategy()
        return strategy.scope() if strategy is not None else contextlib.nullcontext()

    def _build_optimizer(self) -> None:
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)

    def _saved_variables(self) -> list:
        return saved_variables(self.model, self.optimizer)

    def _read_sharded(self, path: str) -> dict:
        return read_sharded(path, self._saved_variables(), where=_WHERE)

    def _load(self, path: str, info: dict) -> int:
        if info.get("sharded"):
            assign_sharded(self._saved_variables(), info)
        else:
            self._load_archive(path, info)
        meta = info["resume"]
        set_rng_state(self.model, meta.get("rng", []), path)
        self.restored_from = path
        return int(meta["step"])

    def _load_archive(self, path: str, info: dict) -> None:
        with weights_file(info.get("local", path), info) as weights:  # the checked bytes
            self.model.load_weights(weights)
        variables, values = self.optimizer.variables, info["optimizer"]
        if len(variables) != len(values) or any(
            tuple(v.shape) != a.shape for v, a in zip(variables, values, strict=False)
        ):
            raise ValueError(
                f"{_WHERE}: the optimizer state in {path!r} does not fit this optimizer "
                f"({len(values)} arrays for {len(variables)} variables). Restore with the "
                "optimizer that wrote it, or use a new directory; nothing was deleted."
            )
        for variable, value in zip(variables, values, strict=True):
            variable.assign(value)

    # -- save

    def maybe_save(self, step: int, *, every: int, state=None) -> bool:
        """Saves when ``every`` divides ``step``; on SIGTERM saves at the agreed step and
        exits with ``RESTART_EXIT_CODE``. Returns whether it saved.

        ``state``: on JAX, the loop's ``(trainable, non_trainable, optimizer)`` values,
        saved in place of the model's and optimizer's (not read otherwise).
        """
        step = validate.non_negative_int(step, "step", f"{_WHERE}.maybe_save")
        every = validate.positive_int(every, "every", f"{_WHERE}.maybe_save")
        if self._watch is not None and self._watch.should_save(step):
            self.save(step, state=state)
            self._exit_for_restart(step)
        if step % every:
            return False
        self.save(step, state=state)
        return True

    def save(self, step: int, *, state=None) -> str:
        """Writes the checkpoint of ``step``; every worker calls it. An archive: written
        into the model first (``state``), the chief's file lands. ``sharded``: the write
        goes on in the background once the arrays are copied off the devices (``wait``)."""
        step = validate.non_negative_int(step, "step", f"{_WHERE}.save")
        position = Position(*divmod(step, self.steps_per_epoch))
        if self.sharded:
            return self._save_sharded(step, position, state)
        if state is not None:
            self.write_state(state)
        meta = self._metadata(position, step, rng_state(self.model))
        optimizer = {OPTIMIZER_MEMBER: lambda: _optimizer_bytes(self.optimizer)}
        return self._archives.write(self.model, position, meta, members=optimizer)

    def _metadata(self, position: Position, step: int, rng: list) -> dict:
        replicas = _distribute.num_replicas(strategy=self._strategy())
        return resume_metadata(position, step=step, rng=rng, replicas=replicas)

    def _save_sharded(self, step: int, position: Position, state) -> str:
        """Starts the write of ``step``'s sharded checkpoint, the previous one finished."""
        path = storage.join(self.directory, sharded_name(position.epoch, position.batch))
        self.wait()  # one write at a time; the finished one counts when pruning
        # The train state as it is on the devices: nothing is written into the model.
        current = {id(variable): value for variable, value in self._state_pairs(state)}

        def read(variable):
            return to_host(current.get(id(variable), variable))

        meta = self._metadata(position, step, rng_state(self.model, read=read))
        variables = self._saved_variables()
        values = [_spanning(current.get(id(v), v.value)) for v in variables]
        if self._writer is None:
            self._writer = ShardedWriter()
            self._close_at_exit()
        self._writer.save(variables, path, meta, values=values)
        return path

    def wait(self) -> None:
        """Blocks until the sharded checkpoint being written is finished (archives are
        finished when ``save`` returns); ``close``, and the SIGTERM exit, call it.

        Example:
            >>> ckpt.wait()  # the last checkpoint is whole on disk  # doctest: +SKIP
        """
        if self._writer is None:
            return
        self._writer.wait()
        if self.role.is_chief:
            prune_sharded(self.directory, self.max_to_keep)

    def write_state(self, state) -> None:
        """Writes a JAX loop's ``(trainable, non_trainable, optimizer)`` values into the
        model and optimizer (``save(state=...)`` does it before each archive)."""
        for variable, value in self._state_pairs(state):
            variable.assign(to_host(value))

    def _state_pairs(self, state) -> list[tuple]:
        """``(variable, value)`` of every leaf of a JAX loop's state (none for None)."""
        if state is None:
            return []
        trainable, non_trainable, optimizer = state
        pairs = [
            (self.model.trainable_variables, trainable),
            (self.model.non_trainable_variables, non_trainable),
            (self.optimizer.variables, optimizer),
        ]
        return [pair for variables, values in pairs for pair in zip(variables, values, strict=True)]

    # -- preemption

    def _start_watch(self) -> None:
        if not self.preemption or self._watch is not None:
            return
        role = roles.from_env()
        self._watch = PreemptionWatch(
            multi_worker=role.count > 1 and _distribute.num_workers() > 1,
            rank=role.rank,
            num_workers=role.count,
            key="tfdist/preempt/loop",
            timeout=self.timeout,
        )
        self._watch.start()
        self._close_at_exit()

    def _close_at_exit(self) -> None:
        # Before the runtime shuts down at exit (atexit runs last-registered first): a
        # watcher thread still waiting in the coordination store would abort the process,
        # and a sharded write needs it to finish.
        if not self._closing_at_exit:
            self._closing_at_exit = True
            atexit.register(self.close)

    def close(self) -> None:
        """Waits for the checkpoint being written and stops the SIGTERM watch (its handler
        and watcher thread); also run at exit.

        Example:
            >>> ckpt.close()  # doctest: +SKIP
        """
        self.wait()
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def _exit_for_restart(self, step: int) -> None:
        self.wait()  # the preemption checkpoint must be whole before exiting
        exit_for_restart(step, self._watch)
