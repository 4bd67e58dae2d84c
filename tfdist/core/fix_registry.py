"""The Fix record, its targets and guards, and the one way tfdist patches an upstream name
(``patch``) and applies a fix (``apply_fix``).

A fix is a guest in upstream's house. Each ``Fix`` names its ``targets``: the upstream
names it replaces or relies on (``"module:Attr.path"``, the form ``tfdist.core.upstream``
lists), each with what tfdist verified about it: that it exists, its call signature, and
(``fingerprints.json``) a hash of its code on each verified release. ``guard(fix)``
checks them before the fix is applied: a missing or changed target skips that fix with
one warning (``tfdist.compat.apply_all``), and nothing here can make ``import keras``,
``import tensorflow`` or ``import jax`` fail. Inside the verified version range
(``tfdist.core.versions``) existence and signature are checked; outside it the code must also
be the code verified, since a same-named function may no longer do what the fix assumes.

Example:
    >>> _version_tuple("2.21.0rc1")
    (2, 21, 0)
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import re
import textwrap
import threading
import tokenize
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfdist.core import config, versions

__all__ = [
    "Fix",
    "Patch",
    "wrap",
    "Target",
    "targets",
    "guard",
    "record",
    "fingerprint",
    "patch",
    "journal",
    "on_keras_backend",
    "on_tensorflow_backend",
    "fixed_upstream",
    "NOT_FILED",
]

# Set on every function a fix installs: re-applying (even from a reloaded module) is a no-op.
_MARK = "__tfdist_fix__"
FINGERPRINTS_FILE = Path(__file__).with_name("fingerprints.json")


@dataclass(frozen=True)
class Target:
    """An upstream name a fix patches or reads.

    What tfdist verified about it (signature and a hash of its code, per verified
    release) is in ``fingerprints.json``, written by ``tools/fix_fingerprints.py``.

    Attributes:
        entry: ``"module:Attr.path"``, as in ``tfdist.core.upstream.REQUIRED``.
        instance: an attribute only instances have (set in ``__init__``): checked as
            ``self.<name> =`` in the owner class's source (or a base's).

    Example:
        >>> Target("keras.src.tree:flatten").package
        'keras'
    """

    entry: str
    instance: bool = False

    @property
    def package(self) -> str:
        return self.entry.split(".", 1)[0].split(":", 1)[0]


def targets(*entries: str) -> tuple[Target, ...]:
    """``Target``s from entries; a trailing ``" (instance)"`` marks an instance attribute.

    Example:
        >>> targets("keras.src.tree:flatten", "a.b:C._x (instance)")[1].instance
        True
    """
    suffix = " (instance)"
    return tuple(Target(e.removesuffix(suffix), instance=e.endswith(suffix)) for e in entries)


@dataclass(frozen=True)
class Patch:
    """The patching mechanism's record: a named change of upstream names, guarded by its
    ``targets``, applied once under the ``journal`` and recorded (``apply_fix``). tfdist's
    hooks (its start-up, the unscoped-models hook, sync BatchNorm, the JAX watchdog) are
    ``Patch`` records; a ``Fix`` is one plus what makes it a repair of upstream.

    Attributes:
        name: identifier, used in logs and the process state (and, for the hooks
            ``tfdist.compat.HOOKS`` lists, in ``TFDIST_COMPAT_EXCLUDE``).
        apply: patches; safe to call more than once.
        purpose: one line: what the hook does (what a skipped hook leaves undone).
        applies: returns True when this process needs it (its backend).
        package: the package it patches (applied as soon as that package is imported).
        targets: every upstream name it replaces or relies on (``guard`` checks them).
    """

    name: str
    apply: Callable[[], None]
    purpose: str = ""
    applies: Callable[[], bool] = field(default=lambda: True)
    package: str = "keras"
    targets: tuple[Target, ...] = field(default=())


# A fix's ``upstream_issue`` when no report is filed upstream, and why.
NOT_FILED = (
    "none filed: tfdist's own tests found the defect, and its upstream_failure test is the "
    "reproduction a report would carry"
)


@dataclass(frozen=True)
class Fix:
    """One upstream defect and its fix: the fields of a ``Patch`` (name, apply, applies,
    package, targets) and those that make it a repair (summary, acts_where, no_harm,
    upstream_issue, fixed_in).

    Attributes:
        name: short identifier, used in logs, ``applied()`` and ``TFDIST_COMPAT_EXCLUDE``.
        summary: one line: what breaks upstream (what a skipped fix leaves broken).
        applies: returns True when this process has the defect (its backend).
        apply: patches it; safe to call more than once.
        package: the package it patches (``tensorflow`` or ``keras``): a fix is applied
            as soon as its package is imported, before the script can use it.
        targets: every upstream name the fix replaces or relies on (``guard`` checks them).
        acts_where: one line: the calls and topologies on which the fix changes anything
            (where its patch does not return to upstream's code path), and what stays
            upstream's. Every fix in ``tfdist.compat.FIXES`` states it (docs/fixes.md).
        no_harm: the no-harm checks that run the fix where it acts, with it on, and
            compare with one device or with the fixes off: pytest node ids
            (``tests/...py::test_name`` or ``...::test_name[param]``) and, where only some
            cases of the matrix reach it, their names in ``tests/scripts/no_harm_job.py``'s
            ``CASES``. Empty when no such check covers it yet.
        upstream_issue: the upstream report's URL, or a sentence saying why none is filed.
        fixed_in: ``"<package> <version>"``, the upstream release that fixes the defect,
            or None: from that release on the fix does not apply (``fixed_upstream``).
        verified_against: (derived) the upstream releases its targets' fingerprints were
            taken on, from ``fingerprints.json``.
    """

    name: str
    summary: str
    applies: Callable[[], bool]
    apply: Callable[[], None]
    package: str = "keras"
    targets: tuple[Target, ...] = field(default=())
    acts_where: str = ""
    no_harm: tuple[str, ...] = ()
    upstream_issue: str = NOT_FILED
    fixed_in: str | None = None

    @property
    def verified_against(self) -> tuple[str, ...]:
        """``("keras 3.11", ..., "tensorflow 2.21")``: the releases its targets were verified on."""
        found = {
            release for t in self.targets for release in verified_fingerprints().get(t.entry, {})
        }
        return tuple(sorted(found, key=lambda r: (r.split()[0], _version_tuple(r.split()[-1]))))


# ------------------------------------------------------------------------- versions


def _version_tuple(text: str) -> tuple[int, ...]:
    """``"2.21.0rc1"`` -> ``(2, 21, 0)``; only the leading numeric parts count."""
    parts = []
    for piece in text.split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def fixed_upstream(fix: Fix) -> str | None:
    """Why ``fix`` does not apply because the installed upstream release fixes the defect
    (``fix.fixed_in`` reached), or None.

    Example:
        >>> fixed_upstream(Fix("noop", "nothing", lambda: True, lambda: None))  # no fixed_in
    """
    if not fix.fixed_in:
        return None
    package, _, release = fix.fixed_in.partition(" ")
    version = versions.installed(package)
    if version is None or _version_tuple(version) < _version_tuple(release):
        return None
    return f"fixed upstream in {fix.fixed_in} ({package} {version} is installed)"


def on_keras_backend(backend: str) -> Callable[[], bool]:
    """A fix for Keras on ``backend``; the verified versions are checked by ``guard``."""

    def applies() -> bool:
        import keras  # noqa: F401  (Keras settles its backend on import)

        return config.keras_backend() == backend

    return applies


def on_tensorflow_backend() -> Callable[[], bool]:
    """A TensorFlow runtime fix, under the TensorFlow backend only (a JAX process that uses
    tf.data for input gets no TensorFlow runtime patches)."""

    def applies() -> bool:
        return config.keras_backend() == "tensorflow"

    return applies


# ------------------------------------------------------------------------- guards


def _resolve(entry: str):
    """``(owner, value)`` of ``"module:Attr.path"``; AttributeError/ImportError if gone."""
    module_name, _, path = entry.partition(":")
    owner = value = importlib.import_module(module_name)
    for part in path.split("."):
        owner, value = value, getattr(value, part)
    return owner, value


def _original(value):
    """The upstream function behind one of tfdist's patches (fingerprints are upstream's)."""
    if isinstance(value, property):  # its getter is the code
        value = value.fget
    while getattr(value, _MARK, None) is not None and hasattr(value, "__wrapped__"):
        value = value.__wrapped__
    return value


def _sets_instance_attribute(owner, name: str) -> bool:
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=]*)?=(?!=)")
    classes = owner.__mro__ if inspect.isclass(owner) else (owner,)
    for cls in classes:
        with contextlib.suppress(OSError, TypeError):
            if pattern.search(inspect.getsource(cls)):
                return True
    return False


def fingerprint(value) -> str | None:
    """A short hash of a function's code without docstrings, comments and blanks, so the
    same code hashes alike on every Python version (None if it has no Python source).

    Example:
        >>> fingerprint(fingerprint) == fingerprint(fingerprint)
        True
    """
    value = _original(value)
    value = getattr(value, "__func__", value)
    try:
        source = textwrap.dedent(inspect.getsource(value))
    except (OSError, TypeError):
        return None
    spans = [
        ((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    spans += [
        (token.start, token.end)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    # Cut docstrings and comments out of the text itself, then every blank: the tokens
    # of an f-string differ between Python versions, its text does not.
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    text = source
    for (row, col), (end_row, end_col) in sorted(spans, reverse=True):
        # ast.parse gives every node its end position.
        assert end_row is not None and end_col is not None
        first, last = starts[row - 1] + col, starts[end_row - 1] + end_col
        text = text[:first] + text[last:]
    kept = re.sub(r"\s+", "", text)
    return hashlib.sha256(kept.encode()).hexdigest()[:16]


def _signature(value) -> str | None:
    try:
        return str(inspect.signature(_original(value)))
    except (TypeError, ValueError):
        return None


_fingerprints_cache: dict | None = None


def verified_fingerprints() -> dict[str, dict[str, dict[str, Any]]]:
    """``{entry: {"keras 3.15": {"signature": ..., "code": hash}, ...}}`` as
    ``tools/fix_fingerprints.py`` wrote it (a value may be None)."""
    global _fingerprints_cache
    if _fingerprints_cache is None:
        try:
            _fingerprints_cache = json.loads(FINGERPRINTS_FILE.read_text())
        except (OSError, ValueError):
            _fingerprints_cache = {}
    return _fingerprints_cache


def _check_target(target: Target) -> str | None:
    """Why ``target`` is not what the fix was verified against, or None."""
    if target.instance:
        owner_entry, _, attribute = target.entry.rpartition(".")
        try:
            _, owner = _resolve(owner_entry)
        except (ImportError, AttributeError):
            return f"{owner_entry} is gone"
        if not _sets_instance_attribute(owner, attribute):
            return f"{target.entry} is no longer set by its class"
        return None
    try:
        _, value = _resolve(target.entry)
    except (ImportError, AttributeError):
        return f"{target.entry} is gone"
    verified = verified_fingerprints().get(target.entry, {})
    signatures = {record["signature"] for record in verified.values()}
    signature = _signature(value)
    if signatures and signature not in signatures:
        return f"{target.entry} changed its signature to {signature} (verified: {sorted(signatures)[0]})"
    version = versions.installed(target.package)
    if version is not None and not versions.in_range(target.package, version):
        codes = {record["code"] for record in verified.values()}
        if fingerprint(value) not in codes:
            oldest, newest = versions.VERIFIED[target.package]
            return (
                f"{target.entry} in {target.package} {version} is not the code verified "
                f"on {target.package} {oldest}-{newest}"
            )
    return None


def record(target: Target) -> dict | None:
    """What to store in ``fingerprints.json`` for ``target`` on the installed release."""
    if target.instance:
        return None
    _, value = _resolve(target.entry)
    return {"signature": _signature(value), "code": fingerprint(value)}


def guard(fix: Fix | Patch) -> str | None:
    """Why ``fix`` must not be applied in this process (a target missing or changed), or None.

    Never raises: an unexpected error while checking counts as a changed target.

    Example:
        >>> guard(Fix("noop", "nothing", lambda: True, lambda: None))  # no targets
    """
    for target in fix.targets:
        try:
            reason = _check_target(target)
        except Exception as err:  # noqa: BLE001 - whatever upstream became, do not break it
            reason = f"{target.entry} could not be checked ({type(err).__name__}: {err})"
        if reason:
            return reason
    return None


# ------------------------------------------------------------------------- patching

_journal = threading.local()


@contextlib.contextmanager
def journal() -> Iterator[None]:
    """Undoes every ``patch`` made inside the block when the block raises.

    A fix that patches several names and fails half-way leaves upstream as it was.

    Example:
        >>> with journal():
        ...     pass
    """
    entries: list = []
    _journal.entries = entries
    try:
        yield
    except BaseException:
        for owner, attr, original, owned in reversed(entries):
            if owned:
                setattr(owner, attr, original)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(owner, attr)
        raise
    finally:
        _journal.entries = None


def patch(owner, attr: str, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replaces ``owner.attr`` by ``make(original)`` unless fix ``name`` already did."""
    original = getattr(owner, attr)
    if getattr(original, _MARK, None) == name:
        return
    raw = vars(owner).get(attr)  # the descriptor itself (staticmethod, ...), if owner's own
    patched: Any = make(original)  # a function: it takes attributes
    setattr(patched, _MARK, name)
    patched.__wrapped__ = original
    setattr(owner, attr, patched)
    entries = getattr(_journal, "entries", None)
    if entries is not None:
        entries.append((owner, attr, raw, raw is not None))


