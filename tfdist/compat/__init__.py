"""Fixes for Keras/TensorFlow defects that break distributed training, applied once.

Each fix is a small ``Fix`` record: the package versions it applies to, a function that
applies it (idempotently), and a docstring on that function saying what it changes and
why the result is correct. ``apply_all()`` runs every fix whose versions match;
each fix is applied as soon as the package it patches is imported (``tfdist.startup``),
so scripts that build ``tf.distribute.MultiWorkerMirroredStrategy()`` by hand get them
too, including those started by ``tfdist launch`` that never import tfdist.

The fixes (verified on TensorFlow 2.21 / Keras 3.15.1; tests/test_compat.py reproduces
each upstream failure without its fix, so we notice when upstream fixes it):

========================================  =============================================
``keras_symbolic_build_from_spec``         ``fit``/``evaluate`` under multi-worker: build
                                           the model from the dataset's ``element_spec``
                                           instead of pulling a batch and reducing it
                                           across workers (keras-team/keras#20585).
``keras_multi_worker_mean``                ``fit``/``evaluate`` under multi-worker: reduce
                                           per-replica metrics with ``axis=None``
                                           ("Invalid reduction dimension 0").
``keras_gradient_accumulation``            ``Optimizer(gradient_accumulation_steps=k)``
                                           under Mirrored and MultiWorkerMirrored
                                           ("merge_call called while defining a new
                                           graph").
``keras_progbar_chief_only``               progress bars and epoch logs only on the chief
                                           of a multi-worker job.
``tf_multi_worker_timeouts``               a worker that never starts, dies or stops
                                           answering ends the others with an error
                                           instead of a hang.
``tf_multi_worker_logical_cpus``           ``TFDIST_CPU_DEVICES=K`` gives each worker of
                                           a multi-worker job K replicas on CPU.
``tf_multi_worker_auto_shard``             a tf.data pipeline with fewer files than
                                           workers is sharded by DATA, not failed.
========================================  =============================================

Switch fixes off with ``apply_all(exclude=[...])`` or ``TFDIST_COMPAT_EXCLUDE=name1,name2``
(``all`` for every fix: what ``tfdist launch --no-fixes`` sets).
Under the JAX backend none of these applies (each is guarded by backend and version);
these do instead:

========================================  =============================================
``keras_jax_initialize_once``              ``keras.distribution.initialize()`` joins the
                                           job tfdist already initialised (timeouts).
``keras_jax_model_keeps_distribution``     ``fit`` after ``with distribution.scope():``
                                           stays data parallel.
``keras_jax_distributed_lookahead``        the next batch is copied to the devices while
                                           a distributed step runs.
``keras_jax_sharded_epoch_length``         per-process sharding keeps a pipeline's epoch
                                           length (full epochs after a resume).
========================================  =============================================

Layout: ``registry`` (the Fix record, version guards, ``patch``), ``keras_fixes``,
``tf_fixes``, ``jax_fixes``, ``datasets`` (a dataset with a declared length); this
module lists them and applies them.

Example:
    >>> from tfdist import compat
    >>> compat.apply_all()  # doctest: +SKIP
    ['keras_symbolic_build_from_spec', 'keras_multi_worker_mean', ...]
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

from tfdist import config, process, validate
from tfdist.compat import jax_fixes, keras_fixes, tf_fixes
from tfdist.compat.registry import Fix, keras_jax_backend, keras_tf_backend, tensorflow_versions

__all__ = ["Fix", "FIXES", "apply_all", "applied", "fix_names"]

logger = logging.getLogger(__name__)

FIXES: list[Fix] = [
    Fix(
        "keras_symbolic_build_from_spec",
        "Keras 3 fit/evaluate under MultiWorkerMirroredStrategy: 'Attempt to convert a "
        "value (PerReplica...)' in TensorFlowTrainer._maybe_symbolic_build",
        keras_tf_backend((3, 0), (4, 0)),
        keras_fixes.fix_symbolic_build,
    ),
    Fix(
        "keras_multi_worker_mean",
        "Keras 3 fit/evaluate under MultiWorkerMirroredStrategy: 'Invalid reduction "
        "dimension 0 for input with 0 dimensions' in reduce_per_replica",
        keras_tf_backend((3, 0), (4, 0)),
        keras_fixes.fix_multi_worker_mean,
    ),
    Fix(
        "keras_gradient_accumulation",
        "Keras 3 Optimizer(gradient_accumulation_steps=k) under Mirrored/MultiWorker"
        "MirroredStrategy: 'merge_call called while defining a new graph'",
        keras_tf_backend((3, 4), (4, 0)),
        keras_fixes.fix_gradient_accumulation,
    ),
    Fix(
        "keras_progbar_chief_only",
        "Keras 3 prints progress bars on every worker of a multi-worker job",
        keras_tf_backend((3, 0), (4, 0)),
        keras_fixes.fix_progbar_chief_only,
    ),
    Fix(
        "tf_multi_worker_timeouts",
        "MultiWorkerMirroredStrategy waits forever for a worker that never starts",
        tensorflow_versions((2, 16), (3, 0)),
        tf_fixes.fix_multi_worker_timeouts,
        "tensorflow",
    ),
    Fix(
        "tf_multi_worker_logical_cpus",
        "MultiWorkerMirroredStrategy uses one CPU device per worker, ignoring logical CPUs",
        tensorflow_versions((2, 16), (3, 0)),
        tf_fixes.fix_multi_worker_logical_cpus,
        "tensorflow",
    ),
    Fix(
        "tf_multi_worker_auto_shard",
        "MultiWorkerMirroredStrategy: a dataset with fewer files than workers (tfds MNIST, "
        "one TFRecord) fails: 'Could not apply FILE based sharding: the dataset only has "
        "1 file(s)'",
        tensorflow_versions((2, 16), (3, 0)),
        tf_fixes.fix_multi_worker_auto_shard,
        "tensorflow",
    ),
    Fix(
        "keras_jax_initialize_once",
        "Keras 3 on JAX: keras.distribution.initialize() after jax was initialised (by "
        "tfdist, with timeouts) fails: 'distributed.initialize should only be called once'",
        keras_jax_backend((3, 0), (4, 0)),
        jax_fixes.fix_initialize_once,
    ),
    Fix(
        "keras_jax_model_keeps_distribution",
        "Keras 3 on JAX: fit after `with distribution.scope():` is no longer data "
        "parallel (the model does not remember its distribution, as it does on TensorFlow)",
        keras_jax_backend((3, 0), (4, 0)),
        jax_fixes.fix_model_keeps_distribution,
    ),
    Fix(
        "keras_jax_distributed_lookahead",
        "Keras 3 on JAX: under a keras.distribution each batch is copied to the devices "
        "just before its step (no look-ahead): up to 1.76x slower per step on one H100",
        keras_jax_backend((3, 0), (4, 0)),
        jax_fixes.fix_distributed_lookahead,
    ),
    Fix(
        "keras_jax_sharded_epoch_length",
        "Keras 3 on JAX, multi-process: sharding a dataset per process loses its declared "
        "length, so after a mid-epoch resume every later epoch is cut short",
        keras_jax_backend((3, 0), (4, 0)),
        jax_fixes.fix_sharded_epoch_length,
    ),
]


def fix_names() -> list[str]:
    """Names of all known fixes, in the order ``apply_all`` applies them.

    Example:
        >>> "keras_multi_worker_mean" in fix_names()
        True
    """
    return [fix.name for fix in FIXES]


def _excluded(exclude: Sequence[str] | None, environ: Mapping[str, str]) -> set[str]:
    if exclude is None:
        names, where = config.compat_exclude(environ), config.COMPAT_EXCLUDE_ENV
        received = environ.get(config.COMPAT_EXCLUDE_ENV, "")
        if names == ["all"]:  # `tfdist launch --no-fixes`: upstream behaviour throughout
            return set(fix_names())
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
    unknown = sorted(set(names) - set(fix_names()))
    if unknown:
        raise config.ConfigError(
            f"apply_all: {where} names unknown fixes {unknown}. Received: "
            f"{where}={received!r}. Known fixes: {fix_names()}."
        )
    return set(names)


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
        >>> apply_all(exclude=["keras_progbar_chief_only"])  # doctest: +SKIP
        ['keras_symbolic_build_from_spec', 'keras_multi_worker_mean', ...]
    """
    skip = _excluded(exclude, os.environ if environ is None else environ)
    st = process.state()
    with st.lock:
        for fix in FIXES:
            if fix.name in st.applied_fixes or fix.name in skip:
                continue
            if package is not None and fix.package != package:
                continue
            if not fix.applies():
                logger.debug("tfdist.compat: %s does not apply to these versions", fix.name)
                continue
            fix.apply()
            st.applied_fixes.append(fix.name)
            logger.debug("tfdist.compat: applied %s", fix.name)
        return list(st.applied_fixes)


def applied() -> list[str]:
    """Names of the fixes applied in this process so far.

    Example:
        >>> applied()  # doctest: +SKIP
        []
    """
    return list(process.state().applied_fixes)
