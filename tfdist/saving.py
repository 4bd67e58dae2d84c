"""Saving and loading models inside or outside a strategy scope, with atomic, chief-only writes.

``save`` writes a ``.keras`` archive, a ``.weights.h5`` file or a SavedModel export
(a directory, for serving). Every worker of a multi-worker job must call it, because
reading distributed variables can take part in collectives (TF's all-reduces, the
cross-process gather of a JAX array), but only the chief's file lands at ``path``: the
others write to a temporary directory that is removed. The chief writes to a temporary
name in the same directory, flushes it to disk and renames it over ``path``, so a crash
at any moment leaves either the old file or the new one, never a half-written file
under the final name. A URL path (``gs://``, ``s3://``, any fsspec filesystem) is written
locally, uploaded under a staging name and moved onto ``path``; ``tfdist.core.storage`` says
what that guarantees on each kind of store. ``save`` returns on every worker only once
the chief's file is in place (a ``tfdist.barrier``), so ``save`` then ``load`` works on
every worker.

"Every worker calls it": ``save``, ``load(in_scope=True)``, and Keras's ``fit``,
``evaluate`` and ``predict`` on a distributed model. Called on some workers only,
``save`` and ``load(in_scope=True)`` end after their barrier's timeout with an error
naming this rule, never a hang.

``load`` reads any of the three back, outside a scope or inside one (possibly a scope
with another replica count than the one that saved), with Keras's ``safe_mode`` on by
default.

Example:
    >>> import tfdist
    >>> tfdist.save(model, "model.keras")                   # doctest: +SKIP
    >>> model = tfdist.load("model.keras", in_scope=True)   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import zipfile
from collections.abc import Mapping

from tfdist import distribute
from tfdist.core import cluster as _cluster
from tfdist.core import storage, upstream, validate
from tfdist.core.atomic import WriteRole, atomic_output, write_role

__all__ = [
    "FORMATS",
    "format_of",
    "sync_workers",
    "load",
    "save",
]

logger = logging.getLogger(__name__)

# format name -> how a path says it
FORMATS = {
    "keras": "a path ending in .keras (the Keras archive; loads with keras.models.load_model)",
    "weights": "a path ending in .weights.h5 (weights and optimizer state only)",
    "saved_model": "a directory path without a file suffix (a SavedModel export for serving)",
}


# Numbers the barriers of saves and loads, in call order: every worker makes the same
# calls in the same order, so the n-th barrier has the same name on every worker.
_SYNCS = itertools.count(1)


def sync_workers(what: str, *, timeout: float | None = None, model=None) -> None:
    """Waits until every worker reaches the same point of the same call (one worker: no-op).

    ``model``, when given, tells on TensorFlow whether other workers take part (its
    strategy is multi-worker); without a cluster nothing is asked of the framework.

    Raises:
        RuntimeError: not every worker arrived within ``timeout`` seconds (default
            ``tfdist.config.BARRIER_TIMEOUT_S``); the message names the rule broken.

    Example:
        >>> sync_workers("tfdist.save model.keras")  # doctest: +SKIP
    """
    if not _has_other_workers(model):
        return
    label = f"{what} #{next(_SYNCS)}"
    try:
        distribute.barrier(label, timeout=timeout)
    except RuntimeError as err:
        raise RuntimeError(
            f"{what}: every worker must call this (save, load in a scope, checkpoints, "
            "fit, evaluate and predict are collective: the chief waits for the others). "
            f"{err}"
        ) from None


def _has_other_workers(model) -> bool:
    if not _cluster.cluster_from_env().is_multi_worker:
        return False  # and no strategy is created just to ask
    strategy = getattr(model, "distribute_strategy", None)  # TF models only
    return strategy is None or upstream.tf_in_multi_worker_mode(strategy)


def format_of(path: str | os.PathLike) -> str:
    """The save format a path asks for: ``keras``, ``weights`` or ``saved_model``.

    Raises:
        ValueError: for a suffix tfdist does not write (``.h5`` legacy files, ``.pb``, ...).

    Example:
        >>> format_of("model.keras"), format_of("w.weights.h5"), format_of("export/1")
        ('keras', 'weights', 'saved_model')
    """
    text = validate.path_text(path, "path", "format_of")
    name = os.path.basename(text.rstrip("/\\"))
    if name.endswith(".keras"):
        return "keras"
    if name.endswith(".weights.h5"):
        return "weights"
    if os.path.splitext(name)[1] == "" or name.isdigit():
        return "saved_model"
    choices = "; ".join(f"{k}: {v}" for k, v in FORMATS.items())
    raise ValueError(
        f"tfdist.save: cannot tell the format from the path. Received: path={text!r}. "
        f"Use one of: {choices}."
    )


def save(
    model, path: str | os.PathLike, *, overwrite: bool = True, timeout: float | None = None
) -> str:
    """Saves ``model`` atomically as a ``.keras`` archive, ``.weights.h5`` file or SavedModel.

    The format follows the path: ``*.keras`` (architecture, weights, optimizer state;
    loads with ``keras.models.load_model``), ``*.weights.h5`` (weights and optimizer
    state) or a directory path without a suffix (a SavedModel with a ``serve``
    endpoint, for TF Serving and ``tf.saved_model.load``). Works inside or outside a
    strategy scope. Under multi-worker training (TF or JAX) every worker must call it:
    all of them take part in reading the variables, only the chief's output lands at
    ``path``, and it returns on every worker once that file is in place, so every
    worker can ``load`` it next.

    Args:
        model: a built ``keras.Model``.
        path: destination; its form picks the format (see above). A URL (``gs://``,
            ``s3://``, any fsspec filesystem) is written locally, then uploaded (see
            ``tfdist.core.storage`` for what each store guarantees).
        overwrite: replace an existing file; with False an existing path is an error.
        timeout: seconds to wait for the other workers (default
            ``tfdist.config.BARRIER_TIMEOUT_S``); unused on one worker.

    Returns:
        The absolute path written (also on workers, which write nothing there).

    Raises:
        TypeError: ``model`` is not a Keras model, ``path`` is not a path, or
            ``overwrite`` is not a bool.
        ValueError: the path's suffix names no supported format, or the model is not built.
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        RuntimeError: not every worker called ``save`` within ``timeout``.

    Example:
        >>> with tfdist.scope():                       # doctest: +SKIP
        ...     model = build_and_compile()
        >>> tfdist.save(model, "out/model.keras")      # doctest: +SKIP
        '/abs/out/model.keras'
        >>> tfdist.save(model, "export/1")  # a SavedModel  # doctest: +SKIP
    """
    text, fmt = _save_arguments(model, path, overwrite)
    timeout = _timeout(timeout, "tfdist.save")
    final = storage.normalize(text, "tfdist.save")
    role = write_role()
    # Checked on every worker, not only the chief: a worker that went on into the save's
    # collectives while the chief stopped here would wait for it (shared storage assumed).
    _check_destination(final, text, overwrite)
    if role.is_chief:
        storage.makedirs(storage.dirname(final))
    what = f"tfdist.save({storage.basename(final)!r})"
    # First every worker arrives: a save called on the chief only fails here, clearly,
    # instead of waiting forever in the collectives of reading the variables.
    sync_workers(what, timeout=timeout, model=model)
    with atomic_output(final, role=role) as staging:
        _write(model, staging, fmt)
    sync_workers(
        what, timeout=timeout, model=model
    )  # the chief's file is in place for every worker
    if role.is_chief:
        logger.info("tfdist: saved %s as %s", model.name, final)
    return final


def _timeout(value, where: str) -> float | None:
    """None (the default barrier timeout) or a positive number of seconds."""
    if value is None:
        return None
    return validate.positive_number(value, "timeout", where, "Pass seconds, e.g. 60, or None.")


def _save_arguments(model, path, overwrite) -> tuple[str, str]:
    """``save``'s checks of its arguments; returns the path as text and its format."""
    import keras

    where = "tfdist.save"
    validate.instance(
        model, keras.Model, "model", where, "a keras.Model", f"It is a {type(model).__name__}."
    )
    text = validate.path_text(path, "path", where)
    fmt = format_of(text)
    validate.instance(overwrite, bool, "overwrite", where, "a bool")
    if not model.built:
        raise ValueError(
            f"{where}: the model is not built, so it has no weights to save. "
            f"Received: model={model.name!r}, path={text!r}. Call the model on a batch, or "
            "give it a keras.Input, before saving."
        )
    return text, fmt


