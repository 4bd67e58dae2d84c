"""The one comparison behind every equivalence in tests/ and tests/scripts/.

Both sides may be a number, an array, a (nested) list or tuple of arrays, a dict of any
of these, or a ``keras.callbacks.History`` (its ``.history`` dict). The comparison fails
(``NotEquivalent``, an ``AssertionError``) on a key present on one side only, on a shape
that changed, and on any non-finite value on either side, so a NaN can never pass as
"equal" (Python's ``max`` keeps a number against a later NaN). It reports the worst key
and its difference.

Tests import it through conftest (``from conftest import equivalence``); the scripts in
this folder, run as subprocesses, import it as ``equivalence`` (their folder is first on
``sys.path``). numpy only.

    >>> worst({"w": [1.0, 2.0]}, {"w": [1.0, 2.5]})
    ('w', 0.5)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

__all__ = [
    "NotEquivalent",
    "assert_allclose",
    "assert_close",
    "assert_differs",
    "assert_within",
    "case_failures",
    "differences",
    "flatten",
    "max_difference",
    "worst",
    "worst_of",
]


class NotEquivalent(AssertionError):
    """The two sides cannot be called equal: a key, a shape or a value says why."""


def flatten(value, prefix: str = "") -> dict[str, np.ndarray]:
    """``value`` as ``{key path: float64 array}``: dicts by key, ragged lists by index."""
    history = getattr(value, "history", None)
    if isinstance(history, Mapping) and not isinstance(value, Mapping):
        value = history
    if isinstance(value, Mapping):
        out: dict[str, np.ndarray] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}/{key}" if prefix else str(key)))
        return out
    if value is None or isinstance(value, (str, bytes)):
        raise NotEquivalent(f"{prefix or 'value'}: {value!r} is not a number")
    if isinstance(value, (list, tuple)):
        try:
            return {prefix: _numbers(value, prefix)}
        except (ValueError, TypeError):  # ragged (a list of weight arrays) or mixed
            out = {}
            for i, item in enumerate(value):
                out.update(flatten(item, f"{prefix}[{i}]"))
            return out
    return {prefix: _numbers(value, prefix)}


def _numbers(value, key: str) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise TypeError(f"{key}: not numbers ({array.dtype})")
    return array.astype(np.float64)


def differences(reference, got) -> dict[str, float]:
    """Each key's largest absolute difference; raises ``NotEquivalent`` when the two
    cannot be compared (a key on one side only, a shape change, a non-finite value)."""
    ref, new = flatten(reference), flatten(got)
    if set(ref) != set(new):
        raise NotEquivalent(
            f"keys differ: only in the reference {sorted(set(ref) - set(new))}, "
            f"only in the result {sorted(set(new) - set(ref))}"
        )
    if not ref:
        raise NotEquivalent("nothing to compare: both sides are empty")
    out = {}
    for key, a in ref.items():
        b = new[key]
        if a.shape != b.shape:
            raise NotEquivalent(f"{key or 'value'}: shape {b.shape}, the reference's {a.shape}")
        for side, array in (("reference", a), ("result", b)):
            if not np.all(np.isfinite(array)):
                bad = array[~np.isfinite(array)]
                raise NotEquivalent(
                    f"{key or 'value'}: {bad.size} non-finite value(s) in the {side} "
                    f"(first {bad.flat[0]})"
                )
        out[key] = float(np.max(np.abs(a - b))) if a.size else 0.0
    return out


def worst(reference, got) -> tuple[str, float]:
    """``(key, difference)`` of the key that differs most."""
    return worst_of(differences(reference, got))


def max_difference(reference, got) -> float:
    """The largest difference anywhere (raises like ``differences``)."""
    return worst(reference, got)[1]


def worst_of(diffs: Mapping[str, float]) -> tuple[str, float]:
    """The largest of already computed differences, e.g. ones a job printed; a missing
    (None) or non-finite one raises instead of being skipped."""
    if not diffs:
        raise NotEquivalent("no differences to check")
    for key, value in diffs.items():
        if value is None or not math.isfinite(value):
            raise NotEquivalent(f"{key}: difference {value!r} is not a finite number")
    key = max(diffs, key=lambda k: diffs[k])
    return key, float(diffs[key])


def assert_within(diffs: Mapping[str, float], tolerance: float, what: str = "") -> str:
    """Every difference in ``diffs`` is finite and at most ``tolerance``."""
    key, value = worst_of(diffs)
    if not value <= tolerance:
        raise NotEquivalent(
            f"{what + ': ' if what else ''}{key} differs by {value:.3g} > {tolerance:g} "
            f"(all: {dict(diffs)})"
        )
    return key


def assert_close(reference, got, tolerance: float, what: str = "") -> float:
    """``got`` equals ``reference`` within ``tolerance`` everywhere; the worst difference."""
    key, value = worst(reference, got)
    if not value <= tolerance:
        raise NotEquivalent(
            f"{what + ': ' if what else ''}{key or 'value'} differs by {value:.3g} > {tolerance:g}"
        )
    return value


def assert_allclose(actual, desired, *, rtol: float = 0.0, atol: float = 0.0, err_msg=""):
    """numpy's element-wise rule ``|actual - desired| <= atol + rtol * |desired|`` (its
    argument order: ``desired`` is the reference), with this module's checks first: the
    same keys and shapes, every value finite on both sides (numpy calls NaN == NaN equal
    and broadcasts a one-element list against any shape; this does neither).

        >>> assert_allclose([1.0, 2.0], [1.0, 2.0 + 1e-9], rtol=1e-6)
    """
    differences(desired, actual)  # keys, shapes, finite values: raises NotEquivalent
    reference, got = flatten(desired), flatten(actual)
    for key, want in reference.items():
        have = got[key]
        bad = np.abs(have - want) > atol + rtol * np.abs(want)
        if np.any(bad):
            where = int(np.flatnonzero(bad)[0])
            raise NotEquivalent(
                f"{err_msg + ': ' if err_msg else ''}{key or 'value'}: {int(bad.sum())} of "
                f"{bad.size} differ beyond atol={atol:g} + rtol={rtol:g} * |desired| (first: "
                f"{have.flat[where]!r} against {want.flat[where]!r})"
            )


def assert_differs(reference, got, tolerance: float, what: str = "") -> float:
    """``got`` differs from ``reference`` by more than ``tolerance`` somewhere (both sides
    still complete and finite); the worst difference."""
    key, value = worst(reference, got)
    if not value > tolerance:
        raise NotEquivalent(
            f"{what + ': ' if what else ''}expected a difference > {tolerance:g}, the worst "
            f"({key or 'value'}) is {value:.3g}"
        )
    return value


def case_failures(reference: Mapping, cell: Mapping, tolerance: float, expect_error=None) -> list:
    """What differs between two job reports' ``cases`` (``{name: {"values": ...}}`` or
    ``{name: {"error": "..."}}``): each reference case must have run, and each case of
    ``cell`` must equal it within ``tolerance``, or, where ``expect_error(name)`` gives a
    regular expression, must have failed with an error matching it.

        >>> case_failures({"a": {"values": 1.0}}, {"a": {"values": 1.5}}, 0.1)
        ['a: value differs by 0.5 > 0.1']
    """
    import re

    failures = []
    for name, expected in reference.items():
        if "values" not in expected:
            failures.append(f"{name} failed in the reference: {expected}")
            continue
        got = cell.get(name, {"error": "missing"})
        pattern = expect_error(name) if expect_error else None
        if pattern is not None:
            if not re.search(pattern, got.get("error", "")):
                failures.append(f"{name}: expected an error matching {pattern!r}, got {got}")
        elif "error" in got:
            failures.append(f"{name}: {got['error']}")
        else:
            try:
                assert_close(expected["values"], got["values"], tolerance, name)
            except NotEquivalent as difference:
                failures.append(str(difference))
    return failures