def wrap(owner, attr: str, name: str, wrapper: Callable[..., Any]) -> None:
    """Replaces ``owner.attr`` by ``wrapper(original, *args, **kwargs)``: a patch written as
    one function of the original (``patch`` with the closure made here).

    Example:
        >>> class Owner:
        ...     def f(self, x):
        ...         return x
        >>> wrap(Owner, "f", "double", lambda original, self, x: 2 * original(self, x))
        >>> Owner().f(3)
        6
    """

    def make(original):
        def patched(*args, **kwargs):
            return wrapper(original, *args, **kwargs)

        return patched

    patch(owner, attr, name, make)


def apply_fix(fix: Fix | Patch) -> str | None:
    """The one way a patch of upstream is applied: ``fix`` unless a target is missing or
    changed (``guard``), rolled back whole if it fails half-way (``journal``), recorded
    in the process state (``applied_fixes`` / ``skipped_fixes``); at most once per
    process. Returns why it was not applied, or None. Never raises.

    ``tfdist.compat.apply_all`` calls it for every fix of ``tfdist.compat.FIXES`` that
    applies and is not excluded; ``tfdist.batchnorm`` for its hook when
    ``tfdist.scope(sync_batchnorm=True)`` needs it although excluded; ``tfdist.startup``
    for its own set-up hook (``STARTUP``), which no exclusion removes.

    Example:
        >>> apply_fix(Fix("noop", "nothing", lambda: True, lambda: None))  # doctest: +SKIP
    """
    from tfdist.core import process

    st = process.state()
    with st.lock:
        if fix.name in st.applied_fixes:
            return None
        if fix.name in st.skipped_fixes:
            return st.skipped_fixes[fix.name]
        reason = guard(fix)
        if reason is None:
            try:
                with journal():
                    fix.apply()
            except Exception as err:  # noqa: BLE001 - a fix must never break the import it runs in
                reason = f"applying it failed ({type(err).__name__}: {err})"
        if reason is None:
            st.applied_fixes.append(fix.name)
        else:
            st.skipped_fixes[fix.name] = reason
        return reason


# ``tfdist.compat.apply_all``, registered by ``tfdist.compat`` when it is imported (the
# start-up hooks import it with TensorFlow or Keras). The backends apply the fixes before
# they build a strategy through this seam: compat stands above them (its chief-only
# writes use ``tfdist.saving``'s protocol), so they may not import it.
_apply_all: Callable[[], list[str]] | None = None


def register_apply_all(apply_all: Callable[[], list[str]]) -> None:
    """Registers the function that applies every fix (``tfdist.compat`` does, on import)."""
    global _apply_all
    _apply_all = apply_all


def apply_registered() -> list[str]:
    """Applies every fix through the registered ``apply_all``; [] before compat's import.

    Example:
        >>> apply_registered()  # doctest: +SKIP
        ['keras_tf_symbolic_build_from_spec', ...]
    """
    return [] if _apply_all is None else _apply_all()