def _check_destination(final: str, text: str, overwrite: bool) -> None:
    if storage.exists(final) and not overwrite:
        raise FileExistsError(
            f"tfdist.save: {final!r} exists and overwrite=False. Received: path={text!r}. "
            "Pass overwrite=True or choose another path."
        )
    if storage.isfile(storage.dirname(final)):
        raise NotADirectoryError(
            f"tfdist.save: the parent of path is a file, not a directory. "
            f"Received: path={text!r}. Choose a path inside a directory."
        )


def _write(model, staging: str, fmt: str) -> None:
    if fmt == "keras":
        model.save(staging)
    elif fmt == "weights":
        model.save_weights(staging)
    else:
        model.export(staging, format="tf_saved_model", verbose=False)


def load(
    path: str | os.PathLike,
    *,
    in_scope: bool = False,
    strategy=None,
    safe_mode: bool = True,
    compile: bool = True,
    custom_objects: Mapping | None = None,
    model=None,
    timeout: float | None = None,
):
    """Loads what ``save`` wrote, outside a strategy scope or inside one.

    * ``*.keras``: returns the model (``keras.models.load_model``), compiled with its
      optimizer state when ``compile`` is True.
    * ``*.weights.h5``: loads into ``model`` (which you build) and returns it.
    * a SavedModel directory: returns ``tf.saved_model.load(path)``; call its ``serve``.

    With ``in_scope=True`` (or an explicit ``strategy``) the variables are created in
    that strategy's scope (mirrored on its devices; under JAX, laid out by the
    ``keras.distribution``), whatever the replica count of the job that saved the file.
    Under multi-worker training every worker must then call ``load`` (creating
    distributed variables is collective): called on the chief only, it fails after
    ``timeout`` seconds with an error naming that rule. Without a scope any process
    may load on its own. ``safe_mode`` stays on unless you turn it off: an archive
    that would run Python code on load (a ``Lambda`` layer holding a lambda) is refused
    before any of that code runs. Legacy ``.h5`` full-model files, which can embed such
    code too, are refused in safe mode.

    Args:
        path: a ``.keras`` file, a ``.weights.h5`` file or a SavedModel directory; a
            URL is downloaded to a temporary local copy first.
        in_scope: create the variables inside the scope of ``strategy`` (the current
            one when None, see ``tfdist.strategy()``).
        strategy: a ``tf.distribute.Strategy`` to load into; implies ``in_scope``.
        safe_mode: refuse archives that would deserialize Python code (default True).
        compile: compile a ``.keras`` model after loading (restores the optimizer).
        custom_objects: classes/functions a ``.keras`` model needs, by name.
        model: a built model to load a ``.weights.h5`` file into (that format only).
        timeout: seconds to wait for the other workers with ``in_scope``/``strategy``
            (default ``tfdist.config.BARRIER_TIMEOUT_S``).

    Raises:
        FileNotFoundError: nothing at ``path``.
        TypeError: ``path`` is not a path, a flag is not a bool, or ``model`` is not a
            ``keras.Model``.
        ValueError: unsafe content with ``safe_mode=True``, a weights file without a
            ``model`` (or with an unbuilt one), or a path whose format is unknown.
        RuntimeError: ``in_scope`` on some workers only (after ``timeout``).

    Example:
        >>> model = tfdist.load("model.keras")                   # doctest: +SKIP
        >>> model = tfdist.load("model.keras", in_scope=True)    # doctest: +SKIP
        >>> served = tfdist.load("export/1"); served.serve(x)    # doctest: +SKIP
    """
    where = "tfdist.load"
    text = validate.path_text(path, "path", where)
    timeout = _timeout(timeout, where)
    for name, value in (("in_scope", in_scope), ("safe_mode", safe_mode), ("compile", compile)):
        validate.instance(value, bool, name, where, "a bool")
    if storage.is_url(text):
        _load_format(text)  # nothing there: FileNotFoundError before any download
        with storage.local_copy(text) as local:
            return load(local, in_scope=in_scope, strategy=strategy, safe_mode=safe_mode,
                        compile=compile, custom_objects=custom_objects, model=model,
                        timeout=timeout)  # fmt: skip
    if text.lower().startswith("file://"):
        text = storage.normalize(text, where)
    fmt = _load_format(text)
    if model is not None and fmt != "weights":
        raise ValueError(
            f"{where}: model= is only for .weights.h5 files. Received: path={text!r}, "
            f"model={model!r}. Drop model=, the {fmt} format carries its own architecture."
        )
    if in_scope or strategy is not None:
        sync_workers(f"tfdist.load({os.path.basename(text)!r}, in_scope=True)", timeout=timeout)
    with _scope_for(in_scope, strategy):
        if fmt == "keras":
            return _load_keras(text, safe_mode, compile, custom_objects)
        if fmt == "legacy_h5":
            return _load_legacy_h5(text, safe_mode, compile, custom_objects)
        if fmt == "weights":
            return _load_weights(text, model)
        import tensorflow as tf

        return tf.saved_model.load(text)


