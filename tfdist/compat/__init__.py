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
(``registry.guard``). A test marked ``upstream_failure`` reproduces each upstream failure
without its fix, so we notice when upstream fixes it.

Switch fixes off with ``apply_all(exclude=[...])`` or ``TFDIST_COMPAT_EXCLUDE=name1,name2``
(``all`` for every fix: what ``tfdist launch --no-fixes`` sets).
Each fix is guarded by its backend: a JAX process gets no TensorFlow runtime patch.

Layout: ``registry`` (the Fix record, targets and guards, ``patch``), ``keras_fixes``,
``tf_fixes``, ``jax_fixes``, ``clipping``, ``chief_writes``, ``jax_inputs``, ``on_batch``,
``jax_watchdog``,
``loss_scale``, ``partial_batches``, ``tf_inputs``, ``jit_compile``,
``steps_per_execution``, ``datasets`` (a dataset with a
declared length); this module lists them
and applies them.

Example:
    >>> from tfdist import compat
    >>> compat.apply_all()  # doctest: +SKIP
    ['keras_symbolic_build_from_spec', 'keras_multi_worker_mean', ...]
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping, Sequence

from tfdist import batchnorm, config, process, validate, versions
from tfdist.compat import (
    chief_writes,
    clipping,
    jax_fixes,
    jax_inputs,
    jax_watchdog,
    jit_compile,
    keras_fixes,
    loss_scale,
    on_batch,
    partial_batches,
    registry,
    steps_per_execution,
    tf_fixes,
    tf_inputs,
)
from tfdist.compat.registry import Fix, on_keras_backend, on_tensorflow_backend, targets

__all__ = [
    "Fix",
    "FIXES",
    "FixSkippedWarning",
    "apply_all",
    "applied",
    "skipped",
    "status",
    "fix_names",
]

logger = logging.getLogger(__name__)


class FixSkippedWarning(RuntimeWarning):
    """A fix was not applied: the upstream code it patches is missing or changed."""


# Module prefixes of the targets below.
_KT = "keras.src.backend.tensorflow.trainer:"
_KJ = "keras.src.backend.jax.trainer:"
_KO = "keras.src.backend.tensorflow.optimizer:"
_KB = "keras.src.optimizers.base_optimizer:"
_CARS = "tensorflow.python.distribute.collective_all_reduce_strategy:"
_CTX = "tensorflow.python.eager.context:"
_DS = "tensorflow.python.data.ops.dataset_ops:"

