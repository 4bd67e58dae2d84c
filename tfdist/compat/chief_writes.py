"""Keras's own file-writing callbacks in a multi-worker job: the chief writes, once, atomically.

Keras 3 dropped tf-keras's rule that non-chief workers write to a temporary path, so under
MultiWorkerMirroredStrategy, and in a multi-process JAX job, every worker writes the same
files: two ``ModelCheckpoint`` saves of one ``.weights.h5`` collide on h5py's file lock,
``BackupAndRestore`` races on creating its directory (``FileExistsError``) and can leave
a torn backup, ``CSVLogger`` and ``TensorBoard`` write every row and event N times. On
JAX, saving from process 0 only is no way out: ``save``/``save_weights`` gather the
variables across processes, so every process must take part in each save.

The fixes (one per callback, each a ``Fix`` in ``FIXES``) patch each callback's write
methods, not ``CallbackList``: a callback used outside ``fit`` is fixed too, and each
fix can be excluded on its own (``TFDIST_COMPAT_EXCLUDE``):

==========================================  ===========================================
``keras_model_checkpoint_chief_writes``      ``ModelCheckpoint._save_model``: every
                                             worker decides and saves, the chief's file
                                             lands (``tfdist.saving``'s protocol).
``keras_backup_and_restore_chief_writes``    ``BackupAndRestore``: the chief writes the
                                             backup atomically, the epoch inside the
                                             weights file; every worker restores it.
``keras_csv_logger_chief_only``              ``CSVLogger``: non-chief rows go to
                                             ``os.devnull`` (no file at all).
``keras_tensorboard_chief_only``             ``TensorBoard``: non-chief events go to a
                                             temporary directory, removed at train end.
==========================================  ===========================================

``EarlyStopping`` and ``ReduceLROnPlateau`` need no fix: they decide from the epoch's
logs, which are the same on every worker (metrics are reduced across all replicas), and
change only in-memory state (``stop_training``, the learning-rate variable) on each.

Without another worker (one process, or a model outside a multi-worker strategy) every
patched method calls upstream's unchanged.

Example:
    >>> [fix.name for fix in FIXES][0]
    'keras_model_checkpoint_chief_writes'
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import weakref

from tfdist import saving
from tfdist.core import atomic, upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "KERAS_USER_SAVES_CHIEF_WRITES",
    "KERAS_TENSORBOARD_CHIEF_ONLY",
    "KERAS_CSV_LOGGER_CHIEF_ONLY",
    "KERAS_BACKUP_AND_RESTORE_CHIEF_WRITES",
    "KERAS_MODEL_CHECKPOINT_CHIEF_WRITES",
    "FIXES",
    "BACKUP_ATTRIBUTE",
    "embedded_position",
    "keras_model_checkpoint_chief_writes",
    "keras_backup_and_restore_chief_writes",
    "keras_csv_logger_chief_only",
    "keras_tensorboard_chief_only",
    "keras_user_saves_chief_writes",
]

# The fixes' names, declared once (other layers import them).
KERAS_MODEL_CHECKPOINT_CHIEF_WRITES = "keras_model_checkpoint_chief_writes"
KERAS_BACKUP_AND_RESTORE_CHIEF_WRITES = "keras_backup_and_restore_chief_writes"
KERAS_CSV_LOGGER_CHIEF_ONLY = "keras_csv_logger_chief_only"
KERAS_TENSORBOARD_CHIEF_ONLY = "keras_tensorboard_chief_only"
KERAS_USER_SAVES_CHIEF_WRITES = "keras_user_saves_chief_writes"

logger = logging.getLogger(__name__)

# The HDF5 attribute of a multi-worker backup's weights file that records the epoch and
# batch its weights belong to: the weights file is the backup's one atomic commit.
BACKUP_ATTRIBUTE = "tfdist_backup"

# Non-chief TensorBoard staging directories (callback -> the finalizer that removes its
# directory): removed at train end, or at exit if fit failed.
_TENSORBOARD_STAGING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _multi_worker(model) -> bool:
    return model is not None and saving.has_other_workers(model)


def _in_scope(model):
    """The model's own strategy scope (TensorFlow): tfdist's barriers then use that
    strategy instead of creating tfdist's own next to the one the script built."""
    strategy = getattr(model, "distribute_strategy", None)  # TF models only
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _is_chief() -> bool:
    return atomic.write_role().is_chief


