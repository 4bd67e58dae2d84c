"""The public distribution functions: each is one line that delegates to the backend.

Example:
    >>> import tfdist
    >>> with tfdist.scope():                 # doctest: +SKIP
    ...     model = build_and_compile()
    >>> tfdist.global_batch_size(64)         # doctest: +SKIP
    128
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
import platform
from collections.abc import Mapping

from tfdist import backends, batchnorm
from tfdist.core import cluster, config, process, validate

__all__ = [
    "strategy",
    "scope",
    "current",
    "num_replicas",
    "global_batch_size",
    "num_workers",
    "worker_index",
    "is_chief",
    "barrier",
    "chief_print",
    "topology",
]


def strategy(kind: str = "auto", **options):
    """The process's ``tf.distribute`` strategy: created on the first call, then the same.

    ``kind``: ``auto`` (default), ``mirrored``, ``multi_worker``, ``one_device`` or
    ``default``; ``devices=``, ``cpu_devices=``, ``timeouts=`` as in
    ``tfdist.backends.tensorflow.strategy``. TensorFlow backend only.

    Example:
        >>> s = tfdist.strategy()     # doctest: +SKIP
        >>> s is tfdist.strategy()    # doctest: +SKIP
        True
    """
    if backends.name() != "tensorflow":
        raise RuntimeError(
            "tfdist.strategy() is a tf.distribute strategy: TensorFlow backend only. Received: "
            f"KERAS_BACKEND={backends.name()!r}. Use `with tfdist.scope():` (a "
            "keras.distribution DataParallel/ModelParallel under JAX)."
        )
    from tfdist.backends import tensorflow as tf_backend

    return tf_backend.strategy(kind, **options)


def scope(*, sync_batchnorm: bool = False, **options):
    """``with tfdist.scope():`` distributes what is built inside over this process's devices.

    ``as`` gives the distribution: the ``tf.distribute`` strategy, or on JAX the
    ``keras.distribution``. ``options`` go to the backend's scope.

    Args:
        sync_batchnorm: every ``keras.layers.BatchNormalization`` built inside (a model
            with a ``keras.Input`` is built where it is created; build others inside, e.g.
            ``model.build(shape)``) is synchronized across the replicas, as PyTorch's
            ``convert_sync_batchnorm``: it normalises with the global batch's mean and
            variance and trains the model one device trains. Without it, Keras on
            TensorFlow normalises each replica's part of the batch apart: another model,
            silently (tfdist warns once per process). Cost, per layer and training step:
            five small all-reduces (forward: sum, sum of squares and count, one value per
            channel; backward: the two sums' gradients), each a point where the replicas
            wait for each other: latency, not bandwidth. Nothing changes with one
            replica, or on JAX, whose statistics are the global batch's already. The saved
            model says ``synchronized=True``, which Keras refuses to load on JAX.

    ``compile(jit_compile=True)`` for a model built inside: on JAX it works; on
    TensorFlow with several replicas ``fit`` and ``evaluate`` stop before their first
    step with an error naming ``jit_compile=False`` (Keras would XLA-compile the whole
    distributed step onto one device), and ``predict`` works.

    Example:
        >>> with scope(sync_batchnorm=True):  # doctest: +SKIP
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.BatchNormalization()])
    """
    sync_batchnorm = validate.instance(
        sync_batchnorm,
        bool,
        "sync_batchnorm",
        "scope",
        "a bool",
        "Pass True to synchronize BatchNormalization across replicas, e.g. "
        "tfdist.scope(sync_batchnorm=True).",
    )
    return _with_batchnorm(backends.get().scope(**options), sync_batchnorm)


@contextlib.contextmanager
def _with_batchnorm(backend_scope, sync: bool):
    """The backend's scope, with BatchNormalization synchronized or checked inside."""
    with backend_scope as distribution, batchnorm.sync_scope(distribution, enabled=sync):
        yield distribution


def current(strategy=None):
    """The distribution in effect: ``strategy`` if given, else the open scope's, else tfdist's."""
    return backends.get().current(strategy)


def num_replicas(*, strategy=None) -> int:
    """Replicas in sync (the data-parallel size).

    Example:
        >>> num_replicas()  # doctest: +SKIP
        2
    """
    return backends.get().num_replicas(strategy)


def global_batch_size(per_replica: int, *, strategy=None) -> int:
    """The global batch: ``per_replica`` times the number of replicas.

    Example:
        >>> global_batch_size(64)  # doctest: +SKIP
        128
    """
    per_replica = validate.positive_int(
        per_replica,
        "per_replica",
        "global_batch_size",
        "Pass the batch size of one replica as an int, e.g. global_batch_size(64).",
    )
    return per_replica * num_replicas(strategy=strategy)


def num_workers(*, strategy=None) -> int:
    """Workers in the job (1 on one machine).

    Example:
        >>> num_workers()  # doctest: +SKIP
        2
    """
    return backends.get().num_workers(strategy)


def worker_index(*, strategy=None) -> int:
    """This worker's index in the job, chief first (0 on one machine).

    Example:
        >>> worker_index()  # doctest: +SKIP
        0
    """
    return backends.get().worker_index(strategy)


def is_chief() -> bool:
    """Whether this worker is the chief (always True on one machine).

    Example:
        >>> is_chief()  # doctest: +SKIP
        True
    """
    return backends.get().is_chief()


def barrier(name: str | None = None, *, timeout: float | None = None) -> None:
    """Waits until every worker of the job reaches this point (a no-op on one worker).

    Every worker must call it, in the same order: a barrier reached by some workers only
    ends after ``timeout`` seconds (default 300) with an error that says so, never a hang.

    Args:
        name: identifies the barrier; unnamed barriers are numbered in call order.
        timeout: seconds to wait for the other workers.

    Example:
        >>> if tfdist.is_chief(): prepare_files()   # doctest: +SKIP
        >>> tfdist.barrier("files ready")           # doctest: +SKIP
    """
    if name is not None:
        validate.instance(name, str, "name", "barrier", "a str or None")
    seconds = config.BARRIER_TIMEOUT_S if timeout is None else timeout
    seconds = validate.positive_number(seconds, "timeout", "barrier", "Pass seconds, e.g. 60.")
    st = process.state()
    with st.lock:
        st.barriers += 1
        label = name if name is not None else f"tfdist-barrier-{st.barriers}"
    backends.get().barrier(label, seconds)


def chief_print(*args, **kwargs) -> None:
    """``print`` on the chief only: one copy of a message in an N-worker job's output.

    Example:
        >>> tfdist.chief_print("test accuracy", 0.99)  # doctest: +SKIP
    """
    if is_chief():
        print(*args, **kwargs)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def topology(environ: Mapping[str, str] | None = None) -> dict:
    """What this process sees: versions, devices, the distribution ``auto`` picks, the cluster.

    Used by ``tfdist info``. It plans without creating anything, so it never starts a
    server or waits for other workers.

    Example:
        >>> topology()["strategy"]["kind"]  # doctest: +SKIP
        'default'
    """
    from tfdist import __version__

    env = os.environ if environ is None else environ
    backend = backends.get()
    return {
        "versions": {
            "python": platform.python_version(),
            "tensorflow": _version("tensorflow"),
            "keras": _version("keras"),
            "tensorflow_datasets": _version("tensorflow-datasets"),
            "tfdist": __version__,
        },
        "backend": backend.NAME,
        **backend.topology(env),
        "cluster": cluster.cluster_from_env(env).summary(),
        "TFDS_DATA_DIR": env.get("TFDS_DATA_DIR") or None,
    }