FIXES: list[Fix] = [
    Fix(
        "keras_symbolic_build_from_spec",
        "Keras 3 fit/evaluate under MultiWorkerMirroredStrategy: 'Attempt to convert a "
        "value (PerReplica...)' in TensorFlowTrainer._maybe_symbolic_build",
        on_keras_backend("tensorflow"),
        keras_fixes.fix_symbolic_build,
        targets=targets(
            _KT + "TensorFlowTrainer._maybe_symbolic_build",
            _KT + "TensorFlowTrainer._symbolic_build",
            _KT + "TensorFlowTrainer._distribute_strategy (instance)",
            _KT + "TFEpochIterator._distributed_dataset (instance)",
            "tensorflow.python.distribute.values:PerReplicaSpec._component_specs",
        ),
    ),
    Fix(
        "keras_multi_worker_mean",
        "Keras 3 fit/evaluate under MultiWorkerMirroredStrategy: 'Invalid reduction "
        "dimension 0 for input with 0 dimensions' in reduce_per_replica",
        on_keras_backend("tensorflow"),
        keras_fixes.fix_multi_worker_mean,
        targets=targets(
            _KT + "reduce_per_replica",
            "keras.src.tree:flatten",
            "keras.src.tree:pack_sequence_as",
            "keras.src.backend:Variable",
            _CARS + "CollectiveAllReduceExtended._in_multi_worker_mode",
            "tensorflow.python.distribute.distribute_utils:is_distributed_variable",
        ),
    ),
    Fix(
        "keras_ema_overwrite_under_strategy",
        "Keras 3 Optimizer(use_ema=True, ema_overwrite_frequency=k) under Mirrored/Multi"
        "WorkerMirroredStrategy: 'merge_call called while defining a new graph'",
        on_keras_backend("tensorflow"),
        keras_fixes.fix_ema_overwrite,
        targets=targets(
            _KB + "BaseOptimizer._backend_apply_gradients",
            _KB + "BaseOptimizer._clip_gradients",
            _KB + "BaseOptimizer._apply_weight_decay",
            _KB + "BaseOptimizer._backend_update_step",
            _KB + "BaseOptimizer._update_model_variables_moving_average",
            _KB + "BaseOptimizer._overwrite_model_variables_with_average_value",
            _KB + "BaseOptimizer._trainable_variables (instance)",
            "keras.src.ops:cond",
        ),
    ),
    Fix(
        "keras_gradient_accumulation",
        "Keras 3 Optimizer(gradient_accumulation_steps=k) under Mirrored/MultiWorker"
        "MirroredStrategy: 'merge_call called while defining a new graph'",
        on_keras_backend("tensorflow"),
        keras_fixes.fix_gradient_accumulation,
        targets=targets(
            _KO + "TFOptimizer._backend_apply_gradients",
            _KB + "BaseOptimizer.save_own_variables",
            _KO + "TFOptimizer._distributed_tf_update_step",
            _KB + "BaseOptimizer._get_variable_index",
            _KB + "BaseOptimizer._clip_gradients",
            _KB + "BaseOptimizer._use_weight_decay",
            _KB + "BaseOptimizer._update_model_variables_moving_average",
            _KB + "BaseOptimizer._overwrite_model_variables_with_average_value",
            _KB + "BaseOptimizer._accumulated_gradients (instance)",
            _KB + "BaseOptimizer._iterations (instance)",
            _KB + "BaseOptimizer._trainable_variables (instance)",
            "keras.src.backend:Variable",
        ),
    ),
    Fix(
        "keras_progbar_chief_only",
        "Keras 3 prints progress bars on every worker of a multi-worker job",
        on_keras_backend("tensorflow"),
        keras_fixes.fix_progbar_chief_only,
        targets=targets(
            "keras.src.callbacks.progbar_logger:ProgbarLogger.set_params",
            _CARS + "CollectiveAllReduceExtended._in_multi_worker_mode",
        ),
    ),
    Fix(
        "tf_multi_worker_timeouts",
        "MultiWorkerMirroredStrategy waits forever for a worker that never starts",
        on_tensorflow_backend(),
        tf_fixes.fix_multi_worker_timeouts,
        "tensorflow",
        targets=targets(
            _CARS + "CollectiveAllReduceExtended._initialize_multi_worker",
            _CARS + "CollectiveAllReduceExtended._communication_options (instance)",
            _CARS + "CollectiveAllReduceExtended._std_server_started (instance)",
            _CTX + "Context.configure_coordination_service",
            _CTX + "Context.coordination_service",
            _CTX + "Context._collective_ops_server_def (instance)",
            _CTX + "Context._context_handle (instance)",
            "tensorflow.python.distribute.collective_util:Options",
            "tensorflow.python.distribute.multi_worker_util:normalize_cluster_spec",
            "tensorflow.python.distribute.multi_worker_util:coordination_leader",
            "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2:CoordinatedJob",
        ),
    ),
    Fix(
        "tf_multi_worker_logical_cpus",
        "MultiWorkerMirroredStrategy uses one CPU device per worker, ignoring logical CPUs",
        on_tensorflow_backend(),
        tf_fixes.fix_multi_worker_logical_cpus,
        "tensorflow",
        targets=targets(
            _CARS + "CollectiveAllReduceExtended._initialize_local_devices",
        ),
    ),
    Fix(
        "tf_multi_worker_auto_shard",
        "MultiWorkerMirroredStrategy: a dataset with fewer files than workers (tfds MNIST, "
        "one TFRecord) fails: 'Could not apply FILE based sharding: the dataset only has "
        "1 file(s)'",
        on_tensorflow_backend(),
        tf_fixes.fix_multi_worker_auto_shard,
        "tensorflow",
        targets=targets(
            _CARS + "CollectiveAllReduceExtended._experimental_distribute_dataset",
            _CARS + "CollectiveAllReduceExtended._num_workers (instance)",
            _DS + "DatasetV2._as_serialized_graph",
            _DS + "DatasetV2._inputs",
        ),
    ),
    Fix(
        "keras_jax_initialize_once",
        "Keras 3 on JAX: keras.distribution.initialize() after jax was initialised (by "
        "tfdist, with timeouts) fails: 'distributed.initialize should only be called once'",
        on_keras_backend("jax"),
        jax_fixes.fix_initialize_once,
        targets=targets(
            "keras.src.backend.jax.distribution_lib:initialize",
            "keras.src.backend.jax.distribution_lib:initialize_rng",
        ),
    ),
    Fix(
        "keras_jax_model_keeps_distribution",
        "Keras 3 on JAX: fit after `with distribution.scope():` is no longer data "
        "parallel (the model does not remember its distribution, as it does on TensorFlow)",
        on_keras_backend("jax"),
        jax_fixes.fix_model_keeps_distribution,
        targets=targets(
            "keras.src.trainers.trainer:Trainer.__init__",
            _KJ + "JAXTrainer.fit",
            _KJ + "JAXTrainer.evaluate",
            _KJ + "JAXTrainer.predict",
            _KJ + "JAXTrainer.train_on_batch",
            _KJ + "JAXTrainer.test_on_batch",
            _KJ + "JAXTrainer.predict_on_batch",
        ),
    ),
    Fix(
        "keras_jax_distributed_lookahead",
        "Keras 3 on JAX: under a keras.distribution each batch is copied to the devices "
        "just before its step (no look-ahead): up to 1.76x slower per step on one H100",
        on_keras_backend("jax"),
        jax_fixes.fix_distributed_lookahead,
        targets=targets(
            _KJ + "JAXEpochIterator._get_distributed_iterator",
        ),
    ),
    Fix(
        "keras_jax_sharded_epoch_length",
        "Keras 3 on JAX, multi-process: sharding a dataset per process loses its declared "
        "length, so after a mid-epoch resume every later epoch is cut short",
        on_keras_backend("jax"),
        jax_fixes.fix_sharded_epoch_length,
        targets=targets(
            "keras.src.distribution.distribution_lib:Distribution.distribute_tf_dataset",
            _DS + "DatasetV2._variant_tensor",
        ),
    ),
]


