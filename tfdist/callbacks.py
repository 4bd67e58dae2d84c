"""Keras callbacks for distributed jobs: LR decay, PrintLR, warm-up, checkpoints, the standard set.

Each is a real ``keras.callbacks.Callback`` built on Keras's own pieces
(``LearningRateScheduler``, ``ModelCheckpoint``, ``TensorBoard``), fixed where Keras 3
falls short for restartable, multi-worker jobs: ``PrintLR`` reads
``optimizer.learning_rate`` (Keras 3 optimizers have no ``.lr``) and evaluates a
``LearningRateSchedule`` at the current step; anything that prints or writes logs does
so on the chief only.

Example:
    >>> import tfdist
    >>> def decay(epoch):
    ...     return 1e-3 if epoch < 3 else 1e-4 if epoch < 7 else 1e-5
    >>> callbacks = tfdist.callbacks.standard("ckpt/", decay=decay)  # doctest: +SKIP
    >>> model.fit(train, epochs=12, callbacks=callbacks)              # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
from collections.abc import Callable, Mapping

import keras

from tfdist import distribute
from tfdist.checkpoint import ResumableCheckpoint, ShardedCheckpoint, is_resumed_partial_epoch
from tfdist.checkpoint.restore import finish_resumed_epoch
from tfdist.checkpoint.rng import numpy_value
from tfdist.core import storage, upstream, validate

__all__ = [
    "Decay",
    "PrintLR",
    "ResumableCheckpoint",
    "Warmup",
    "checkpoint",
    "current_learning_rate",
    "decay",
    "scale_learning_rate",
    "standard",
    "warmup",
]

logger = logging.getLogger(__name__)


def current_learning_rate(optimizer) -> float:
    """The rate ``optimizer`` applies at its current step, as a Python float.

    Works for a float rate, a rate changed by a callback, and a
    ``keras.optimizers.schedules.LearningRateSchedule`` (evaluated at
    ``optimizer.iterations``). Keras 3 optimizers have no ``.lr``; this is the
    replacement for the tutorials' ``model.optimizer.lr.numpy()``.

    Example:
        >>> current_learning_rate(keras.optimizers.SGD(0.1))  # doctest: +ELLIPSIS
        0.1...
    """
    validate.instance(
        optimizer,
        keras.optimizers.Optimizer,
        "optimizer",
        "current_learning_rate",
        "a keras.optimizers.Optimizer",
        "Pass model.optimizer of a compiled model.",
    )
    # Keras 3's learning_rate property already evaluates a schedule at self.iterations.
    return float(numpy_value(optimizer.learning_rate))


def _rate(value, name: str, where: str, hint: str = "") -> float:
    """A learning rate: a finite number > 0 (TypeError for a non-number)."""
    return validate.number(
        value, name, where, hint, low=0.0, low_ok=False, what="a positive finite number"
    )


# --------------------------------------------------------------------------- decay


_DECAY = "tfdist.callbacks.decay"


def _mapping_schedule(boundaries: Mapping) -> Callable[[int, float], float]:
    """``(epoch, lr) -> rate`` for ``{first_epoch: rate}``; ``lr`` before the first key."""
    where = _DECAY
    if not boundaries:
        raise ValueError(
            f"{where}: the mapping of epoch boundaries to rates is empty. "
            f"Received: schedule={boundaries!r}. Pass e.g. {{0: 1e-3, 3: 1e-4, 7: 1e-5}}."
        )
    hint = f"The schedule was {dict(boundaries)!r}."
    table = sorted(
        (
            validate.integer(epoch, "mapping keys", where, hint, low=0, what="epochs (ints >= 0)"),
            _rate(rate, f"schedule[{epoch}]", where),
        )
        for epoch, rate in boundaries.items()
    )

    def fn(epoch, lr):
        rate = float(lr)
        for start, value in table:
            if epoch >= start:
                rate = value
        return rate

    return fn


def _callable_schedule(schedule: Callable) -> Callable[[int, float], float]:
    """``(epoch, lr) -> rate`` for a schedule taking ``epoch`` or ``(epoch, lr)``."""
    try:
        takes_rate = len(inspect.signature(schedule).parameters) >= 2
    except (TypeError, ValueError):  # builtins without a signature: epoch only
        takes_rate = False

    def fn(epoch, lr):
        rate = schedule(epoch, lr) if takes_rate else schedule(epoch)
        try:
            return _rate(rate, "rate", _DECAY)
        except (TypeError, ValueError):
            # ValueError even for a wrong type: LearningRateScheduler takes a TypeError
            # for "the schedule takes only epoch" and would call fn(epoch) again.
            raise ValueError(
                f"{_DECAY}: the schedule must return a positive float. Received: "
                f"schedule({epoch}) returned {rate!r}."
            ) from None

    return fn


class Decay(keras.callbacks.LearningRateScheduler):
    """``LearningRateScheduler`` that leaves the rate alone in a resumed partial epoch.

    A checkpoint taken mid-epoch already holds the rate of that epoch (it is an
    optimizer variable); applying a schedule of the form ``lr -> lr * 0.9`` again at the
    start of the resumed epoch would change it twice. Create it with ``decay(...)``.
    """

    def on_epoch_begin(self, epoch, logs=None):
        if is_resumed_partial_epoch(self.model, epoch):
            return
        super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        finish_resumed_epoch(self.model, epoch)


def decay(schedule: Callable | Mapping, *, verbose: int = 0) -> Decay:
    """Sets the learning rate at the start of each epoch, like the guides' ``decay``.

    Args:
        schedule: either a callable ``epoch -> rate`` (or ``(epoch, rate) -> rate``),
            epochs counted from 0; or a mapping of epoch boundaries to rates,
            ``{0: 1e-3, 3: 1e-4, 7: 1e-5}`` meaning 1e-3 for epochs 0-2, 1e-4 for 3-6 and
            1e-5 from 7 on (epochs before the first key keep the optimizer's rate).
        verbose: 1 prints each change (Keras's ``LearningRateScheduler`` message).

    Returns:
        A ``keras.callbacks.LearningRateScheduler`` (the ``Decay`` subclass).

    Raises:
        TypeError: ``schedule`` is neither callable nor a mapping.
        ValueError: a mapping with a negative or non-int epoch, or a non-positive rate.

    Example:
        >>> def decay_fn(epoch):
        ...     return 1e-3 if epoch < 3 else 1e-4 if epoch < 7 else 1e-5
        >>> callback = decay(decay_fn)
        >>> callback = decay({0: 1e-3, 3: 1e-4, 7: 1e-5})
    """
    validate.instance(
        schedule,
        (Mapping, Callable),
        "schedule",
        _DECAY,
        "a callable epoch -> rate or a mapping {epoch: rate}",
    )
    if isinstance(schedule, Mapping):
        fn = _mapping_schedule(schedule)
    else:
        fn = _callable_schedule(schedule)
    validate.one_of(verbose, (0, 1), "verbose", _DECAY)
    return Decay(fn, verbose=verbose)


_make_decay = decay  # ``standard`` has a ``decay`` argument that hides this function


# --------------------------------------------------------------------------- PrintLR


class PrintLR(keras.callbacks.Callback):
    """Prints the learning rate at the end of each epoch, on the chief only.

    The rate is the one the optimizer applies at its current step: a float, a rate set
    by ``decay``/``warmup``, or a ``LearningRateSchedule`` evaluated at
    ``optimizer.iterations``. Also records it as ``logs["learning_rate"]``.

    Example:
        >>> model.fit(x, y, epochs=2, callbacks=[PrintLR()])  # doctest: +SKIP
        Learning rate for epoch 1 is 0.001
    """

    def on_epoch_end(self, epoch, logs=None):
        rate = current_learning_rate(self.model.optimizer)
        if logs is not None:
            logs.setdefault("learning_rate", rate)
        if distribute.is_chief():
            print(f"\nLearning rate for epoch {epoch + 1} is {rate:.6g}", flush=True)


# --------------------------------------------------------------------------- warm-up


def scale_learning_rate(base_lr: float, *, strategy=None) -> float:
    """The linear scaling rule: ``base_lr`` times the number of replicas in sync.

    When the global batch grows with the replica count (``tfdist.global_batch_size``),
    each step averages over ``replicas`` times more examples, so the rate tuned for one
    replica is scaled by the same factor (Goyal et al., 2017). Pair it with
    ``warmup`` for large factors: the first steps at the full rate often diverge.

    Args:
        base_lr: the rate tuned for one replica (same per-replica batch).
        strategy: defaults to the current strategy (``tfdist.strategy()``).

    Example:
        >>> scale_learning_rate(1e-3)  # with 4 replicas  # doctest: +SKIP
        0.004
    """
    base_lr = _rate(base_lr, "base_lr", "scale_learning_rate")
    return base_lr * distribute.num_replicas(strategy=strategy)


class Warmup(keras.callbacks.Callback):
    """Raises the learning rate linearly to ``target`` over the first ``steps`` steps.

    At global step ``s`` (0-based, counted by ``optimizer.iterations``, so a restored
    job continues where it stopped) the rate is
    ``target * (start_factor + (1 - start_factor) * (s + 1) / steps)`` for
    ``s < steps``; from step ``steps`` on the callback no longer touches the rate, so
    ``decay`` (placed before it in the list) takes over at the next epoch. Create it
    with ``warmup(...)``.
    """

    def __init__(self, target: float, steps: int, start_factor: float = 0.0):
        super().__init__()
        self.target = target
        self.steps = steps
        self.start_factor = start_factor
        self._step = 0

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        configured = upstream.keras_optimizer_learning_rate(optimizer)
        if isinstance(configured, keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError(
                "tfdist.callbacks.warmup: the optimizer's learning_rate is a "
                "LearningRateSchedule, which a callback cannot set. Received: "
                f"learning_rate={configured!r}. Compile with a float rate, or "
                "use the schedule's own warm-up (keras.optimizers.schedules.CosineDecay("
                "warmup_target=..., warmup_steps=...))."
            )
        self._step = int(numpy_value(optimizer.iterations))

    def rate_at(self, step: int) -> float:
        """The warm-up rate for 0-based global step ``step`` (``target`` once past it)."""
        if step >= self.steps:
            return self.target
        fraction = (step + 1) / self.steps
        return self.target * (self.start_factor + (1.0 - self.start_factor) * fraction)

    def on_train_batch_begin(self, batch, logs=None):
        if self._step < self.steps:
            self.model.optimizer.learning_rate = self.rate_at(self._step)

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1


def warmup(target: float, steps: int, *, start_factor: float = 0.0) -> Warmup:
    """Linear learning-rate warm-up for large global batches.

    Training with a large global batch (many replicas) at a linearly scaled rate
    (``scale_learning_rate``) is unstable in the first steps; warming up from
    ``start_factor * target`` to ``target`` over ``steps`` steps avoids that.

    Args:
        target: the rate reached at the end of warm-up (e.g. ``scale_learning_rate(1e-3)``).
        steps: warm-up length in global steps (optimizer updates).
        start_factor: fraction of ``target`` before the first step, in [0, 1).

    Returns:
        A ``keras.callbacks.Callback``; put it after ``decay`` in the list.

    Example:
        >>> lr = 4e-3  # scale_learning_rate(1e-3) with 4 replicas
        >>> callback = warmup(lr, steps=500)
        >>> callback.rate_at(0), callback.rate_at(499), callback.rate_at(10_000)
        (8e-06, 0.004, 0.004)
    """
    where = "tfdist.callbacks.warmup"
    target = _rate(target, "target", where)
    steps = validate.positive_int(
        steps, "steps", where, "Pass the warm-up length in optimizer steps."
    )
    what = "a number in [0, 1)"
    start_factor = validate.number(start_factor, "start_factor", where, low=0.0, what=what)
    if start_factor >= 1.0:
        raise ValueError(validate.message(where, "start_factor", what, start_factor))
    return Warmup(target, steps, start_factor)


# --------------------------------------------------------------------------- checkpoints


def checkpoint(
    checkpoint_dir: str | os.PathLike,
    *,
    save_freq: str | int = "epoch",
    max_to_keep: int | None = 5,
    preemption: bool = True,
    verbose: int = 0,
    sharded: bool = False,
) -> ResumableCheckpoint:
    """Checkpoints for restartable jobs: ``ckpt-{epoch}.keras`` files, written atomically.

    Every epoch end writes ``ckpt-{epoch}.keras`` (1-based, the guides' naming; loads
    with ``keras.models.load_model``). An int ``save_freq`` also writes
    ``ckpt-{epoch}-{batch}.keras`` every ``save_freq`` global steps, for exact resume
    after a kill. Each file carries what exact resume needs (position, global step,
    dropout RNG state). Only the chief's files land in ``checkpoint_dir``; old ones
    beyond ``max_to_keep`` are removed. With ``preemption=True`` a SIGTERM makes the
    job save at the next step boundary (all workers agree on it) and exit with
    ``tfdist.config.RESTART_EXIT_CODE`` (75). Restore with
    ``tfdist.make_or_restore(build_fn, checkpoint_dir)``.

    Args:
        checkpoint_dir: directory for the checkpoints (created if missing).
        save_freq: ``"epoch"``, or a positive int: also save every that many steps.
        max_to_keep: how many checkpoints to keep (newest); None keeps all.
        preemption: catch SIGTERM, save and exit with the restart code.
        verbose: 1 prints a line per save (on the chief).
        sharded: JAX only: write ``ckpt-{epoch}[-{batch}].orbax`` directories instead,
            every worker its own shards, in the background while training goes on
            (Orbax; ``tfdist.checkpoint.sharded``). ``make_or_restore`` reads both kinds
            and reshards onto the mesh of the model it builds.

    Raises:
        ValueError: ``save_freq`` is 0, negative or not ``"epoch"``; bad ``max_to_keep``;
            ``sharded=True`` on TensorFlow or with a URL other than ``s3://`` or ``gs://``.
        ImportError: ``sharded=True`` without ``orbax-checkpoint`` installed.
        NotADirectoryError: ``checkpoint_dir`` is a file.
        PermissionError: the chief cannot write to ``checkpoint_dir``.

    Example:
        >>> cb = checkpoint("ckpt/", save_freq=100, max_to_keep=3)  # doctest: +SKIP
        >>> model.fit(train, epochs=5, initial_epoch=start, callbacks=[cb])  # doctest: +SKIP
    """
    validate.one_of(verbose, (0, 1), "verbose", "tfdist.callbacks.checkpoint")
    validate.instance(sharded, bool, "sharded", "tfdist.callbacks.checkpoint", "a bool")
    kind = ShardedCheckpoint if sharded else ResumableCheckpoint
    return kind(
        checkpoint_dir,
        save_freq=save_freq,
        max_to_keep=max_to_keep,
        preemption=preemption,
        verbose=verbose,
    )


def standard(
    checkpoint_dir: str | os.PathLike,
    *,
    decay: Callable | Mapping | None = None,
    warmup: Warmup | None = None,
    save_freq: str | int = "epoch",
    max_to_keep: int | None = 5,
    print_lr: bool = True,
    tensorboard: bool = True,
    log_dir: str | os.PathLike | None = None,
    sharded: bool = False,
) -> list[keras.callbacks.Callback]:
    """The callbacks the walkthroughs use: checkpoint, LR decay, warm-up, PrintLR, TensorBoard.

    Order: ``checkpoint(checkpoint_dir, save_freq=..., max_to_keep=...)``, then
    ``decay(decay)`` if given, then ``warmup`` if given, then ``PrintLR()``, then
    ``keras.callbacks.TensorBoard(log_dir=checkpoint_dir/logs)`` (or ``log_dir``) on the chief only
    (workers writing the same event files would clobber each other; TensorBoard takes
    part in no collective, so leaving it out elsewhere is safe).

    Args:
        checkpoint_dir: where checkpoints (and ``logs/`` for TensorBoard) go.
        decay: a schedule for ``decay`` (callable or mapping), or None.
        warmup: a ``warmup(...)`` callback, or None.
        save_freq, max_to_keep, sharded: passed to ``checkpoint``.
        print_lr: include ``PrintLR``.
        tensorboard: include TensorBoard logging.
        log_dir: TensorBoard's directory (default ``checkpoint_dir/logs``), e.g. a local
            one beside an ``s3://`` checkpoint directory. TensorBoard writes through
            TensorFlow's file system, which has local paths and ``gs://`` but no
            ``s3://``: such a directory (given, or the default under an ``s3://``
            checkpoint directory) raises here, on every worker, rather than in ``fit``
            on the chief alone.

    Raises:
        ValueError: with ``tensorboard=True``, a log directory whose URL scheme
            TensorFlow's file system cannot write (``tf.io.gfile``'s registered schemes).

    Example:
        >>> def decay_fn(epoch):
        ...     return 1e-3 if epoch < 3 else 1e-4 if epoch < 7 else 1e-5
        >>> callbacks = standard("ckpt/", decay=decay_fn)  # doctest: +SKIP
        >>> [type(c).__name__ for c in callbacks]          # doctest: +SKIP
        ['ResumableCheckpoint', 'Decay', 'PrintLR', 'TensorBoard']
    """
    where = "tfdist.callbacks.standard"
    if warmup is not None:
        what = "a callback from tfdist.callbacks.warmup(...) or None"
        validate.instance(warmup, Warmup, "warmup", where, what)
    validate.instance(print_lr, bool, "print_lr", where, "a bool")
    validate.instance(tensorboard, bool, "tensorboard", where, "a bool")
    if log_dir is not None:
        validate.path_text(log_dir, "log_dir", where)
    if tensorboard:  # on every worker, before the checkpoint callback touches the store
        log_dir = _tensorboard_log_dir(checkpoint_dir, log_dir, where)
    callbacks: list[keras.callbacks.Callback] = [
        checkpoint(checkpoint_dir, save_freq=save_freq, max_to_keep=max_to_keep, sharded=sharded)
    ]
    if decay is not None:
        callbacks.append(_make_decay(decay))
    if warmup is not None:
        callbacks.append(warmup)
    if print_lr:
        callbacks.append(PrintLR())
    if tensorboard and distribute.is_chief():
        if importlib.util.find_spec("tensorboard") is None:
            # Keras's TensorBoard callback would only fail at the first epoch end.
            logger.warning("tfdist: the tensorboard package is missing; no TensorBoard logs")
            return callbacks
        callbacks.append(keras.callbacks.TensorBoard(log_dir=log_dir))
    return callbacks


def _tensorflow_schemes() -> tuple[str, ...] | None:
    """The URL schemes TensorFlow's file system (``tf.io.gfile``, which TensorBoard's event
    writer uses) can write in this process, or None when it cannot say.

    A plugin imported before the call (one registering ``s3``) counts.
    """
    try:
        import tensorflow as tf
    except ImportError:
        return None
    registered = getattr(tf.io.gfile, "get_registered_schemes", None)
    if registered is None:  # an older TensorFlow: Keras's writer will say, later
        return None
    return tuple(sorted(scheme for scheme in registered() if scheme))


def _tensorboard_log_dir(checkpoint_dir, log_dir, where: str) -> str:
    """TensorBoard's directory (``log_dir``, else ``checkpoint_dir/logs``), refused when
    TensorFlow cannot write its scheme: Keras's callback would fail only once ``fit``
    has started ("File system scheme 's3' not implemented"), and on the chief alone (the
    only worker given TensorBoard) while the others go on into the first step."""
    if log_dir is None:
        base = validate.path_text(checkpoint_dir, "checkpoint_dir", where)
        chosen = storage.join(base, "logs")
    else:
        chosen = os.fspath(log_dir)
    if not storage.is_url(chosen):
        return chosen
    scheme = chosen.split("://", 1)[0].lower()
    schemes = _tensorflow_schemes()
    if schemes is None or scheme in schemes:
        return chosen
    urls = ", ".join(f"{s}://" for s in schemes if s != "file")
    default = " (checkpoint_dir/logs, the default)" if log_dir is None else ""
    raise ValueError(
        f"{where}: TensorBoard cannot write its logs to {chosen!r}{default}: TensorFlow's "
        f"file system has no {scheme!r} scheme (it writes local paths and {urls}). "
        f"Received: log_dir={log_dir!r}, checkpoint_dir={os.fspath(checkpoint_dir)!r}. Pass "
        "log_dir= a local directory (e.g. log_dir='logs/') or a gs:// URL, or "
        "tensorboard=False; the checkpoints still go to checkpoint_dir."
    )
