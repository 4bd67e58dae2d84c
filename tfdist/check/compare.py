"""One comparison of two runs' numbers: per key, the largest absolute difference.

A key on one side only, a changed shape or a value that is not finite (NaN, inf) on either
side makes the comparison ``inf`` with a reason: a NaN is never "equal" (Python's ``max``
would keep a number against a later NaN, and ``NaN <= tolerance`` is simply False, which
hides where it came from).

Example:
    >>> import numpy as np
    >>> compare({"w": np.array([1.0, 2.0])}, {"w": np.array([1.0, 2.5])})
    Difference(key='w', value=0.5, reason='')
    >>> compare({"w": np.array([1.0])}, {"w": np.array([np.nan])}).equal(1e-5)
    False
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["Difference", "compare", "history_arrays", "first_differing_step"]


@dataclass(frozen=True)
class Difference:
    """The key that differs most, by how much (``inf`` when not comparable), and why not."""

    key: str | None
    value: float
    reason: str = ""

    def equal(self, tolerance: float) -> bool:
        return math.isfinite(self.value) and self.value <= tolerance


def _not_comparable(key: str | None, reason: str) -> Difference:
    return Difference(key, math.inf, reason)


def compare(
    reference: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], *, relative: bool = False
) -> Difference:
    """The worst key of ``got`` against ``reference`` (both ``{key: array}``).

    ``relative``: a difference is divided by the reference's magnitude where that exceeds
    1 (a loss of 300 carries float32's 3e-5 of rounding; a weight near 1 carries 1e-7).
    """
    missing, extra = sorted(set(reference) - set(got)), sorted(set(got) - set(reference))
    if missing or extra:
        return _not_comparable(
            (missing or extra)[0],
            f"different variables: only in the reference {missing[:3]}, only here {extra[:3]}",
        )
    worst = Difference(None, 0.0)
    for key in sorted(reference):
        a = np.asarray(reference[key], dtype=np.float64)
        b = np.asarray(got[key], dtype=np.float64)
        if a.shape != b.shape:
            return _not_comparable(key, f"shape {b.shape}, the reference's {a.shape}")
        for side, array in (("the reference", a), ("this run", b)):
            if not np.all(np.isfinite(array)):
                return _not_comparable(key, f"not finite (NaN or inf) in {side}")
        scale = np.maximum(np.abs(a), 1.0) if relative else 1.0
        value = float(np.max(np.abs(a - b) / scale)) if a.size else 0.0
        if worst.key is None or value > worst.value:
            worst = Difference(key, value)
    return worst


def history_arrays(history: Mapping[str, list], steps: int | None = None) -> dict:
    """``{metric: array of per-step values}``, the first ``steps`` of each."""
    return {k: np.asarray(v[:steps], dtype=np.float64) for k, v in history.items()}


def first_differing_step(reference: list, got: list, tolerance: float) -> int | None:
    """The first step (1-based) whose values differ by more than ``tolerance`` (relative
    above 1, as ``compare``), or None."""
    for step, (a, b) in enumerate(zip(reference, got, strict=False), 1):
        if not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > tolerance * max(1, abs(a)):
            return step
    return None