# Fixes that live with their own module (each exports FIXES).
FIXES += clipping.FIXES + chief_writes.FIXES + jax_inputs.FIXES + on_batch.FIXES + loss_scale.FIXES
FIXES += jax_watchdog.FIXES + partial_batches.FIXES + tf_inputs.FIXES + jit_compile.FIXES
FIXES += steps_per_execution.FIXES
FIXES.append(
    Fix(
        batchnorm.FIX_NAME,
        batchnorm.SUMMARY,
        on_keras_backend("tensorflow"),
        batchnorm.install,
        targets=targets(*batchnorm.TARGETS),
    )
)


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
            done = fix.name in st.applied_fixes or fix.name in st.skipped_fixes
            if done or fix.name in skip or (package is not None and fix.package != package):
                continue
            if not _needed(fix):
                continue
            reason = _apply_guarded(fix)
            if reason is None:
                st.applied_fixes.append(fix.name)
                logger.debug("tfdist.compat: applied %s", fix.name)
            else:
                st.skipped_fixes[fix.name] = reason
                _warn_skipped(fix, reason)
        return list(st.applied_fixes)


def _needed(fix: Fix) -> bool:
    try:
        return bool(fix.applies())
    except Exception as err:  # noqa: BLE001 - a guard must never break the import it runs in
        logger.debug("tfdist.compat: %s: could not tell whether it applies (%s)", fix.name, err)
        return False


def _apply_guarded(fix: Fix) -> str | None:
    """Applies ``fix`` unless a target is missing or changed; returns why not, or None.

    A fix that fails half-way is rolled back (``registry.journal``): upstream stays whole.
    """
    reason = registry.guard(fix)
    if reason is not None:
        return reason
    try:
        with registry.journal():
            fix.apply()
    except Exception as err:  # noqa: BLE001 - see above
        return f"applying it failed ({type(err).__name__}: {err})"
    return None


def _warn_skipped(fix: Fix, reason: str) -> None:
    verified = ", ".join(f"{p} {lo}-{hi}" for p, (lo, hi) in versions.VERIFIED.items())
    warnings.warn(
        f"tfdist: fix {fix.name} is skipped: {reason}. Without it: {fix.summary}. The fix "
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
    (another backend), excluded, or pending (its package not imported yet).

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
        elif not _needed(fix):
            state, why = "not needed", "another backend"
        else:
            state, why = "pending", f"applied when {fix.package} is imported"
        rows.append({"name": fix.name, "package": fix.package, "state": state, "why": why})
    return rows


def applied() -> list[str]:
    """Names of the fixes applied in this process so far.

    Example:
        >>> applied()  # doctest: +SKIP
        []
    """
    return list(process.state().applied_fixes)