def _tensorflow_or_jax() -> bool:
    return on_keras_backend("tensorflow")() or on_keras_backend("jax")()


# ------------------------------------------------------------------ ModelCheckpoint


def _checkpoint_save(callback, epoch: int, batch, logs) -> None:
    """Upstream's ``_save_model`` steps, with the write made by every worker for the chief."""
    filepath = upstream.keras_checkpoint_file_path(callback, epoch, batch, logs)
    if not upstream.keras_checkpoint_should_save(callback, epoch, batch, logs, filepath):
        return
    model = callback.model
    writer = model.save_weights if callback.save_weights_only else model.save
    saving.write_on_every_worker(
        model,
        filepath,
        lambda staging: writer(staging, overwrite=True),
        what=f"ModelCheckpoint {os.path.basename(filepath)}",
    )
    if callback.verbose > 0 and _is_chief():
        print(f"\nEpoch {epoch + 1}: finished saving model to {filepath}", flush=True)


def keras_model_checkpoint_chief_writes() -> None:
    """Makes ``ModelCheckpoint`` save once per checkpoint, from the chief, atomically.

    Upstream ``_save_model`` has every worker of a multi-worker job (TensorFlow's
    MultiWorkerMirroredStrategy, or JAX processes) call ``model.save_weights(filepath)``
    or ``model.save(filepath)`` on the same path: two writers of one HDF5 file fail on
    its lock ("unable to lock file"), or interleave into a corrupt file; a process
    killed mid-write leaves a torn checkpoint under the final name.

    With the fix, every worker still computes the file name and the decision
    (``save_best_only`` compares the epoch's logs, which are the same on every worker,
    since metrics are reduced across all replicas) with upstream's own code, then runs
    ``tfdist.saving``'s protocol: all workers meet, each calls the same writer (reading
    the variables may be a cross-process gather, on JAX it is), the chief's copy is
    written to a staging file, flushed and renamed onto the final name, the others'
    copies go to a temporary directory that is removed, and all meet again before
    training goes on. The file that lands is the one one worker would have written: the
    variables are equal on every worker. Without other workers upstream runs unchanged.
    """

    def make(original):
        def _save_model(self, epoch, batch, logs):
            if not _multi_worker(self.model):
                return original(self, epoch, batch, logs)
            with _in_scope(self.model):
                return _checkpoint_save(self, epoch, batch, logs)

        return _save_model

    import keras

    patch(
        keras.callbacks.ModelCheckpoint,
        "_save_model",
        KERAS_MODEL_CHECKPOINT_CHIEF_WRITES,
        make,
    )


# ------------------------------------------------------------------ BackupAndRestore


def _write_json(path: str, data: dict) -> None:
    """The chief writes ``data`` to ``path`` atomically."""
    with atomic.atomic_output(path) as staging:
        with open(staging, "w") as f:
            f.write(json.dumps(data))


def _copy_atomically(source: str, destination: str) -> None:
    """The chief copies ``source`` onto ``destination`` atomically."""
    with atomic.atomic_output(destination) as staging:
        shutil.copyfile(source, staging)


def _embed_position(weights_file: str, position: dict) -> None:
    import h5py

    with h5py.File(weights_file, "a") as f:
        f.attrs[BACKUP_ATTRIBUTE] = json.dumps(position)


def embedded_position(weights_file: str) -> dict | None:
    """The epoch and batch a multi-worker backup's weights file records, or None.

    Example:
        >>> embedded_position("backup/latest.weights.h5")  # doctest: +SKIP
        {'epoch': 2, 'batch': 0}
    """
    import h5py

    with h5py.File(weights_file, "r") as f:
        text = f.attrs.get(BACKUP_ATTRIBUTE)
    return None if text is None else json.loads(text)


