"""The backend seam: one interface, one module per Keras backend.

``tfdist.distribute`` (the public functions) asks ``get()`` for the backend of this
process and delegates to it; nothing else in tfdist branches on the backend. A backend is
a module that provides every function named in ``INTERFACE``:

==================  =========================================================
``scope(**opts)``   a context manager that distributes what is built inside
``current(x)``      the distribution in effect (``x`` if given)
``num_replicas``    replicas in sync (the data-parallel size)
``num_workers``     training processes
``worker_index``    this process's index among them (0 is the chief)
``is_chief()``      whether this process does the one-off work (files, logs)
``barrier(n, t)``   wait until every process reaches barrier ``n`` (``t`` seconds)
``describe()``      devices and the distribution ``auto`` would pick (``tfdist info``)
==================  =========================================================

Today: ``tensorflow`` (``tf.distribute`` strategies) and ``jax`` (``keras.distribution``).
Adding a backend is one new module here plus one line in ``_MODULES``.

Example:
    >>> from tfdist import backends
    >>> backends.name({"KERAS_BACKEND": "tensorflow"})
    'tensorflow'
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType

from tfdist import config

__all__ = ["INTERFACE", "SUPPORTED", "name", "get"]

INTERFACE = (
    "scope",
    "current",
    "num_replicas",
    "num_workers",
    "worker_index",
    "is_chief",
    "barrier",
    "describe",
)
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


def get() -> ModuleType:
    """The backend module of this process.

    Example:
        >>> get().NAME  # doctest: +SKIP
        'tensorflow'
    """
    return importlib.import_module(_MODULES[name()])