def _load_format(text: str) -> str:
    """What is at ``text``: ``keras``, ``weights``, ``saved_model`` or ``legacy_h5``."""
    if not (storage.exists(text) if storage.is_url(text) else os.path.exists(text)):
        raise FileNotFoundError(
            f"tfdist.load: nothing at path. Received: path={text!r}. Pass the path "
            "tfdist.save (or model.save/model.export) wrote."
        )
    name = os.path.basename(text.rstrip("/\\"))
    if os.path.isdir(text):
        return "saved_model"
    if name.endswith((".h5", ".hdf5")) and not name.endswith(".weights.h5"):
        return "legacy_h5"
    return format_of(text)


def _scope_for(in_scope: bool, strategy):
    if strategy is None and not in_scope:
        return contextlib.nullcontext()
    return distribute.current(strategy).scope()


def _load_legacy_h5(path: str, safe_mode: bool, compile: bool, custom_objects):
    import keras

    if safe_mode:
        raise ValueError(
            f"tfdist.load: refusing a legacy HDF5 model file in safe mode, because it "
            f"can embed Python code that runs on load. Received: path={path!r}. "
            "Re-save it as .keras, or pass safe_mode=False if you trust the file."
        )
    return keras.models.load_model(
        path, custom_objects=custom_objects, compile=compile, safe_mode=False
    )