def _backup_save(callback) -> None:
    """One backup: the chief's weights (with their epoch inside) land, then the metadata."""
    model = callback.model
    weights, metadata, previous_weights, previous_metadata = upstream.keras_backup_paths(callback)
    position = upstream.keras_backup_position(callback)
    chief = _is_chief()
    if chief:
        os.makedirs(callback.backup_dir, exist_ok=True)
        if callback.double_checkpoint:  # upstream's copies of the last backup, made atomic
            for source, destination in ((weights, previous_weights), (metadata, previous_metadata)):
                if os.path.exists(source):
                    _copy_atomically(source, destination)

    def write(staging):
        model.save_weights(staging, overwrite=True)
        if chief:
            _embed_position(staging, position)

    saving.write_on_every_worker(model, weights, write, what="BackupAndRestore backup")
    if chief:
        # Upstream's metadata file, for a restart that reads the backup without tfdist;
        # a kill between the two renames leaves it one backup behind, and the restore
        # below follows the weights file.
        _write_json(metadata, position)


def _backup_restore(callback) -> None:
    """Every worker restores the same backup; the chief alone repairs it from ``.bkp``."""
    model = callback.model
    weights, metadata, previous_weights, previous_metadata = upstream.keras_backup_paths(callback)
    if _is_chief():
        atomic.remove_stale_staging(callback.backup_dir)  # left by a process killed mid-save
    try:
        upstream.keras_backup_load(callback)
    except OSError:
        if not os.path.exists(previous_weights):
            raise
        logger.warning("tfdist: %s is unreadable; restoring %s", weights, previous_weights)
        saving.sync_workers("BackupAndRestore repair", model=model)
        if _is_chief():
            _copy_atomically(previous_weights, weights)
            if os.path.exists(previous_metadata):
                _copy_atomically(previous_metadata, metadata)
        saving.sync_workers("BackupAndRestore repair", model=model)
        upstream.keras_backup_load(callback)
    if os.path.exists(weights):
        position = embedded_position(weights)
        if position is not None:
            upstream.keras_set_initial_epoch(model, position["epoch"])


def _backup_delete(callback, original, logs) -> None:
    """At train end the chief alone deletes the backup, once no worker can still read it."""
    if not callback.delete_checkpoint:
        return
    model = callback.model
    saving.sync_workers("BackupAndRestore delete", model=model)
    if _is_chief():
        original(callback, logs)
    saving.sync_workers("BackupAndRestore delete", model=model)


def keras_backup_and_restore_chief_writes() -> None:
    """Makes ``BackupAndRestore`` back up from the chief only, atomically, and restore alike.

    Upstream, every worker of a multi-worker job runs ``_save_model``: each checks that
    ``backup_dir`` is missing and creates it (the loser raises ``FileExistsError``), each
    writes ``latest.weights.h5`` (an HDF5 lock error, or a torn file) and then
    ``training_metadata.json``. Even on one worker the backup is two files written in
    place: a kill between them resumes from weights of one epoch and the epoch number of
    another; ``double_checkpoint``'s copies and the deletion at train end race too.

    With the fix, in a multi-worker job, the chief alone creates the directory and makes
    the ``.bkp`` copies (each atomic); every worker takes part in saving the weights
    (``tfdist.saving``'s protocol: on JAX it is a cross-process gather), the chief's
    copy records the backup's epoch and batch inside the HDF5 file and is renamed onto
    ``latest.weights.h5``: that rename is the backup's one commit. The metadata file
    follows, atomically. On restore every worker runs upstream's own ``_load_model`` on
    the same files and then takes the epoch recorded in the weights file, so all resume
    at the epoch those weights finished, whatever moment a kill hit; the repair from
    ``.bkp`` is made by the chief while the others wait, and the deletion at train end
    by the chief after all finished. Weights and the optimizer's state are the ones one
    worker would back up (variables are equal everywhere), so a resumed job continues as
    an uninterrupted one. Without other workers upstream runs unchanged.
    """
    import keras

    owner = keras.callbacks.BackupAndRestore
    name = KERAS_BACKUP_AND_RESTORE_CHIEF_WRITES

    def make_save(original):
        def _save_model(self):
            if not _multi_worker(self.model):
                return original(self)
            with _in_scope(self.model):
                return _backup_save(self)

        return _save_model

    def make_begin(original):
        def on_train_begin(self, logs=None):
            if not _multi_worker(self.model):
                return original(self, logs)
            with _in_scope(self.model):
                return _backup_restore(self)

        return on_train_begin

    def make_end(original):
        def on_train_end(self, logs=None):
            if not _multi_worker(self.model):
                return original(self, logs)
            with _in_scope(self.model):
                return _backup_delete(self, original, logs)

        return on_train_end

    patch(owner, "_save_model", name, make_save)
    patch(owner, "on_train_begin", name, make_begin)
    patch(owner, "on_train_end", name, make_end)


