"""BatchNormalization under several TensorFlow replicas: a warning, and ``sync_batchnorm``.

Under a ``tf.distribute`` strategy with more than one replica in sync, Keras's
``BatchNormalization`` (``synchronized=False``, its default) normalises each replica's part
of the batch with that part's own mean and variance: training runs and silently ends with
another model than one device trains (~1e-3 after 2 epochs on 2 replicas), moving
statistics included. ``synchronized=True`` all-reduces the statistics and trains the
one-device model. (On JAX, ``keras.distribution`` computes them over the global batch:
nothing to do there.)

No public extension point sees every layer a script builds, so this module hooks the one
place each ``BatchNormalization`` passes through before it can train:
``keras.layers.BatchNormalization.build`` (``install``; upstream's ``build`` then runs
unchanged):

- inside ``tfdist.scope(sync_batchnorm=True)`` with more than one replica, the layer gets
  ``synchronized = True`` (``sync_scope``);
- otherwise an unsynchronized layer built under a strategy with more than one replica is
  warned about, once per process (``UnsyncedBatchNormWarning``).

Why ``build``: its variables are created there, so it runs under the strategy the layer
trains with, also for layers created before the scope, models loaded from a file and
models built lazily by ``fit`` (these are warned about: ``fit`` builds them after
``tfdist.scope(sync_batchnorm=True)`` has closed); and it runs before ``fit`` traces its
train step, which reads ``synchronized``. ``__init__`` would miss layers created before
the scope; a check when the scope exits would see no layer (nothing lists what a block
created) and come after a ``fit`` inside it. ``tfdist.compat`` applies ``install`` as the hook ``HOOK_NAME`` (``HOOK``, in ``HOOKS``) on the TensorFlow
backend (applied when Keras is imported, so hand-built strategies are warned about too);
``tfdist.scope()`` installs it itself when it was not applied, unless the hook was skipped
(a changed target) or excluded (``TFDIST_COMPAT_EXCLUDE``; ``sync_batchnorm`` still
installs it, the explicit argument winning).

Example:
    >>> with tfdist.scope(sync_batchnorm=True):            # doctest: +SKIP
    ...     model = keras.applications.ResNet50(weights=None)
    >>> model.get_layer("conv1_bn").synchronized           # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import sys
import threading
import types

from tfdist.core import config, fix_registry

__all__ = [
    "HOOK",
    "HOOK_NAME",
    "TARGETS",
    "UnsyncedBatchNormWarning",
    "install",
    "installed",
    "per_replica_statistics",
    "sync_scope",
]

logger = logging.getLogger(__name__)

HOOK_NAME = "keras_batchnorm_replicas"
# What install patches (for tfdist.compat's guard). The hook also sets ``synchronized``,
# a documented constructor argument that upstream reads when it computes the moments.
TARGETS = ("keras.src.layers.normalization.batch_normalization:BatchNormalization.build",)

_HOOK_MARK = "_tfdist_batchnorm_hook"
# True inside tfdist.scope(sync_batchnorm=True) over several replicas (per thread and
# task, as tf.distribute's own scopes are).
_SYNC = contextvars.ContextVar("tfdist_sync_batchnorm", default=False)
_warned = threading.Event()
# Modules whose frames a warning skips to point at the script's line.
_FRAMEWORKS = {"tfdist", "keras", "tensorflow", "contextlib", "functools"}


class UnsyncedBatchNormWarning(UserWarning):
    """An unsynchronized BatchNormalization will train differently on several replicas."""


def _keras_class():
    import keras

    return keras.layers.BatchNormalization


def installed() -> bool:
    """Whether ``keras.layers.BatchNormalization.build`` carries tfdist's hook."""
    return getattr(_keras_class().build, _HOOK_MARK, False)


def install() -> None:
    """Hooks ``BatchNormalization.build``: synchronize or warn (see the module); idempotent.

    Upstream: under a tf.distribute strategy with more than one replica, an
    unsynchronized ``BatchNormalization`` normalises each replica's part of the batch
    with that part's own mean and variance, so the model trained differs from the one
    device trains (0.25 on a convnet after 2 epochs), and nothing says so. The hook runs
    before upstream's ``build``, under the strategy the layer trains with: inside
    ``tfdist.scope(sync_batchnorm=True)`` it sets ``synchronized=True`` (the statistics
    of the global batch: equal to one device within 1e-6), otherwise it warns once per
    process, naming the layer and both remedies. With one replica, or on JAX (global
    statistics already), upstream's ``build`` runs unchanged.

    Layers created before it keep upstream's ``build`` (Keras binds it at creation): it
    belongs where ``tfdist.compat`` puts it, at Keras's import.

    Example:
        >>> install()  # doctest: +SKIP
    """
    # Imported here: tfdist.compat registers this module's fix (it imports this module).
    from tfdist.core.fix_registry import patch

    def make(original):
        @functools.wraps(original)
        def build(self, *args, **kwargs):
            _building(self)
            return original(self, *args, **kwargs)

        # No __signature__ here: Keras copies build's __dict__ onto each layer's bound
        # build wrapper; inspect.signature follows __wrapped__ to upstream's signature.
        setattr(build, _HOOK_MARK, True)
        return build

    patch(_keras_class(), "build", HOOK_NAME, make)


