"""``ResumableCheckpoint``: the checkpoint callback of restartable ``fit`` jobs.

Each save is atomic (staging file in the same directory, fsync, rename; for a URL
directory see ``tfdist.core.storage``) and only the chief's file lands, on TensorFlow and on
JAX (every process runs the save, the others wait for the chief's file); ``save_freq``
counts global steps (aligned across restarts); each archive carries the resume metadata;
old files are pruned to ``max_to_keep``; at each epoch begin the data pipeline is told
where the epoch starts; on SIGTERM the callback saves at an agreed step and exits with
``RESTART_EXIT_CODE``. The write itself is ``tfdist.checkpoint.writer``'s, shared with
the custom-loop ``Checkpointer``.

Example:
    >>> callback = ResumableCheckpoint("ckpt/", save_freq=100)  # doctest: +SKIP
    >>> model.fit(train, epochs=3, callbacks=[callback])        # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings

import keras
import tensorflow as tf

from tfdist import distribute
from tfdist.checkpoint.archive import resume_metadata
from tfdist.checkpoint.names import check_dir, check_save_target
from tfdist.checkpoint.preemption import PreemptionWatch
from tfdist.checkpoint.restore import (
    ResumeState,
    finish_resumed_epoch,
    forget_resume,
    resume_state,
    set_data_position,
)
from tfdist.checkpoint.rng import numpy_value, phantom_prone_variables, rng_state
from tfdist.checkpoint.sharded import (
    ShardedWriter,
    check_sharded_target,
    prune_sharded,
    remove_stale_writes,
    saved_variables,
    sharded_name,
)
from tfdist.checkpoint.writer import ArchiveWriter, exit_for_restart
from tfdist.core import atomic, config, roles, storage, validate
from tfdist.core.position import Position

__all__ = ["ResumableCheckpoint", "ShardedCheckpoint"]

logger = logging.getLogger(__name__)

_WHERE = "tfdist.callbacks.checkpoint"


def _replicas(model) -> int:
    """Data-parallel replicas the model trains on (TF: its strategy's; JAX: the mesh's)."""
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is not None:
        return strategy.num_replicas_in_sync
    return distribute.num_replicas()


def _save_freq(value) -> str | int:
    what = "'epoch' or a positive int (steps)"
    if isinstance(value, str):
        if value != "epoch":
            raise ValueError(validate.message(_WHERE, "save_freq", what, value))
        return value
    return validate.integer(value, "save_freq", _WHERE, low=1, what=what)


def note_first_step(resumed) -> None:
    """Under an elastic ``tfdist launch``: tells the node's launcher (the file in
    ``TFDIST_ELASTIC_EVENTS``) when this start's first step ended and which checkpoint
    step it resumed from. Only the node's first worker writes; nothing happens elsewhere."""
    path = os.environ.get(config.ELASTIC_EVENTS_ENV)
    if not path or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    record = {
        "start": config.restart_count(),
        "resumed_step": None if resumed is None else resumed.step,
        "time": time.time(),
    }
    try:
        with open(path, "a", encoding="utf-8") as events:
            events.write(json.dumps(record) + "\n")
    except OSError as err:  # the launcher's line only; training goes on
        logger.warning("could not note the first step for the launcher: %s", err)


