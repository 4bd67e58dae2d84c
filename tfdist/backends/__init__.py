"""The backend seam: one interface (``Backend``), one module per Keras backend.

Features (``tfdist.distribute``, ``tfdist.data``, ``tfdist.checkpoint``) ask ``get()`` for
the backend of this process and call it; none of them branches on the backend's name
(``tests/backends/test_backends.py`` checks both). A backend is a module that provides every name
of the ``Backend`` protocol (listed in ``INTERFACE``):

==============================  ===========================================================
``NAME``                        the ``KERAS_BACKEND`` value it implements
``scope(**opts)``               a context manager that distributes what is built inside
``current(x)``                  the distribution in effect (``x`` if given)
``num_replicas(x)``             replicas in sync (the data-parallel size)
``num_workers(x)``              workers in the job
``worker_index(x)``             this worker's index among them (0 is the chief)
``is_chief()``                  whether this worker does the one-off work (files, logs)
``barrier(n, t)``               wait until every worker reaches barrier ``n`` (``t`` s)
``topology()``                  devices and the distribution ``auto`` would pick
``chief_value(n, v, t, x)``     the chief's integer ``v`` on every process (a broadcast)
``gather_rows(row, x)``         every process's small integer row, on every process
``key_value_set(k, v)``         publish ``k=v`` in the job's store (False: set already)
``key_value_get(k, t)``         wait up to ``t`` s for ``k`` in the store (None: not set)
``phantom_prone_variables(m)``  state a train step may change past the data's end
``splits_uneven_batches()``     whether a batch that does not divide evenly can be fed
==============================  ===========================================================

Today: ``tensorflow`` (``tf.distribute`` strategies) and ``jax`` (``keras.distribution``).
Adding a backend is one new module here that implements ``Backend``, plus one line in
``_MODULES``; no feature changes. Only process set-up (``tfdist.startup``'s hooks on the
framework's import) and the per-backend Fix records of ``tfdist.compat`` are chosen by
name, and get an entry of their own if the new framework needs one.

Example:
    >>> from tfdist import backends
    >>> backends.name({"KERAS_BACKEND": "tensorflow"})
    'tensorflow'
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from tfdist.core import config

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Backend", "StoreGone", "INTERFACE", "SUPPORTED", "name", "get"]


class StoreGone(RuntimeError):
    """The coordination service's store cannot be reached (the job is ending)."""


@runtime_checkable
class Backend(Protocol):
    """What a backend module provides; features call ``backends.get().<member>``.

    ``explicit`` (``x`` above) is a distribution the caller holds (a ``tf.distribute``
    strategy, a ``keras.distribution``); None means the current one.
    """

    NAME: str

    def scope(self, **options) -> AbstractContextManager:
        """A context manager that distributes what is built inside."""

    def current(self, explicit=None):
        """``explicit`` if given, else the distribution in effect, else tfdist's own."""

    def num_replicas(self, explicit=None) -> int:
        """Replicas in sync (the data-parallel size)."""

    def num_workers(self, explicit=None) -> int:
        """Workers in the job (1 on one machine)."""

    def worker_index(self, explicit=None) -> int:
        """This worker's index in the job, chief first."""

    def is_chief(self) -> bool:
        """Whether this worker does the one-off work (files, logs)."""

    def barrier(self, name: str, timeout: float) -> None:
        """Waits until every process reaches barrier ``name``; RuntimeError after ``timeout`` s."""

    def topology(self, environ: Mapping[str, str] | None = None) -> dict:
        """Devices and the distribution ``auto`` would pick (for ``tfdist info``)."""

    def chief_value(self, name: str, value: int, timeout: float, explicit=None) -> int:
        """The chief's ``value`` on every process; every process must call it, in the same
        order. Raises TimeoutError (chained to the runtime's error, if any) after ``timeout``
        s, saying what ``name`` was not agreed."""

    def gather_rows(self, row: Sequence[int], explicit=None) -> np.ndarray | None:
        """Every process's ``row`` of small integers, stacked, on every process (a process's
        row may appear once per local replica); None with one process."""

    def key_value_set(self, key: str, value: str) -> bool:
        """Publishes ``key=value`` in the job's coordination store; False when ``key`` is
        set already. Raises StoreGone when the store cannot be reached."""

    def key_value_get(self, key: str, timeout: float) -> str | None:
        """The value of ``key``, or None when it is not set within ``timeout`` s. Raises
        StoreGone when the store cannot be reached."""

    def phantom_prone_variables(self, model) -> list:
        """The variables a train step can change after the data ran out (the step counter,
        RNG states), which exact resume puts back; empty where no such step runs."""

    def saves_sharded(self) -> bool:
        """Whether sharded checkpoints (Orbax, each process its own shards) can be written:
        the variables are ``jax.Array``s."""

    def splits_uneven_batches(self) -> bool:
        """Whether a batch that does not divide evenly between the replicas (a partial
        last batch) can be fed; False: every batch must, and with several processes no
        batch may be partial."""


def _members(protocol: type) -> tuple[str, ...]:
    """The names a protocol declares, in order: its attributes, then its methods."""
    methods = [k for k, v in vars(protocol).items() if callable(v) and not k.startswith("_")]
    return (*protocol.__annotations__, *methods)


INTERFACE = _members(Backend)
# Keras backend name -> the module implementing it (imported on first use: importing
# tfdist.backends costs nothing, and a JAX process never imports the TensorFlow one).
_MODULES = {"tensorflow": "tfdist.backends.tensorflow", "jax": "tfdist.backends.jax"}
SUPPORTED = tuple(_MODULES)


def name(environ: Mapping[str, str] | None = None) -> str:
    """The Keras backend of this process (``KERAS_BACKEND``, keras.json, or Keras's answer).

    Raises:
        ConfigError: a backend tfdist does not support.
    """
    backend = config.keras_backend(environ)
    if backend not in _MODULES:
        raise config.ConfigError(
            f"tfdist supports the Keras backends {SUPPORTED}. Received: "
            f"KERAS_BACKEND={backend!r}. Set KERAS_BACKEND to one of them."
        )
    return backend


def get() -> Backend:
    """The backend module of this process.

    Example:
        >>> get().NAME  # doctest: +SKIP
        'tensorflow'
    """
    return cast(Backend, importlib.import_module(_MODULES[name()]))