def _load_keras(path: str, safe_mode: bool, compile: bool, custom_objects):
    import keras

    if not zipfile.is_zipfile(path):
        raise ValueError(
            "tfdist.load: path is not a .keras archive (not a zip file); it may be truncated "
            f"or corrupt. Received: path={path!r}. Load an intact copy."
        )
    try:
        return keras.models.load_model(
            path, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode
        )
    except ValueError as err:
        if safe_mode and "safe_mode" in str(err):
            raise ValueError(
                f"tfdist.load: refused {path!r} in safe mode: it holds Python code (such as a "
                "Lambda layer's lambda) that would run on load, and none of it was run. "
                "Pass safe_mode=False only if you trust where the file came from. "
                f"Keras said: {err}"
            ) from err
        raise


def _model_scope(model):
    """The scope of the strategy the model was built in (TF); JAX models carry none."""
    strategy = getattr(model, "distribute_strategy", None)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _load_weights(path: str, model):
    import keras

    if model is None:
        raise ValueError(
            f"tfdist.load: a .weights.h5 file holds no architecture. Received: path={path!r}, "
            "model=None. Build and compile the model, then pass it: "
            "tfdist.load(path, model=model)."
        )
    what, hint = "a built keras.Model", "Give it a keras.Input (or call it once) first."
    validate.instance(model, keras.Model, "model", "tfdist.load", what, hint)
    if not model.built:
        raise ValueError(validate.message("tfdist.load", "model", what, model, hint))
    if getattr(model, "optimizer", None) is not None and not model.optimizer.built:
        # Keras skips optimizer state (with only a warning) when the optimizer has no
        # variables yet; build them (in the model's own strategy scope, where its
        # variables live) so that iterations and slots are restored too.
        with _model_scope(model):
            model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return model


