"""Fixes for Keras/TensorFlow defects that break distributed training, applied once.

Each fix is a small ``Fix`` record: the backend it applies to, its upstream targets, a
function that applies it (idempotently), and a docstring on that function saying what it
changes and why the result is correct. ``apply_all()`` runs every fix that applies;
each fix is applied as soon as the package it patches is imported (``tfdist.startup``),
so scripts that build ``tf.distribute.MultiWorkerMirroredStrategy()`` by hand get them
too, including those started by ``tfdist launch`` that never import tfdist.

The fixes are the ``FIXES`` records below (and the ``FIXES`` of the modules listed after
them); docs/multi_worker.md's table is generated from them (``tools/fix_table.py``) and
``tfdist info`` shows each one's state. Each names its upstream targets: a missing or
changed target makes that fix step aside with one ``FixSkippedWarning``
(``fix_registry.guard``). A test marked ``upstream_failure`` reproduces each upstream failure
without its fix, so we notice when upstream fixes it.

Switch fixes off with ``apply_all(exclude=[...])`` or ``TFDIST_COMPAT_EXCLUDE=name1,name2``
(``all`` for every fix: what ``tfdist launch --no-fixes`` sets).
Each fix is guarded by its backend: a JAX process gets no TensorFlow runtime patch.

Layout: one module per fix or per family of fixes, each exporting its ``FIXES``; ``MODULES``
lists them in the order they are applied (the ``Fix`` record, its guards and ``patch`` are
``tfdist.core.fix_registry``'s). This module applies them.

Example:
    >>> from tfdist import compat
    >>> compat.apply_all()  # doctest: +SKIP
    ['keras_tf_symbolic_build_from_spec', 'keras_tf_multi_worker_mean', ...]
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from collections.abc import Mapping, Sequence

from tfdist import batchnorm
from tfdist.compat import jax_watchdog
from tfdist.core import config, fix_registry, process, validate, versions
from tfdist.core.fix_registry import Fix

__all__ = [
    "Fix",
    "FIXES",
    "FixSkippedWarning",
    "apply_all",
    "applied",
    "skipped",
    "status",
    "fix_names",
    "RENAMED",
    "MODULES",
    "HOOKS",
]

logger = logging.getLogger(__name__)


class FixSkippedWarning(RuntimeWarning):
    """A fix was not applied: the upstream code it patches is missing or changed."""


# The modules of fixes, in the order their fixes are applied; each exports its records as
# FIXES. Retiring a fix's module is deleting its line here (docs/architecture.md).
MODULES = (
    "tfdist.compat.symbolic_build",
    "tfdist.compat.multi_worker_mean",
    "tfdist.compat.ema_overwrite",
    "tfdist.compat.gradient_accumulation",
    "tfdist.compat.progbar",
    "tfdist.compat.scalar_variables",
    "tfdist.compat.tf_fixes",
    "tfdist.compat.jax_fixes",
    "tfdist.compat.clipping",
    "tfdist.compat.chief_checkpoints",
    "tfdist.compat.chief_writes",
    "tfdist.compat.inputs.jax",
    "tfdist.compat.on_batch",
    "tfdist.compat.loss_scale",
    "tfdist.compat.loss_weights",
    "tfdist.compat.partial_batches.tensorflow",
    "tfdist.compat.empty_replicas",
    "tfdist.compat.partial_batches.jax",
    "tfdist.compat.inputs.tensorflow",
    "tfdist.compat.jit_compile",
    "tfdist.compat.steps_per_execution",
    "tfdist.compat.epoch_start",
    "tfdist.compat.compile_scope",
    "tfdist.compat.optimizer_build",
    "tfdist.compat.collective_keys",
    "tfdist.compat.custom_train_step",
    "tfdist.compat.added_losses",
)
# Every fix, in the order they are applied.
FIXES: list[Fix] = [fix for name in MODULES for fix in importlib.import_module(name).FIXES]
# tfdist's hooks that apply_all applies after the fixes, the same way (guarded, journaled,
# recorded, named in TFDIST_COMPAT_EXCLUDE), but that repair nothing upstream: not fixes, so
# not in FIXES, the fix table or status(). tfdist.startup and tfdist.unscoped apply their
# own hooks, which no exclusion removes.
HOOKS: tuple[fix_registry.Patch, ...] = (batchnorm.HOOK, jax_watchdog.HOOK)


# Fix names renamed by the naming rule (docs/architecture.md), old -> new: the old name
# is still accepted wherever a fix is named (exclude=, TFDIST_COMPAT_EXCLUDE), with one
# FutureWarning naming the new name.
RENAMED: dict[str, str] = {
    "keras_symbolic_build_from_spec": "keras_tf_symbolic_build_from_spec",
    "keras_multi_worker_mean": "keras_tf_multi_worker_mean",
    "keras_ema_overwrite_under_strategy": "keras_tf_ema_overwrite_under_strategy",
    "keras_gradient_accumulation": "keras_tf_gradient_accumulation",
    "keras_progbar_chief_only": "keras_tf_progbar_chief_only",
    "keras_clip_after_all_reduce": "keras_tf_clip_after_all_reduce",
    "keras_predict_on_batch_copies": "keras_tf_predict_on_batch_copies",
    "keras_loss_scale_finite_everywhere": "keras_tf_loss_scale_finite_everywhere",
    "keras_partial_batch_loss_weights": "keras_tf_partial_batch_loss_weights",
    "keras_jit_compile_refused_under_strategy": "keras_tf_jit_compile_refused_under_strategy",
    "keras_steps_per_execution_under_strategy": "keras_tf_steps_per_execution_under_strategy",
    "keras_compile_in_model_scope": "keras_tf_compile_in_model_scope",
}


def fix_names() -> list[str]:
    """Names of all known fixes, in the order ``apply_all`` applies them.

    Example:
        >>> "keras_tf_multi_worker_mean" in fix_names()
        True
    """
    return [fix.name for fix in FIXES]


def _excluded(exclude: Sequence[str] | None, environ: Mapping[str, str]) -> set[str]:
    received: str | Sequence[str]  # echoed in the error
    if exclude is None:
        names, where = config.compat_exclude(environ), config.COMPAT_EXCLUDE_ENV
        received = environ.get(config.COMPAT_EXCLUDE_ENV, "")
        if names == ["all"]:  # `tfdist launch --no-fixes`: upstream behaviour throughout
            return set(_excludable())
    else:
        if isinstance(exclude, str):
            raise TypeError(
                validate.message(
                    "apply_all",
                    "exclude",
                    "a list of fix names, not a string",
                    exclude,
                    f"Use exclude=[{exclude!r}].",
                )
            )
        names, where, received = list(exclude), "exclude", exclude
    names = [_current_name(name, where) for name in names]
    unknown = sorted(set(names) - set(_excludable()))
    if unknown:
        raise config.ConfigError(
            f"apply_all: {where} names unknown fixes {unknown}. Received: "
            f"{where}={received!r}. Known fixes: {fix_names()}; hooks: "
            f"{[hook.name for hook in HOOKS]}."
        )
    return set(names)


def _excludable() -> list[str]:
    """The names an exclusion may list: every fix, then every hook of ``HOOKS``."""
    return [*fix_names(), *(hook.name for hook in HOOKS)]


def _current_name(name: str, where: str) -> str:
    """``name``, or the name a renamed fix has now (one FutureWarning naming it)."""
    if name not in RENAMED:
        return name
    warnings.warn(
        f"tfdist: fix {name} is now named {RENAMED[name]}; {where} accepts the old name "
        f"for now: write {RENAMED[name]}.",
        FutureWarning,
        stacklevel=4,
    )
    return RENAMED[name]


def apply_all(
    *,
    exclude: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    package: str | None = None,
) -> list[str]:
    """Applies every fix that matches the installed versions; returns the names applied.

    Safe to call any number of times and from several threads; each fix is applied at
    most once per process.

    Args:
        exclude: names of fixes to skip; when None, read from ``TFDIST_COMPAT_EXCLUDE``.
        environ: where to read ``TFDIST_COMPAT_EXCLUDE``; defaults to ``os.environ``.
        package: only the fixes of this package (``tensorflow`` or ``keras``), for the
            start-up hook that runs when that package has just been imported.

    Raises:
        ConfigError: ``exclude`` names a fix that does not exist.

    Example:
        >>> apply_all(exclude=["keras_tf_progbar_chief_only"])  # doctest: +SKIP
        ['keras_tf_symbolic_build_from_spec', 'keras_tf_multi_worker_mean', ...]
    """
    skip = _excluded(exclude, os.environ if environ is None else environ)
    st = process.state()
    with st.lock:
        patches: list[Fix | fix_registry.Patch] = [*FIXES, *HOOKS]
        for fix in patches:
            done = fix.name in st.applied_fixes or fix.name in st.skipped_fixes
            if done or fix.name in skip or (package is not None and fix.package != package):
                continue
            if isinstance(fix, Fix) and fix_registry.fixed_upstream(fix):
                continue
            if not _needed(fix):
                continue
            reason = fix_registry.apply_fix(fix)
            if reason is None:
                logger.debug("tfdist.compat: applied %s", fix.name)
            else:
                _warn_skipped(fix, reason)
        return applied()


fix_registry.register_apply_all(apply_all)


def _needed(fix: Fix | fix_registry.Patch) -> bool:
    try:
        return bool(fix.applies())
    except Exception as err:  # noqa: BLE001 - a guard must never break the import it runs in
        logger.debug("tfdist.compat: %s: could not tell whether it applies (%s)", fix.name, err)
        return False


def _warn_skipped(fix: Fix | fix_registry.Patch, reason: str) -> None:
    verified = ", ".join(f"{p} {lo}-{hi}" for p, (lo, hi) in versions.VERIFIED.items())
    without = fix.summary if isinstance(fix, Fix) else f"tfdist's hook does not run ({fix.purpose})"
    warnings.warn(
        f"tfdist: fix {fix.name} is skipped: {reason}. Without it: {without}. The fix "
        f"was verified on {verified}; install a verified release, or report the new "
        "upstream code to tfdist.",
        FixSkippedWarning,
        stacklevel=3,
    )


def skipped() -> dict[str, str]:
    """Fixes not applied in this process because a target was missing or changed, and why.

    Example:
        >>> skipped()  # doctest: +SKIP
        {}
    """
    return dict(process.state().skipped_fixes)


def status() -> list[dict]:
    """Every fix with its state in this process: applied, skipped (and why), not needed
    (another backend), fixed upstream (its ``fixed_in`` release is installed), excluded, or pending (its package not imported yet).

    Example:
        >>> [row["state"] for row in status()]  # doctest: +SKIP
        ['applied', 'applied', ...]
    """
    st = process.state()
    try:
        excluded = _excluded(None, os.environ)
    except config.ConfigError:
        excluded = set()
    rows = []
    for fix in FIXES:
        if fix.name in st.applied_fixes:
            state, why = "applied", ""
        elif fix.name in st.skipped_fixes:
            state, why = "skipped", st.skipped_fixes[fix.name]
        elif fix.name in excluded:
            state, why = "excluded", config.COMPAT_EXCLUDE_ENV
        elif release := fix_registry.fixed_upstream(fix):
            state, why = "fixed upstream", release
        elif not _needed(fix):
            state, why = "not needed", "another backend"
        else:
            state, why = "pending", f"applied when {fix.package} is imported"
        rows.append({"name": fix.name, "package": fix.package, "state": state, "why": why})
    return rows


def applied() -> list[str]:
    """Names of the fixes of ``FIXES`` applied in this process so far, in order (tfdist's
    own set-up hook, applied the same way, is not one).

    Example:
        >>> applied()  # doctest: +SKIP
        []
    """
    names = set(fix_names())
    return [name for name in process.state().applied_fixes if name in names]
