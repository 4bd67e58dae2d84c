"""Keras's ``ModelCheckpoint`` and ``BackupAndRestore`` in a multi-worker job: every worker
saves, the chief's file lands, once, atomically (the rest of Keras's file writers:
``chief_writes``).

Under MultiWorkerMirroredStrategy, and in a multi-process JAX job, every worker writes the
same files: two ``ModelCheckpoint`` saves of one ``.weights.h5`` collide on h5py's file
lock, and ``BackupAndRestore`` races on creating its directory (``FileExistsError``) and
can leave a torn backup. On JAX every process must take part in each save, since
``save``/``save_weights`` gather the variables across processes.

==========================================  ===========================================
``keras_model_checkpoint_chief_writes``      ``ModelCheckpoint._save_model``: every
                                             worker decides and saves, the chief's file
                                             lands (``tfdist.saving``'s protocol).
``keras_backup_and_restore_chief_writes``    ``BackupAndRestore``: the chief writes the
                                             backup atomically, the epoch inside the
                                             weights file; every worker restores it.
==========================================  ===========================================

Without another worker every patched method calls upstream's unchanged.

Example:
    >>> [fix.name for fix in FIXES]
    ['keras_model_checkpoint_chief_writes', 'keras_backup_and_restore_chief_writes']
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil

from tfdist import saving
from tfdist.compat import chief_writes
from tfdist.core import atomic, upstream
from tfdist.core.fix_registry import Fix, patch, targets

__all__ = [
    "KERAS_BACKUP_AND_RESTORE_CHIEF_WRITES",
    "KERAS_MODEL_CHECKPOINT_CHIEF_WRITES",
    "FIXES",
    "BACKUP_ATTRIBUTE",
    "embedded_position",
    "keras_model_checkpoint_chief_writes",
    "keras_backup_and_restore_chief_writes",
]

# The fixes' names, declared once (other layers import them).
KERAS_MODEL_CHECKPOINT_CHIEF_WRITES = "keras_model_checkpoint_chief_writes"
KERAS_BACKUP_AND_RESTORE_CHIEF_WRITES = "keras_backup_and_restore_chief_writes"

logger = logging.getLogger(__name__)

# The HDF5 attribute of a multi-worker backup's weights file that records the epoch and
# batch its weights belong to: the weights file is the backup's one atomic commit.
BACKUP_ATTRIBUTE = "tfdist_backup"


def _in_scope(model):
    """The model's own strategy scope (TensorFlow): tfdist's barriers then use that
    strategy instead of creating tfdist's own next to the one the script built."""
    strategy = getattr(model, "distribute_strategy", None)  # TF models only
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


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
    if callback.verbose > 0 and chief_writes.is_chief():
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
            if not chief_writes.multi_worker(self.model):
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
    chief = chief_writes.is_chief()
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
    if chief_writes.is_chief():
        atomic.remove_stale_staging(callback.backup_dir)  # left by a process killed mid-save
    try:
        upstream.keras_backup_load(callback)
    except OSError:
        if not os.path.exists(previous_weights):
            raise
        logger.warning("tfdist: %s is unreadable; restoring %s", weights, previous_weights)
        saving.sync_workers("BackupAndRestore repair", model=model)
        if chief_writes.is_chief():
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
    if chief_writes.is_chief():
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
            if not chief_writes.multi_worker(self.model):
                return original(self)
            with _in_scope(self.model):
                return _backup_save(self)

        return _save_model

    def make_begin(original):
        def on_train_begin(self, logs=None):
            if not chief_writes.multi_worker(self.model):
                return original(self, logs)
            with _in_scope(self.model):
                return _backup_restore(self)

        return on_train_begin

    def make_end(original):
        def on_train_end(self, logs=None):
            if not chief_writes.multi_worker(self.model):
                return original(self, logs)
            with _in_scope(self.model):
                return _backup_delete(self, original, logs)

        return on_train_end

    patch(owner, "_save_model", name, make_save)
    patch(owner, "on_train_begin", name, make_begin)
    patch(owner, "on_train_end", name, make_end)


# ------------------------------------------------------------------ the fixes

_MC = "keras.src.callbacks.model_checkpoint:ModelCheckpoint."
_BR = "keras.src.callbacks.backup_and_restore:BackupAndRestore."
_MODEL = "keras.src.models.model:Model."

FIXES: list[Fix] = [
    Fix(
        KERAS_MODEL_CHECKPOINT_CHIEF_WRITES,
        "Keras 3 ModelCheckpoint in a multi-worker job: every worker writes the same file "
        "('unable to lock file' from h5py, or a corrupt checkpoint)",
        chief_writes.tensorflow_or_jax,
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
        chief_writes.tensorflow_or_jax,
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
]