# ------------------------------------------------------------------ CSVLogger


def keras_csv_logger_chief_only() -> None:
    """Makes ``CSVLogger`` write its file on the chief only.

    Upstream every worker of a multi-worker job opens ``filename`` at train begin and
    writes each epoch's row: with ``append=True`` (the way to keep a log across
    restarts) the file gets one header and one copy of every row per worker; without
    it, the workers truncate and overwrite each other's writes of the same file.

    With the fix a non-chief worker opens ``os.devnull`` instead (upstream's own
    ``on_train_begin`` with the file name swapped for the call, the user's name kept on
    the callback), so it runs exactly the same code on the same logs and writes
    nothing; the chief writes the file as one worker would. The rows are those one
    worker writes: the logs are the same on every worker (metrics are reduced across
    all replicas). No collective is involved, so nothing else changes. Without other
    workers upstream runs unchanged.
    """
    import keras

    def make(original):
        def on_train_begin(self, logs=None):
            if not _multi_worker(self.model) or _is_chief():
                return original(self, logs)
            filename = self.filename
            self.filename = os.devnull
            try:
                return original(self, logs)
            finally:
                self.filename = filename

        return on_train_begin

    patch(keras.callbacks.CSVLogger, "on_train_begin", KERAS_CSV_LOGGER_CHIEF_ONLY, make)


# ------------------------------------------------------------------ TensorBoard


def _remove_tensorboard_staging(callback) -> None:
    cleanup = _TENSORBOARD_STAGING.pop(callback, None)
    if cleanup is not None:
        cleanup()  # a weakref.finalize: removes the directory, once


def _tensorboard_set_model(callback, original, model) -> None:
    """A non-chief worker's ``set_model``: upstream's, with ``log_dir`` in a staging dir."""
    _remove_tensorboard_staging(callback)  # of an earlier fit
    rank = atomic.write_role().rank
    staging = tempfile.mkdtemp(prefix=f"tfdist-worker{rank}-tensorboard-")
    # Removed at train end, or when the callback is collected or the process exits.
    _TENSORBOARD_STAGING[callback] = weakref.finalize(callback, shutil.rmtree, staging, True)
    log_dir = callback.log_dir
    callback.log_dir = os.path.join(staging, os.path.basename(os.path.normpath(log_dir)))
    try:
        original(callback, model)
    finally:
        callback.log_dir = log_dir