# ------------------------------------------------------------------ save's protocol, reused
# (tfdist.compat.chief_checkpoints: Keras's own ModelCheckpoint and BackupAndRestore)


def has_other_workers(model=None) -> bool:
    """Whether saving ``model`` involves other workers (a multi-worker job trains it).

    Example:
        >>> has_other_workers()  # no cluster in the environment
        False
    """
    return _has_other_workers(model)


def write_on_every_worker(model, path: str | os.PathLike, write, *, what: str) -> str:
    """``save``'s protocol for any writer: every worker calls ``write(staging)`` (reading
    the variables may be collective), only the chief's output lands at ``path``
    (atomically), and every worker returns once it is there.

    For writes ``save`` does not make itself: Keras's legacy ``.h5``, a file completed
    before it lands (a backup that carries its metadata).

    Example:
        >>> writer = model.save_weights                                   # doctest: +SKIP
        >>> write_on_every_worker(model, "w.weights.h5", writer, what="w")  # doctest: +SKIP
        '/abs/w.weights.h5'
    """
    final = storage.normalize(path, "write_on_every_worker")
    if not callable(write):
        raise TypeError(
            f"write_on_every_worker: write must be a function of the staging path. "
            f"Received: write={write!r}. Pass e.g. model.save_weights."
        )
    role = write_role()
    if role.is_chief:
        storage.makedirs(storage.dirname(final))
    sync_workers(what, model=model)  # a call on some workers only fails here, clearly
    with atomic_output(final, role=role) as staging:
        write(staging)
    sync_workers(what, model=model)  # the chief's file is in place for every worker
    return final


def needs_every_process(model) -> bool:
    """Whether reading ``model``'s variables needs every process: some variable is a JAX
    array sharded across processes (neither on this process alone nor replicated here).
    Mirrored TensorFlow variables and replicated JAX arrays are read locally.

    Example:
        >>> needs_every_process(model)  # doctest: +SKIP
        False
    """
    variables = list(getattr(model, "variables", []))
    optimizer = getattr(model, "optimizer", None)
    variables += list(getattr(optimizer, "variables", None) or [])
    for variable in variables:
        value = getattr(variable, "value", None)
        if getattr(value, "is_fully_addressable", True) is False and not getattr(
            value, "is_fully_replicated", False
        ):
            return True
    return False


def write_alone(model, path: str | os.PathLike, write, *, what: str):
    """A save this worker makes on its own: ``write(staging)``, flushed and renamed onto
    ``path`` (atomic), with no wait for any other worker; returns what ``write`` returned.

    Two workers saving one path each rename a whole file of their own (the last one
    stays). A model sharded across processes cannot be read by one process alone: its
    save takes ``write_on_every_worker``'s protocol, whose error names the rule when a
    process does not come.

    Example:
        >>> write_alone(model, "/shared/model.keras", model.save, what="model.save")  # doctest: +SKIP
    """
    final = storage.normalize(path, what)
    if needs_every_process(model):
        what = f"{what} of a model sharded across workers (every worker must call it)"
        return write_on_every_worker(model, final, write, what=what)
    upstream.keras_warm_save_skipsets()  # Keras's first save is collective on JAX otherwise
    # Every worker is a "chief" of its own save: its staging lands, under its own name.
    own = WriteRole(is_chief=True, rank=write_role().rank)
    with atomic_output(final, role=own) as staging:
        return write(staging)


__all__ += [
    "has_other_workers",
    "needs_every_process",
    "write_alone",
    "write_on_every_worker",
]
