"""The Fix record, version guards, and the one way tfdist patches an upstream attribute.

Example:
    >>> _version_tuple("2.21.0rc1")
    (2, 21, 0)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from tfdist import config

__all__ = ["Fix", "patch", "keras_jax_backend", "keras_tf_backend", "tensorflow_versions"]

# Set on every function a fix installs: re-applying (even from a reloaded module) is a no-op.
_MARK = "__tfdist_fix__"


@dataclass(frozen=True)
class Fix:
    """One upstream defect and its fix.

    Attributes:
        name: short identifier, used in logs, ``applied()`` and ``TFDIST_COMPAT_EXCLUDE``.
        summary: one line: what breaks upstream.
        applies: returns True when the installed versions have the defect.
        apply: patches it; safe to call more than once.
        package: the package it patches (``tensorflow`` or ``keras``): a fix is applied
            as soon as its package is imported, before the script can use it.
    """

    name: str
    summary: str
    applies: Callable[[], bool]
    apply: Callable[[], None]
    package: str = "keras"


def _version_tuple(text: str) -> tuple[int, ...]:
    """``"2.21.0rc1"`` -> ``(2, 21, 0)``; only the leading numeric parts count."""
    parts = []
    for piece in text.split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def _keras_version() -> tuple[int, ...]:
    import keras

    return _version_tuple(keras.__version__)


def _tf_version() -> tuple[int, ...]:
    import tensorflow as tf

    return _version_tuple(tf.__version__)


def keras_tf_backend(low: tuple[int, ...], high: tuple[int, ...]) -> Callable[[], bool]:
    """Applies to Keras versions in ``[low, high)`` running on the TensorFlow backend.

    The upper bound is the next major version: the patched internals are checked by
    the tests, which fail (on purpose) once upstream fixes a defect.
    """

    def applies() -> bool:
        import keras

        return keras.backend.backend() == "tensorflow" and low <= _keras_version() < high

    return applies


def keras_jax_backend(low: tuple[int, ...], high: tuple[int, ...]) -> Callable[[], bool]:
    """Applies to Keras versions in ``[low, high)`` running on the JAX backend."""

    def applies() -> bool:
        import keras

        return keras.backend.backend() == "jax" and low <= _keras_version() < high

    return applies


def tensorflow_versions(low: tuple[int, ...], high: tuple[int, ...]) -> Callable[[], bool]:
    """Applies to TensorFlow versions in ``[low, high)``, under the TensorFlow backend only
    (a JAX process that uses tf.data for input gets no TensorFlow runtime patches)."""

    def applies() -> bool:
        return config.keras_backend() == "tensorflow" and low <= _tf_version() < high

    return applies


def patch(owner, attr: str, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replaces ``owner.attr`` by ``make(original)`` unless fix ``name`` already did."""
    original = getattr(owner, attr)
    if getattr(original, _MARK, None) == name:
        return
    patched = make(original)
    setattr(patched, _MARK, name)
    patched.__wrapped__ = original
    setattr(owner, attr, patched)