def keras_tensorboard_chief_only() -> None:
    """Makes ``TensorBoard`` write event files on the chief only.

    Upstream every worker of a multi-worker job writes its own event files into the same
    ``log_dir`` (their names differ by host and process id), so TensorBoard shows every
    scalar, histogram and graph once per worker, and ``embeddings_freq`` checkpoints
    collide like ``ModelCheckpoint``'s.

    With the fix a non-chief worker's ``set_model`` (where upstream derives every
    directory it writes from ``log_dir``) runs upstream's own code with ``log_dir``
    swapped, for that call, for a private temporary directory (``tfdist-worker<rank>-*``
    in the system's temporary directory, as ``tfdist.saving`` stages there), which is
    removed once ``on_train_end`` has closed the writers (or at exit, if ``fit``
    failed). Non-chief workers therefore still run every summary op and every save they
    would run upstream (an embeddings checkpoint gathers variables on JAX), only their
    files are discarded; the chief's files are those one worker writes, since the logged
    values are the same on every worker. Without other workers upstream runs unchanged.
    """
    import keras

    owner = keras.callbacks.TensorBoard
    name = KERAS_TENSORBOARD_CHIEF_ONLY

    def make_set_model(original):
        def set_model(self, model):
            if not _multi_worker(model) or _is_chief():
                return original(self, model)
            return _tensorboard_set_model(self, original, model)

        return set_model

    def make_end(original):
        def on_train_end(self, logs=None):
            try:
                return original(self, logs)
            finally:
                _remove_tensorboard_staging(self)

        return on_train_end

    patch(owner, "set_model", name, make_set_model)
    patch(owner, "on_train_end", name, make_end)


# ------------------------------------------------------------ the user's own saves


def _passes_through(model, filepath, args, kwargs) -> bool:
    """Calls upstream handles as it does: one worker, tfdist's own staging writes, a
    refused overwrite (Keras asks the user), sharded weights, a file object, a URL."""
    if atomic.is_writing() or not isinstance(filepath, (str, os.PathLike)):
        return True
    if kwargs.get("overwrite", args[0] if args else True) is False:
        return True
    if kwargs.get("max_shard_size") is not None or "://" in os.fspath(filepath):
        return True
    return not _multi_worker(model)


def _user_save(what: str):
    """A user's save, ``Model.<method>(filepath, ...)`` or ``keras.saving.save_model(model,
    filepath, ...)`` (the model first either way), made atomic on this worker alone."""

    def make(original):
        def save(model, filepath, *args, **kwargs):
            if _passes_through(model, filepath, args, kwargs):
                return original(model, filepath, *args, **kwargs)

            def write(staging):
                return original(model, staging, *args, **kwargs)

            final = os.path.abspath(os.fspath(filepath))
            return saving.write_alone(model, final, write, what=what)

        return save

    return make


def keras_user_saves_chief_writes() -> None:
    """Makes a script's own saves atomic on any worker, with no wait for the others.

    Keras's guides end with ``model.save(path)``, run by every worker of a multi-worker
    script, and the other common way is ``if rank == 0: model.save(path)``. Upstream,
    two workers writing one file at once tear it (measured, 2 TensorFlow workers:
    ``BadZipFile: Bad CRC-32`` or a missing file on load; ``save_weights``: h5py's
    ``unable to lock file``; ``export``: ``MergeV2Checkpoints`` finds the other
    worker's ``variables_temp`` gone; on JAX the processes then fall out of step and the
    job aborts), while the chief saving alone is right and takes milliseconds.

    With the fix, ``Model.save``, ``save_weights``, ``export`` and
    ``keras.saving.save_model`` write upstream's own output to a staging name of this
    process's own next to the path, flush it and rename it onto the path: each save is
    atomic, two workers never write one file, and no worker waits for another (reading
    mirrored TensorFlow variables, or JAX arrays replicated on every process, is local).
    So every pattern keeps working: every worker (the last rename wins; the variables,
    and so the files, are equal when the workers save at the same step), the chief
    alone, a rank-guarded callback inside ``fit``, different counts per worker, a path
    of each worker's own. A model with variables sharded across JAX processes needs
    every process for each save (reading it is a gather): that save keeps
    ``tfdist.saving``'s every-worker protocol and says so when a process does not come.
    One worker, a refused overwrite, sharded weights files and URLs go to upstream
    unchanged.
    """
    model_class = upstream.keras_model_class()
    name = KERAS_USER_SAVES_CHIEF_WRITES
    for method in ("save", "save_weights", "export"):
        patch(model_class, method, name, _user_save(f"Model.{method}"))
    for module in upstream.keras_save_model_modules():
        patch(module, "save_model", name, _user_save("keras.saving.save_model"))


# ------------------------------------------------------------------ the fixes

