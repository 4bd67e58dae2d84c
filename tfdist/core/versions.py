"""The TensorFlow, Keras and JAX versions tfdist's fixes are verified on.

tfdist patches private internals of Keras and TensorFlow (``tfdist.compat``), so it
states exactly which releases it was tested with: ``VERIFIED`` lists, per package, the
oldest and newest minor release ``noxfile.py`` runs the compat and equivalence tests on.
Outside that range tfdist still runs (every fix checks that the code it patches is the
code verified, ``tfdist.core.fix_registry.guard``, and steps aside with a warning
otherwise) and warns once per package, so a user who
upgrades sees why a distributed run may behave differently.

TensorFlow-free: it reads installed versions from package metadata.

Example:
    >>> from tfdist.core import versions
    >>> versions.in_range("keras", "3.15.1")
    True
    >>> versions.in_range("tensorflow", "2.22.0")
    False
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import warnings

from tfdist.core import process, validate

__all__ = ["VERIFIED", "in_range", "check", "verified_lines"]

logger = logging.getLogger(__name__)

# (oldest, newest) minor release verified, inclusive. noxfile.py's PAIRS run the compat
# and equivalence tests on each end; widen these only together with a passing session.
VERIFIED: dict[str, tuple[str, str]] = {
    "tensorflow": ("2.20", "2.21"),
    "keras": ("3.11", "3.15"),
    "jax": ("0.10", "0.12"),
}


def _minor(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(
            f"tfdist.versions: version must start with MAJOR.MINOR. Received: "
            f"version={version!r}. Pass a release string such as '2.21.0'."
        )
    return int(found.group(1)), int(found.group(2))


def in_range(package: str, version: str) -> bool:
    """Whether ``version`` of ``package`` lies in tfdist's verified range.

    Example:
        >>> in_range("tensorflow", "2.21.0")
        True
    """
    where = "tfdist.versions.in_range"
    validate.one_of(package, tuple(VERIFIED), "package", where)
    validate.instance(version, str, "version", where, "a release string such as '2.21.0'")
    oldest, newest = (_minor(v) for v in VERIFIED[package])
    return oldest <= _minor(version) <= newest


def installed(package: str) -> str | None:
    """The installed version of ``package``, or None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check(package: str, version: str | None = None) -> bool:
    """Warns once per process when ``package`` is outside the verified range.

    Returns whether it is inside (or not installed). ``tfdist.startup`` calls it when
    TensorFlow, Keras or jax is imported.
    """
    version = version or installed(package)
    if version is None or in_range(package, version):
        return True
    st = process.state()
    with st.lock:
        if package in st.version_warnings:
            return False
        st.version_warnings.add(package)
    oldest, newest = VERIFIED[package]
    warnings.warn(
        f"tfdist: {package} {version} is outside the range tfdist's fixes are verified on "
        f"({oldest}-{newest}). tfdist still runs; a fix whose upstream code is not the code "
        "verified steps aside with a warning naming it (tfdist info lists them). Install a verified release for results tfdist's tests guarantee: "
        f"pip install '{package}>={oldest},<{_next_minor(newest)}'.",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


def _next_minor(version: str) -> str:
    major, minor = _minor(version)
    return f"{major}.{minor + 1}"


def verified_lines() -> list[str]:
    """One line per package: installed version, verified range, in or out (tfdist info)."""
    lines = []
    for package, (oldest, newest) in VERIFIED.items():
        version = installed(package)
        if version is None:
            state = "not installed"
        else:
            state = "verified" if in_range(package, version) else "OUTSIDE the verified range"
        lines.append(f"{package} {version or '-'}: {state} ({oldest}-{newest})")
    return lines
