"""Fixes for Keras/TensorFlow defects that break distributed training, applied once.

Each fix is a small ``Fix`` record: the versions it applies to, a function that applies
it (idempotently), and a docstring saying what it changes and why it is correct.
``apply_all()`` runs every fix whose versions match; ``tfdist.strategy()`` calls it
before creating a strategy.

Example:
    >>> from tfdist import compat
    >>> compat.apply_all()  # doctest: +SKIP
    ['...']
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Fix", "FIXES", "apply_all", "applied"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fix:
    """One upstream defect and its fix.

    Attributes:
        name: short identifier, used in logs and ``applied()``.
        applies: returns True when the installed versions have the defect.
        apply: patches it; must be safe to call more than once.
    """

    name: str
    applies: Callable[[], bool]
    apply: Callable[[], None]


FIXES: list[Fix] = []
_applied: list[str] = []


def apply_all() -> list[str]:
    """Applies every fix that matches the installed versions; returns the names applied."""
    for fix in FIXES:
        if fix.name in _applied or not fix.applies():
            continue
        fix.apply()
        _applied.append(fix.name)
        logger.debug("tfdist.compat: applied %s", fix.name)
    return list(_applied)


def applied() -> list[str]:
    """Names of the fixes applied in this process so far."""
    return list(_applied)
