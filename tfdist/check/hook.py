"""The side of ``tfdist check`` that runs inside the user's unchanged script.

``tfdist check`` starts the script through ``python -m tfdist.bootstrap`` (or ``tfdist
launch``, whose workers run the same) with ``TFDIST_CHECK_DIR`` set. ``tfdist.startup``
then calls ``start()`` at once and ``on_keras_import()`` when Keras is imported; the
hook wraps ``keras.Model.fit`` so that the script's first ``fit``:

1. gets one more callback that records each step's logs (loss and metrics; for an
   epoch's last step the epoch's, see ``on_epoch_end`` below) and sets
   ``model.stop_training`` after ``TFDIST_CHECK_STEPS`` steps (Keras reads it after every
   batch: ``keras/src/backend/*/trainer.py``), and the initial weights at its first step;
2. when it returns, writes this process's result (``rank-R.npz``: weights after the
   steps and at the start, per variable path; ``rank-R.json``: history and facts), waits
   until every process of the job wrote its own (they all finished their collectives,
   so none is left waiting on a peer that is gone), and ends the process with
   ``os._exit(0)``: later saves, evaluations or prints of the script never run.

``rank-R.progress`` says how far the process got (started, in fit at step k), and a
``faulthandler`` timer writes every thread's stack to ``rank-R.stack`` shortly before
the check's timeout, so that a hang names the line it waits on.
``TFDIST_CHECK_SYNC_BN=1`` sets ``synchronized=True`` on every ``BatchNormalization`` of
the model before ``fit`` traces its step (a re-run that shows whether they are the cause);
``TFDIST_CHECK_INERT_RANDOM=1`` calls every random layer of the model (one that draws from
a ``keras.random.SeedGenerator``: ``Dropout``, ``GaussianNoise``, ``RandomFlip``...) in
inference mode, where it draws nothing, for the same purpose;
``TFDIST_CHECK_GLOBAL_BATCH=B`` batches ``fit``'s input at ``B`` (one device re-run at the
global batch of a topology whose global batch grew with its replicas).

Besides the history, each process's facts say what the causes need: the model's
``BatchNormalization`` and random layers, the global batch and the size of each epoch's
last batch (when ``fit``'s input tells them without reading data), a fingerprint of the
arrays given to ``fit`` and the auto-shard policy of a ``tf.data`` input.

Example:
    $ TFDIST_CHECK_DIR=/tmp/c TFDIST_CHECK_STEPS=5 python -m tfdist.bootstrap train.py
"""

from __future__ import annotations

import faulthandler
import functools
import os

from tfdist import backends
from tfdist.check.model import (
    DIR_ENV,
    INERT_RANDOM_ENV,
    STEPS_ENV,
    SYNC_BN_ENV,
    _path,
    _world,
    model_facts,
    progress,
    values,
    wait_for_peers,
    write_result,
)

__all__ = [
    "DIR_ENV",
    "STEPS_ENV",
    "SYNC_BN_ENV",
    "INERT_RANDOM_ENV",
    "GLOBAL_BATCH_ENV",
    "STACK_AFTER_ENV",
    "active",
    "start",
    "on_keras_import",
]

GLOBAL_BATCH_ENV = "TFDIST_CHECK_GLOBAL_BATCH"  # a global batch for fit's input
STACK_AFTER_ENV = "TFDIST_CHECK_STACK_AFTER"  # seconds: when to write the stacks
_FIX_NAME = "tfdist_check_fit"


def active() -> bool:
    """Whether this process runs under ``tfdist check``."""
    return bool(os.environ.get(DIR_ENV))