class ResumableCheckpoint(keras.callbacks.Callback):
    """The checkpoint callback for restartable jobs: atomic, chief-only, exact resume, SIGTERM.

    Use ``tfdist.callbacks.checkpoint(...)`` to create one. Compared with Keras's
    ``ModelCheckpoint`` it writes each file atomically, lets only the chief's file land
    (other workers still run the save, for its collectives, into a temporary directory
    they remove, then wait for the chief's file), works on both Keras backends, counts
    ``save_freq`` in global steps (aligned across restarts), stores the resume position
    and RNG state in each archive, prunes to ``max_to_keep``, drives
    ``tfdist.data.set_position`` for exact resume, and on SIGTERM saves and exits with
    ``RESTART_EXIT_CODE``. Every epoch end is saved; an int ``save_freq`` adds saves
    every that many steps.

    A ``keras.callbacks.Callback`` (like Keras's ``BackupAndRestore``), not a
    ``ModelCheckpoint``: none of that class's decisions (file pattern, ``save_best_only``,
    its batch counting) applies, and the write is ``tfdist.checkpoint.writer``'s.
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike,
        *,
        save_freq: str | int = "epoch",
        max_to_keep: int | None = 5,
        preemption: bool = True,
        preemption_timeout: float = config.PREEMPTION_TIMEOUT_S,
        verbose: int = 0,
    ):
        save_freq = _save_freq(save_freq)
        if max_to_keep is not None:
            what = "None or a positive int"
            validate.integer(max_to_keep, "max_to_keep", _WHERE, low=1, what=what)
        validate.instance(preemption, bool, "preemption", _WHERE, "a bool")
        what = "a positive number of seconds"
        timeout = validate.number(
            preemption_timeout, "preemption_timeout", _WHERE, low=0.0, low_ok=False, what=what
        )
        super().__init__()
        self.role = atomic.write_role()
        self.checkpoint_dir = check_dir(checkpoint_dir, _WHERE, writable=self.role.is_chief)
        self.save_freq = save_freq
        self.verbose = verbose
        self.max_to_keep = max_to_keep
        self._archives = ArchiveWriter(self.checkpoint_dir, max_to_keep=max_to_keep)
        self.preemption = preemption
        self.preemption_timeout = timeout
        self._fits = 0
        self._watch: PreemptionWatch | None = None
        self._resume: ResumeState | None = None
        self._first_epoch = True
        self._fit_epoch = 0  # the epoch running now
        self._skip = 0  # batches of this epoch trained before the restart
        self._step = 0  # the global step: optimizer steps since the job began
        self._step_at_epoch_begin = 0
        self._phantom_prone: list = []
        self._snapshot: list | None = None
        self._epoch_length: int | None = None  # batches in a full epoch, once seen
        # A warnings.catch_warnings() open during a resumed partial epoch.
        self._quiet: warnings.catch_warnings[None] | None = None
        self._preempting = False  # the save under way is the SIGTERM one

    # -- Keras hooks

    def on_train_begin(self, logs=None):
        self.role = atomic.write_role()
        # A save that would fail after training (a directory or an immutable file with a
        # checkpoint's name, an unwritable directory) fails now, on every worker, naming it.
        check_save_target(self.checkpoint_dir, _WHERE, writable=self.role.is_chief)
        self._check_savable()
        self._archives.role = self.role
        self._archives.prepare()
        self._resume = resume_state(self.model)
        if self._resume is not None and self._resume.step is not None:
            self._step = self._resume.step
        else:
            self._step = int(numpy_value(self.model.optimizer.iterations))
        self._first_epoch = True
        self._noted_first_step = False
        self._fits += 1
        self._phantom_prone = phantom_prone_variables(self.model)
        self._snapshot = None
        if self.preemption:
            self._watch = self._new_watch()
            self._watch.start()

    def on_epoch_begin(self, epoch, logs=None):
        self._fit_epoch = epoch
        skip = self._batches_to_skip(epoch)
        self._first_epoch = False
        self._skip = skip
        self._step_at_epoch_begin = self._step
        if skip:
            self._begin_quiet()
        set_data_position(epoch, skip)

    def on_train_batch_end(self, batch, logs=None):
        self._snapshot = [tf.identity(v.value) for v in self._phantom_prone]
        previous = self._step
        self._step = self._step_at_epoch_begin + self._done(batch) - self._skip
        if not self._noted_first_step:
            self._noted_first_step = True
            note_first_step(self._resume)
        if self._watch is not None and self._watch.should_save(self._step):
            self._preempting = True
            self._save(self._fit_epoch, batch)
            self._exit_for_restart()
        if self._due(previous, batch):
            self._save(self._fit_epoch, batch)

    def on_epoch_end(self, epoch, logs=None):
        self._end_quiet()
        self._undo_phantom_step()
        trained = self._step - self._step_at_epoch_begin
        if self._skip == 0 and trained > 0:
            self._epoch_length = trained
        self._save(epoch, None)
        finish_resumed_epoch(self.model, epoch)
        self._resume = None
        if self._watch is not None and self._watch.should_save(self._step):
            self._exit_for_restart()

    def on_train_end(self, logs=None):
        self._end_quiet()
        self._resume = None
        forget_resume(self.model)  # a later fit of this model starts where this one ended
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    # -- steps of the hooks

    def _new_watch(self) -> PreemptionWatch:
        role = roles.from_env()
        strategy = getattr(self.model, "distribute_strategy", None)  # TF models only
        if strategy is not None:
            multi = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        else:  # JAX: keras.distribution over the processes of jax.distributed
            multi = distribute.num_workers() > 1
        return PreemptionWatch(
            multi_worker=role.count > 1 and multi,
            rank=role.rank,
            num_workers=role.count,
            key=f"tfdist/preempt/{self._fits}",  # one notice per fit
            timeout=self.preemption_timeout,
        )

    def _check_savable(self) -> None:
        """An archive holds every variable whole: one that spans other processes' devices
        (JAX, a mesh axis across processes) cannot be fetched by Keras's save. Said now, on
        every process, instead of at the first save."""
        spanning = [
            v.path
            for v in saved_variables(self.model)
            if not getattr(v.value, "is_fully_addressable", True)
            and not getattr(v.value, "is_fully_replicated", False)  # a copy here: fetchable
        ]
        if spanning:
            raise ValueError(
                f"{_WHERE}: {len(spanning)} variable(s) span devices of other processes "
                f"(e.g. {spanning[:3]}), which a .keras archive cannot hold: Keras's save "
                "fetches each variable whole. Received: sharded=False. Pass sharded=True "
                "(each process writes its own shards), or lay the model out so that every "
                "process holds whole variables."
            )

    def _batches_to_skip(self, epoch: int) -> int:
        """Batches of ``epoch`` trained before the restart (only the resumed epoch has any)."""
        resume = self._resume
        if not self._first_epoch or resume is None:
            return 0
        if epoch == resume.epoch:
            return resume.batch
        logger.warning(
            "tfdist: fit started at epoch %d but the model was restored from %s, "
            "which resumes at epoch %d; pass initial_epoch=%d to fit (the value "
            "make_or_restore returned).",
            epoch,
            resume.path,
            resume.epoch,
            resume.epoch,
        )
        return 0

    def _begin_quiet(self) -> None:
        # The resumed epoch ends early on purpose (its first batches were trained before
        # the restart); Keras's "Your input ran out of data" warning would say otherwise.
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message="Your input ran out of data")

    def _end_quiet(self) -> None:
        if self._quiet is not None:
            self._quiet.__exit__(None, None, None)
            self._quiet = None

    def _undo_phantom_step(self) -> None:
        """Puts back the step counter and RNG states of the last real step (see rng.py)."""
        if self._snapshot is not None:
            for variable, value in zip(self._phantom_prone, self._snapshot, strict=True):
                variable.assign(value)
            self._snapshot = None

    def _due(self, previous_step: int, batch: int) -> bool:
        """Whether a step save is due: ``save_freq`` divides a step since ``previous_step``."""
        every = self.save_freq
        if isinstance(every, str):  # "epoch"
            return False
        if self._step // every <= previous_step // every:
            return False
        steps = (self.params.get("steps") if self.params else None) or self._epoch_length
        # The epoch-end save follows right away: do not write the same state twice.
        return not (steps and self._skip + batch + 1 >= steps)

    def _position(self, epoch: int, batch: int | None) -> Position:
        """The position after ``batch`` of ``epoch`` (None: the epoch's end)."""
        if batch is None:
            return Position(epoch + 1, 0)
        done = self._done(batch)
        steps = self.params.get("steps") if self.params else None
        if steps and done >= steps:
            return Position(epoch + 1, 0)
        return Position(epoch, done)

    def _done(self, batch: int) -> int:
        """Batches of the epoch done after ``batch``. With ``steps_per_execution`` K,
        Keras reports each execution's last index (K - 1, 2K - 1, ...), also for an epoch's
        last execution when fewer than K batches were left: capped at the epoch's length."""
        done = self._skip + batch + 1
        steps = self.params.get("steps") if self.params else None
        return min(done, steps) if steps else done

    # -- the save

    def _save(self, epoch: int, batch: int | None) -> None:
        """Saves the state after ``batch`` of ``epoch`` (None: the epoch's end)."""
        position = self._position(epoch, batch)
        meta = resume_metadata(
            position,
            step=self._step,
            rng=rng_state(self.model),
            replicas=_replicas(self.model),
        )
        started = time.perf_counter()
        path, done = self._write(position, meta)
        if not self.role.is_chief:
            return
        logger.info("tfdist: %s %s in %.2f s", done, path, time.perf_counter() - started)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: {done} checkpoint {path}", flush=True)

    def _write(self, position: Position, meta: dict) -> tuple[str, str]:
        """Writes the checkpoint; returns its path and what was done ("saved")."""
        timeout = self.preemption_timeout if self._preempting else None
        path = self._archives.write(self.model, position, meta, preemption_timeout=timeout)
        return path, "saved"

    def _exit_for_restart(self) -> None:
        exit_for_restart(self._step, self._watch)


class ShardedCheckpoint(ResumableCheckpoint):
    """``ResumableCheckpoint`` writing sharded, asynchronous Orbax checkpoints (JAX).

    Use ``tfdist.callbacks.checkpoint(dir, sharded=True)``. Each save writes
    ``ckpt-{epoch}[-{batch}].orbax``: every process writes the shards it holds and training
    goes on while the files are written (``tfdist.checkpoint.sharded``). The positions,
    ``save_freq``, pruning, exact resume and the SIGTERM protocol are the archives'; the
    preemption save, and the end of ``fit``, wait for the write to finish.
    """

    def __init__(self, checkpoint_dir, **kwargs) -> None:
        super().__init__(checkpoint_dir, **kwargs)
        check_sharded_target(self.checkpoint_dir, _WHERE)
        self._writer: ShardedWriter | None = None

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if self.role.is_chief:
            remove_stale_writes(self.checkpoint_dir)  # a killed job's unfinished writes
        if self._writer is None:
            self._writer = ShardedWriter()

    def on_train_end(self, logs=None):
        self._finish_writing()
        super().on_train_end(logs)

    def _check_savable(self) -> None:  # every process writes the shards it holds
        return

    def wait(self) -> None:
        """Blocks until the last checkpoint write has finished (``fit`` ends with this).

        Example:
            >>> callback.wait()  # after a fit ended by an exception  # doctest: +SKIP
        """
        self._finish_writing()

    def _write(self, position: Position, meta: dict) -> tuple[str, str]:
        path = storage.join(self.checkpoint_dir, sharded_name(position.epoch, position.batch))
        # The previous write is finished first, so that pruning counts it as a checkpoint.
        self._finish_writing()
        assert self._writer is not None  # on_train_begin made it; fit saves after that
        self._writer.save(saved_variables(self.model), path, meta)
        return path, "writing in the background"

    def _finish_writing(self) -> None:
        if self._writer is None:
            return
        self._writer.wait()
        if self.role.is_chief:
            prune_sharded(self.checkpoint_dir, self.max_to_keep)

    def _exit_for_restart(self) -> None:
        self._finish_writing()  # the preemption checkpoint must be whole before exiting
        super()._exit_for_restart()