_MC = "keras.src.callbacks.model_checkpoint:ModelCheckpoint."
_BR = "keras.src.callbacks.backup_and_restore:BackupAndRestore."
_MODEL = "keras.src.models.model:Model."

FIXES: list[Fix] = [
    Fix(
        KERAS_MODEL_CHECKPOINT_CHIEF_WRITES,
        "Keras 3 ModelCheckpoint in a multi-worker job: every worker writes the same file "
        "('unable to lock file' from h5py, or a corrupt checkpoint)",
        _tensorflow_or_jax,
        keras_model_checkpoint_chief_writes,
        targets=targets(
            _MC + "_save_model",
            _MC + "_get_file_path",
            _MC + "_should_save_model",
            _MODEL + "save",
            _MODEL + "save_weights",
        ),
        acts_where=(
            "ModelCheckpoint saves in a multi-worker job (MultiWorkerMirroredStrategy over "
            ">1 worker, or several JAX processes); one process: upstream's path"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_BACKUP_AND_RESTORE_CHIEF_WRITES,
        "Keras 3 BackupAndRestore in a multi-worker job: every worker creates and writes "
        "the backup (FileExistsError on backup_dir, h5py lock errors, a torn backup)",
        _tensorflow_or_jax,
        keras_backup_and_restore_chief_writes,
        targets=targets(
            _BR + "_save_model",
            _BR + "_load_model",
            _BR + "on_train_begin",
            _BR + "on_train_end",
            _BR + "_weights_path (instance)",
            _BR + "_training_metadata_path (instance)",
            _BR + "_prev_weights_path (instance)",
            _BR + "_prev_training_metadata_path (instance)",
            _BR + "_current_epoch (instance)",
            _BR + "_last_batch_seen (instance)",
            "keras.src.trainers.trainer:Trainer._initial_epoch (instance)",
            _MODEL + "save_weights",
        ),
        acts_where=(
            "BackupAndRestore backup, restore and delete in a multi-worker job (TensorFlow "
            "or JAX); one process: upstream's path"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_CSV_LOGGER_CHIEF_ONLY,
        "Keras 3 CSVLogger in a multi-worker job: every worker writes the same CSV file "
        "(rows and headers repeated, or overwritten)",
        _tensorflow_or_jax,
        keras_csv_logger_chief_only,
        targets=targets(
            "keras.src.callbacks.csv_logger:CSVLogger.on_train_begin",
            "keras.src.callbacks.csv_logger:CSVLogger.on_epoch_end",
        ),
        acts_where=(
            "CSVLogger on a non-chief worker of a multi-worker job (TensorFlow or JAX); the "
            "chief, one process: upstream's path"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_TENSORBOARD_CHIEF_ONLY,
        "Keras 3 TensorBoard in a multi-worker job: every worker writes event files into "
        "log_dir (every curve shown once per worker)",
        _tensorflow_or_jax,
        keras_tensorboard_chief_only,
        targets=targets(
            "keras.src.callbacks.tensorboard:TensorBoard.set_model",
            "keras.src.callbacks.tensorboard:TensorBoard.on_train_end",
        ),
        acts_where=(
            "TensorBoard.set_model on a non-chief worker of a multi-worker job (TensorFlow "
            "or JAX); the chief, one process: upstream's path"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_USER_SAVES_CHIEF_WRITES,
        "Keras 3 model.save / save_weights / export / keras.saving.save_model called by "
        "every worker of a multi-worker job: one file written by all (BadZipFile, h5py "
        "lock errors; on JAX the job aborts)",
        _tensorflow_or_jax,
        keras_user_saves_chief_writes,
        targets=targets(
            _MODEL + "save",
            _MODEL + "save_weights",
            _MODEL + "export",
            "keras.src.saving.saving_api:save_model",
        ),
        acts_where=(
            "Model.save/save_weights/export, keras.saving.save_model to a path in a "
            "multi-worker job; one process, overwrite=False, sharded weights, URLs: "
            "upstream's"
        ),
        no_harm=("tests/compat/test_user_saves.py::test_twenty_saves_and_loads_on_every_worker",),
    ),
]