def start() -> None:
    """Called by ``tfdist.startup.install``: progress, and the stack dump before the timeout."""
    if not active():
        return
    progress("started")
    after = float(os.environ.get(STACK_AFTER_ENV, "0") or 0)
    if after > 0:
        # A bare descriptor, open for the life of the process: faulthandler writes to it
        # from its own thread, after Python objects may be gone.
        fd = os.open(_path("stack"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        faulthandler.dump_traceback_later(after, exit=False, file=fd)


def on_keras_import(keras) -> None:
    """Wraps ``keras.Model.fit`` (the script's first ``fit`` is the one measured)."""
    if not active():
        return
    from tfdist.core import fix_registry

    def install() -> None:
        fix_registry.patch(keras.Model, "fit", _FIX_NAME, _wrap_fit)

    # Applied the one way every patch is (guard, journal, record); fit is Keras's public
    # API, so no private target to fingerprint.
    record = fix_registry.Fix(
        _FIX_NAME, "tfdist check measures the first fit", lambda: True, install
    )
    reason = fix_registry.apply_fix(record)
    if reason is not None:
        raise RuntimeError(f"tfdist check cannot hook keras.Model.fit: {reason}")
    if backends.name() == "tensorflow":
        from tfdist.check.loops import tensorflow as loop

        loop.install()
    elif backends.name() == "jax":
        from tfdist.check.loops import jax as jax_loop

        jax_loop.install()


def _wrap_fit(original):
    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        steps = int(os.environ.get(STEPS_ENV, "20"))
        recorder = _recorder_class()(steps)
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), recorder]
        facts = model_facts([self])  # read when fit traces its step, just below
        rebatched = {}
        if os.environ.get(GLOBAL_BATCH_ENV):
            args, kwargs, rebatched = _at_global_batch(
                args, kwargs, int(os.environ[GLOBAL_BATCH_ENV])
            )
        facts = {**rebatched, **facts, **_input_facts(args, kwargs)}
        facts.update(_build_before_the_first_step(self, args, kwargs))
        progress("fit", step=0)
        try:
            original(self, *args, **kwargs)
        except BaseException as err:
            _write_failure(err)
            raise
        facts.update(
            steps_per_epoch=recorder.steps_per_epoch,
            history=recorder.history,
            replicas=_replicas(self),
        )
        final = _weights(self)
        if facts["replicas"] == 1 and _world() == 1:  # the reference: nothing is split
            facts.update(_batch_split(self, args, kwargs))
        write_result(final, recorder.initial, recorder.first or final, facts, recorder.done)
        wait_for_peers()
        os._exit(0)

    return fit


def _batch_split(model, args: tuple, kwargs: dict) -> dict:
    """Read after fit on fit's first batch: the model's outputs and loss whole against
    split in replica parts (``batch_split``: the evidence of ``batch_sum``), and each
    variable's gradient (``gradient_rms``: the tolerance's zero-signal rule)."""
    from tfdist.check import first_batch

    try:
        batch = first_batch.read(args, kwargs)
        if batch is None:
            return {}
        return {
            "batch_split": first_batch.split(model, *batch),
            "gradient_rms": first_batch.gradient_rms(model, *batch),
        }
    except Exception as err:  # a fact the check cannot read must not stop the script
        return {"batch_split_unread": f"{type(err).__name__}: {err}"[:200]}


def _build_before_the_first_step(model, args: tuple, kwargs: dict) -> dict:
    """Builds ``model`` before ``fit``'s first step where Keras would build it inside
    that step, so that its initial weights can be read at the step's start.

    On TensorFlow without a strategy of its own (one device), Keras builds a model that
    has no ``keras.Input`` (a subclassed one) while tracing its first step; with one
    (``N devices``, ``N workers``) and on JAX, ``fit`` builds it first from the spec of
    a batch (``Trainer._symbolic_build``). This calls that same build, from the spec of
    ``fit``'s input, so that one device starts as the others do. A fact says when it
    could not (an input whose spec is unknown without reading it).
    """
    from tfdist.core import upstream

    if model.built or backends.name() != "tensorflow":
        return {}
    if upstream.keras_model_strategy_or_none(model) is not None:
        return {}  # fit builds it before its first step (see above)
    try:
        batch = _symbolic_batch(args, kwargs)
        if batch is None:
            return {"unbuilt": "fit's input tells no batch spec: a generator or PyDataset"}
        with model.distribute_strategy.scope():
            upstream.keras_symbolic_build(model, batch)
    except Exception as err:  # the check must not stop the script: Keras builds it then
        return {"unbuilt": f"{type(err).__name__}: {err}"[:200]}
    return {"built_before_fit": True}


