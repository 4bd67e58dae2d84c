"""Argument checks for tfdist's public functions: one place, one rule, one message shape.

The rule: a value of the wrong *type* raises ``TypeError`` (a bool is never an int or a
number here); a value of the right type that is not allowed raises ``ValueError``. Every
message names the function and the argument, echoes what was received and says what to
do: ``where: name must be WHAT. Received: name=VALUE. HINT``.

Example:
    >>> positive_int(2, "per_replica", "global_batch_size")
    2
    >>> positive_int(0, "per_replica", "global_batch_size")
    Traceback (most recent call last):
    ...
    ValueError: global_batch_size: per_replica must be a positive int. Received: per_replica=0
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterable

__all__ = [
    "message",
    "integer",
    "positive_int",
    "non_negative_int",
    "number",
    "positive_number",
    "one_of",
    "instance",
    "path_text",
    "callable_",
]


def message(where: str, name: str, what: str, value, hint: str = "") -> str:
    """The one message shape: ``where: name must be WHAT. Received: name=VALUE. HINT``."""
    text = f"{where}: {name} must be {what}. Received: {name}={value!r}"
    return f"{text}. {hint}" if hint else text


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(value, name: str, where: str, hint: str = "", *, low: int, what: str) -> int:
    """An int >= ``low``; TypeError for a non-int (or bool), ValueError below ``low``."""
    if not _is_int(value):
        raise TypeError(message(where, name, what, value, hint))
    if value < low:
        raise ValueError(message(where, name, what, value, hint))
    return int(value)


def positive_int(value, name: str, where: str, hint: str = "") -> int:
    """An int >= 1.

    Example:
        >>> positive_int(3, "n", "f")
        3
    """
    return integer(value, name, where, hint, low=1, what="a positive int")


def non_negative_int(value, name: str, where: str, hint: str = "") -> int:
    """An int >= 0.

    Example:
        >>> non_negative_int(0, "skip", "f")
        0
    """
    return integer(value, name, where, hint, low=0, what="a non-negative int")


def number(
    value,
    name: str,
    where: str,
    hint: str = "",
    *,
    low: float | None = None,
    low_ok: bool = True,
    what: str = "a finite number",
) -> float:
    """A finite real number, optionally bounded below (``low``, inclusive if ``low_ok``).

    Example:
        >>> number(0.5, "rate", "f", low=0.0, low_ok=False)
        0.5
    """
    if not _is_number(value):
        raise TypeError(message(where, name, what, value, hint))
    value = float(value)
    if not math.isfinite(value) or (
        low is not None and (value < low or (value == low and not low_ok))
    ):
        raise ValueError(message(where, name, what, value, hint))
    return value


def positive_number(value, name: str, where: str, hint: str = "") -> float:
    """A finite number > 0, e.g. seconds or a learning rate.

    Example:
        >>> positive_number(2, "timeout", "f")
        2.0
    """
    return number(value, name, where, hint, low=0.0, low_ok=False, what="a positive number")


def one_of(value, choices: Iterable, name: str, where: str, hint: str = ""):
    """``value`` if it is one of ``choices``, else ValueError listing them.

    Example:
        >>> one_of("auto", ("auto", "off"), "mode", "f")
        'auto'
    """
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(message(where, name, f"one of {choices}", value, hint))
    return value


def instance(value, types, name: str, where: str, what: str, hint: str = ""):
    """``value`` if it is an instance of ``types``, else TypeError.

    Example:
        >>> instance([1], list, "xs", "f", "a list")
        [1]
    """
    if not isinstance(value, types):
        raise TypeError(message(where, name, what, value, hint))
    return value


def path_text(value, name: str, where: str, hint: str = "") -> str:
    """A non-empty ``str`` or ``os.PathLike`` path, as ``str``.

    Example:
        >>> path_text("ckpt/", "checkpoint_dir", "f")
        'ckpt/'
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(message(where, name, "a path (str or os.PathLike)", value, hint))
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(message(where, name, "a non-empty path", value, hint))
    return text


def callable_(value, name: str, where: str, hint: str = "") -> Callable:
    """``value`` if it is callable, else TypeError.

    Example:
        >>> callable_(len, "fn", "f") is len
        True
    """
    if not callable(value):
        raise TypeError(message(where, name, "callable", value, hint))
    return value
