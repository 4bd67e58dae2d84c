"""Keras's own file-writing callbacks in a multi-worker job: the chief writes, once, atomically.

Keras 3 dropped tf-keras's rule that non-chief workers write to a temporary path, so under
MultiWorkerMirroredStrategy, and in a multi-process JAX job, every worker writes the same
files: two ``ModelCheckpoint`` saves of one ``.weights.h5`` collide on h5py's file lock,
``BackupAndRestore`` races on creating its directory (``FileExistsError``) and can leave
a torn backup, ``CSVLogger`` and ``TensorBoard`` write every row and event N times. On
JAX, saving from process 0 only is no way out: ``save``/``save_weights`` gather the
variables across processes, so every process must take part in each save.

The fixes (one per callback or call, each a ``Fix`` in ``FIXES``) patch each callback's
write methods, not ``CallbackList``: a callback used outside ``fit`` is fixed too, and
each fix can be excluded on its own (``TFDIST_COMPAT_EXCLUDE``). ``ModelCheckpoint`` and
``BackupAndRestore`` are fixed in ``chief_checkpoints``, with the helpers here:

==========================================  ===========================================
``keras_csv_logger_chief_only``              ``CSVLogger``: non-chief rows go to
                                             ``os.devnull`` (no file at all).
``keras_tensorboard_chief_only``             ``TensorBoard``: non-chief events go to a
                                             temporary directory, removed at train end.
``keras_user_saves_chief_writes``            ``Model.save``/``save_weights``/``export``
                                             and ``keras.saving.save_model`` to a path:
                                             every worker saves, the chief's file lands.
==========================================  ===========================================

``EarlyStopping`` and ``ReduceLROnPlateau`` need no fix: they decide from the epoch's
logs, which are the same on every worker (metrics are reduced across all replicas), and
change only in-memory state (``stop_training``, the learning-rate variable) on each.

Without another worker (one process, or a model outside a multi-worker strategy) every
patched method calls upstream's unchanged.

Example:
    >>> [fix.name for fix in FIXES][0]
    'keras_csv_logger_chief_only'
"""

from __future__ import annotations

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
    "FIXES",
    "multi_worker",
    "is_chief",
    "tensorflow_or_jax",
    "keras_csv_logger_chief_only",
    "keras_tensorboard_chief_only",
    "keras_user_saves_chief_writes",
]

# The fixes' names, declared once (other layers import them).
KERAS_CSV_LOGGER_CHIEF_ONLY = "keras_csv_logger_chief_only"
KERAS_TENSORBOARD_CHIEF_ONLY = "keras_tensorboard_chief_only"
KERAS_USER_SAVES_CHIEF_WRITES = "keras_user_saves_chief_writes"


# Non-chief TensorBoard staging directories (callback -> the finalizer that removes its
# directory): removed at train end, or at exit if fit failed.
_TENSORBOARD_STAGING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def multi_worker(model) -> bool:
    return model is not None and saving.has_other_workers(model)


def is_chief() -> bool:
    return atomic.write_role().is_chief


def tensorflow_or_jax() -> bool:
    return on_keras_backend("tensorflow")() or on_keras_backend("jax")()


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
            if not multi_worker(self.model) or is_chief():
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
            if not multi_worker(model) or is_chief():
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
    return not multi_worker(model)


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


_MODEL = "keras.src.models.model:Model."


FIXES: list[Fix] = [
    Fix(
        KERAS_CSV_LOGGER_CHIEF_ONLY,
        "Keras 3 CSVLogger in a multi-worker job: every worker writes the same CSV file "
        "(rows and headers repeated, or overwritten)",
        tensorflow_or_jax,
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
        tensorflow_or_jax,
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
        tensorflow_or_jax,
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