def _building(layer) -> None:
    """Runs before upstream's ``build``, under the strategy the layer will train with."""
    if layer.synchronized:
        return
    if _SYNC.get():
        layer.synchronized = True
        logger.debug("tfdist: BatchNormalization %r synchronized across replicas", layer.name)
    elif not _warned.is_set():
        _warn_if_replicated(layer)


def _warn_if_replicated(layer) -> None:
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    if not per_replica_statistics(strategy):
        return
    _warned.set()
    import warnings

    warnings.warn(
        f"tfdist: BatchNormalization layer {layer.name!r} is built unsynchronized under "
        f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replicas: when it "
        "trains, each replica normalises with the mean and variance of its own part of "
        "the batch, so the model (and its moving statistics) differs from the one a single "
        "device trains. Pass synchronized=True to BatchNormalization, or build the model "
        "inside tfdist.scope(sync_batchnorm=True) (with a keras.Input, or model.build(), "
        "so that it is built there). (Warned once per process: other unsynchronized "
        "layers may follow.)",
        UnsyncedBatchNormWarning,
        stacklevel=_stacklevel(),
    )


def _stacklevel() -> int:
    """The ``stacklevel`` of the script's own line: the first frame outside the frameworks."""
    frame: types.FrameType | None = sys._getframe(2)
    level = 2  # stacklevel 1 is the line that calls warn
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in _FRAMEWORKS and not module.startswith("__autograph"):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def per_replica_statistics(distribution) -> bool:
    """Whether an unsynchronized BatchNormalization under ``distribution`` normalises each
    replica's part of the batch apart: a ``tf.distribute`` strategy with several replicas.

    A ``keras.distribution`` (JAX) computes the global batch's statistics: False.

    Example:
        >>> per_replica_statistics(None)
        False
    """
    tf = sys.modules.get("tensorflow")  # a strategy exists only if TensorFlow is loaded
    if tf is None or not isinstance(distribution, tf.distribute.Strategy):
        return False
    return distribution.num_replicas_in_sync > 1


def _why_not_hooked(required: bool) -> str | None:
    """Why the hook is not installed, after applying its record ``HOOK`` (the one
    way every patch is applied) unless it is excluded and not ``required``; or None."""
    excluded = config.compat_exclude()
    if not required and (HOOK_NAME in excluded or "all" in excluded):
        return f"{HOOK_NAME} is excluded by {config.COMPAT_EXCLUDE_ENV}"
    return fix_registry.apply_fix(HOOK)


def _ensure_hook(required: bool) -> bool:
    """Installs the hook if it may be; raises if ``required`` and it may not."""
    if installed():
        return True
    reason = _why_not_hooked(required)
    if reason is None:
        return True
    if required:
        raise RuntimeError(
            f"tfdist.scope(sync_batchnorm=True) cannot synchronize BatchNormalization "
            f"layers here: {reason}. Pass synchronized=True to each "
            "keras.layers.BatchNormalization instead."
        )
    return False


@contextlib.contextmanager
def sync_scope(distribution, *, enabled: bool):
    """Inside: BatchNormalization layers built are synchronized (``enabled``) or, under
    several replicas, warned about; ``distribution`` is the one whose scope is open.

    Example:
        >>> with strategy.scope() as s, sync_scope(s, enabled=True):  # doctest: +SKIP
        ...     keras.layers.BatchNormalization().build((None, 8))
    """
    replicated = per_replica_statistics(distribution)
    if enabled and not replicated:
        logger.debug(
            "tfdist.scope(sync_batchnorm=True) changes nothing under %s: BatchNormalization "
            "statistics are already the global batch's (one replica, or keras.distribution)",
            type(distribution).__name__,
        )
    hooked = replicated and _ensure_hook(required=enabled)
    token = _SYNC.set(enabled and hooked)
    try:
        yield distribution
    finally:
        _SYNC.reset(token)


# The hook's record: a Patch, not a fix (it repairs no upstream defect: it warns about
# per-replica statistics and converts layers for sync_batchnorm). tfdist.compat.HOOKS
# applies it when Keras is imported, through the same fix_registry.apply_fix as the fixes,
# and so does ``_ensure_hook``; TFDIST_COMPAT_EXCLUDE still names it.
HOOK = fix_registry.Patch(
    HOOK_NAME,
    install,
    purpose="BatchNormalization layers built under several replicas are warned about or synchronized",
    applies=fix_registry.on_keras_backend("tensorflow"),
    targets=fix_registry.targets(*TARGETS),
)