def _symbolic_batch(args: tuple, kwargs: dict):
    """``(x, y, sample_weight)`` of ``keras.KerasTensor`` from ``fit``'s arrays or
    ``tf.data`` input (the batch dimension None), or None."""
    import keras

    names = ("x", "y", "batch_size", "epochs", "verbose", "callbacks", "validation_split")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    x = given.get("x")
    if x is not None and _is_dataset(x):
        specs = x.element_spec
        batch = keras.tree.map_structure(
            lambda s: keras.KerasTensor(tuple(s.shape), s.dtype.name), specs
        )
        return batch if isinstance(batch, tuple) else (batch,)
    data = (x, given.get("y"), given.get("sample_weight"))
    if not _array_leaves(data):
        return None
    return keras.tree.map_structure(
        lambda a: None if a is None else keras.KerasTensor((None, *a.shape[1:]), a.dtype.name),
        data,
    )


def _at_global_batch(args: tuple, kwargs: dict, batch: int) -> tuple[tuple, dict, dict]:
    """fit's input batched at ``batch`` (a re-run of one device at another topology's
    global batch): arrays through ``batch_size``, a ``tf.data`` input through
    ``Dataset.rebatch`` (the same examples in the same order); the fact says which, or
    why not (a generator, a ``PyDataset``: their batches are the script's own).

    Example: ``fit(x, y, batch_size=64)`` at 128 -> ``fit(x, y, batch_size=128)``.
    """
    given, kwargs = list(args), dict(kwargs)
    x = given[0] if given else kwargs.get("x")
    if x is not None and _is_dataset(x):
        rebatched = x.rebatch(batch)
        if given:
            given[0] = rebatched
        else:
            kwargs["x"] = rebatched
        return tuple(given), kwargs, {"rebatched": batch}
    if _array_leaves((x,)):
        if len(given) > 2:  # fit(x, y, batch_size, ...): Keras's order
            given[2] = batch
        else:
            kwargs["batch_size"] = batch
        return tuple(given), kwargs, {"rebatched": batch}
    kind = type(x).__name__
    return args, kwargs, {"rebatch_failed": f"fit's input is a {kind}: not rebatched"}


def _input_facts(args: tuple, kwargs: dict) -> dict:
    """What fit's input tells without reading data: ``batch`` (the global batch) and
    ``last`` (each epoch's last batch) when known, the arrays' ``fingerprint``, and a
    ``tf.data`` input's ``shard_policy``.

    Example: ``fit(x[:500], y[:500], batch_size=32)`` -> ``{"batch": 32, "last": 20,
    "fingerprint": "..."}``.
    """
    try:
        return _read_input(args, kwargs)
    except Exception as err:  # a fact the check cannot read must not stop the script
        return {"input_unread": f"{type(err).__name__}: {err}"[:200]}


def _read_input(args: tuple, kwargs: dict) -> dict:
    names = ("x", "y", "batch_size")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    x = given.get("x")
    if _is_dataset(x):
        return {"shard_policy": _shard_policy(x), **_dataset_batches(x, given)}
    leaves = _array_leaves((x, given.get("y")))
    if not leaves or given.get("steps_per_epoch"):
        return {}
    facts: dict = {"fingerprint": _fingerprint(leaves)}
    batch = given.get("batch_size") or 32  # Keras's default for arrays
    count = len(leaves[0])
    split = given.get("validation_split") or 0.0
    if split:
        count = int(count * (1.0 - split))  # Keras keeps floor(n * (1 - split)) for training
    if count:
        facts.update(batch=batch, last=count % batch or batch)
    return facts


def _is_dataset(x) -> bool:
    import sys

    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(x, tf.data.Dataset)


def _shard_policy(dataset) -> str:
    """The auto-shard policy ``dataset`` asks for (``AUTO`` unless its options set one)."""
    return dataset.options().experimental_distribute.auto_shard_policy.name


def _dataset_batches(dataset, given: dict) -> dict:
    """The batch and the last batch of a ``tf.data`` input, when its pipeline says."""
    from tfdist.core import batch_order

    sizes = None if given.get("steps_per_epoch") else batch_order.batch_sizes(dataset)
    if not sizes:
        # A static batch dimension: every batch holds it (batch(..., drop_remainder=True)).
        first = next(iter(_flat_specs(dataset.element_spec)), None)
        shape = getattr(first, "shape", None)
        dim = shape[0] if shape is not None and shape.rank else None
        return {"batch": int(dim), "last": int(dim)} if dim else {}
    return {"batch": max(sizes), "last": min(sizes)}


def _flat_specs(spec) -> list:
    import tensorflow as tf

    return tf.nest.flatten(spec)


def _array_leaves(data) -> list:
    """The numpy arrays in ``data`` (nested tuples, lists, dicts); [] when any leaf is not one."""
    import numpy as np

    leaves, todo = [], [data]
    while todo:
        item = todo.pop(0)
        if item is None:
            continue
        if isinstance(item, dict):
            todo.extend(item[k] for k in sorted(item))
        elif isinstance(item, list | tuple):
            todo.extend(item)
        elif isinstance(item, np.ndarray):
            leaves.append(item)
        else:
            return []  # a tensor, a generator, a PyDataset: not hashed
    return leaves


def _fingerprint(arrays: list) -> str:
    """A short hash of the arrays' shapes and bytes: equal arrays, equal fingerprints."""
    import hashlib

    import numpy as np

    digest = hashlib.blake2b(digest_size=8)
    for array in arrays:
        digest.update(repr((array.shape, array.dtype.str)).encode())
        digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def _recorder_class():
    """A ``keras.callbacks.Callback`` subclass, made once Keras is imported."""
    import keras
    import numpy as np

    class Recorder(keras.callbacks.Callback):
        """Each step's logs; the weights at the first step; stops after ``steps`` steps."""

        def __init__(self, steps: int):
            super().__init__()
            self.steps, self.done = steps, 0
            self.history: dict[str, list[float]] = {}
            self.initial: dict[str, np.ndarray] | None = None
            self.first: dict[str, np.ndarray] | None = None  # after the first step
            self.steps_per_epoch: int | None = None

        def on_train_batch_begin(self, batch, logs=None):
            if self.initial is None:
                self.initial = _weights(self.model)
                # Steps per epoch: a global batch that grows with the replicas shows here.
                self.steps_per_epoch = self.params.get("steps")
            elif self.first is None:
                self.first = _weights(self.model)

        def on_train_batch_end(self, batch, logs=None):
            self.done += 1
            for key, value in (logs or {}).items():
                self.history.setdefault(key, []).append(float(np.asarray(value)))
            progress("fit", step=self.done)
            if self.done >= self.steps:
                self.model.stop_training = True

        def on_epoch_end(self, epoch, logs=None):
            # The values of an epoch's last step are the epoch's, read from the metrics
            # across the replicas. What Keras logs for a step is the mean of the replicas'
            # own running means (reduce_per_replica "mean"): after a batch the replicas
            # shared unevenly (11 + 10) that mean differs from one device's by ~1e-5,
            # though every example weighed what it does on one device. On one device both
            # are the same number.
            for key, value in (logs or {}).items():
                if self.history.get(key):
                    self.history[key][-1] = float(np.asarray(value))

    return Recorder


def _replicas(model) -> int | None:
    """How many replicas ``model`` trained on: its strategy's (TensorFlow), or the devices
    its variables are laid out on (JAX; 1 without a distribution)."""

    if backends.name() == "tensorflow":
        return int(model.distribute_strategy.num_replicas_in_sync)
    # On JAX the devices a model's variables live on: tfdist.scope() sets Keras's
    # distribution only while the model is built, so fit may run with none set.
    devices = {d for w in model.weights for d in getattr(w.value.sharding, "device_set", ())}
    return max(len(devices), 1)


def _weights(model) -> dict:
    """``{variable path: numpy array}`` of the model's weights."""
    return values(model.weights)


def _write_failure(err: BaseException) -> None:
    progress("failed", error=f"{type(err).__name__}: {err}"[:500])
