"""Fixes for Keras/TensorFlow defects that break distributed training, applied once.

Each fix is a small ``Fix`` record: the package versions it applies to, a function that
applies it (idempotently), and a docstring on that function saying what it changes and
why the result is correct. ``apply_all()`` runs every fix whose versions match;
``tfdist.strategy()`` calls it before creating a strategy, and ``tfdist launch`` runs
every worker through ``python -m tfdist.compat`` so that scripts which never import
tfdist (``tf.distribute.MultiWorkerMirroredStrategy()`` built by hand) get them too.

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
========================================  =============================================

Switch fixes off with ``apply_all(exclude=[...])`` or
``TFDIST_COMPAT_EXCLUDE=name1,name2`` (for a worker started by ``tfdist launch``).

Example:
    >>> from tfdist import compat
    >>> compat.apply_all()  # doctest: +SKIP
    ['keras_symbolic_build_from_spec', 'keras_multi_worker_mean', ...]

    $ python -m tfdist.compat train.py --epochs 3     # the fixes, then train.py as __main__
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Fix",
    "FIXES",
    "EXCLUDE_ENV",
    "apply_all",
    "applied",
    "fix_names",
    "multi_worker_timeouts",
    "main",
]

logger = logging.getLogger(__name__)

EXCLUDE_ENV = "TFDIST_COMPAT_EXCLUDE"
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
    """

    name: str
    summary: str
    applies: Callable[[], bool]
    apply: Callable[[], None]


# --------------------------------------------------------------------------- versions


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


def _keras_tf_backend(low: tuple[int, ...], high: tuple[int, ...]) -> Callable[[], bool]:
    """Applies to Keras versions in ``[low, high)`` running on the TensorFlow backend.

    The upper bound is the next major version: the patched internals are checked by
    the tests, which fail (on purpose) once upstream fixes a defect.
    """

    def applies() -> bool:
        import keras

        return keras.backend.backend() == "tensorflow" and low <= _keras_version() < high

    return applies


def _tf(low: tuple[int, ...], high: tuple[int, ...]) -> Callable[[], bool]:
    def applies() -> bool:
        return low <= _tf_version() < high

    return applies


def _patch(owner, attr: str, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replaces ``owner.attr`` by ``make(original)`` unless fix ``name`` already did."""
    original = getattr(owner, attr)
    if getattr(original, _MARK, None) == name:
        return
    patched = make(original)
    setattr(patched, _MARK, name)
    patched.__wrapped__ = original
    setattr(owner, attr, patched)


def _multi_worker(strategy) -> bool:
    """True for a MultiWorkerMirroredStrategy that spans more than one worker."""
    import tensorflow as tf

    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


# ------------------------------------------------- fix: symbolic build from the spec


def _symbolic_batch(iterator):
    """KerasTensors shaped like one replica's batch, from the dataset's element_spec.

    Returns None when a spec has an unknown rank (a ``py_function`` without
    ``set_shape``): then only a real batch tells the shapes.
    """
    import keras
    import tensorflow as tf
    from tensorflow.python.distribute.values import PerReplicaSpec

    dataset = getattr(iterator, "_distributed_dataset", None)
    if dataset is None:
        return None

    class _UnknownRank(Exception):
        pass

    def to_symbolic(spec):
        if isinstance(spec, PerReplicaSpec):  # one spec per local replica, all alike
            spec = spec._component_specs[0]
        if isinstance(spec, tf.OptionalSpec) or type(spec).__name__ == "NoneTensorSpec":
            return None  # the trainer turns optionals and Nones into None too
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None:
            raise _UnknownRank
        return keras.KerasTensor(
            tuple(shape.as_list()), dtype=keras.backend.standardize_dtype(spec.dtype)
        )

    try:
        return tf.nest.map_structure(to_symbolic, dataset.element_spec)
    except _UnknownRank:
        return None


def _local_batch(strategy, iterator):
    """One real batch as this worker's first replica sees it: no cross-worker reduce."""
    import tensorflow as tf

    for _, _, it in iterator:
        batch = next(it)
        break
    else:  # pragma: no cover - an empty dataset fails later, in the trainer, with its message
        return None

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return tf.nest.map_structure(local, batch)


def _fix_symbolic_build() -> None:
    """Builds the model for ``fit``/``evaluate`` from the dataset's spec, not a real batch.

    Upstream ``TensorFlowTrainer._maybe_symbolic_build`` pulls one batch from the
    distributed iterator and averages it across replicas with
    ``strategy.reduce("MEAN", batch, axis=None)``, only to read its shapes and dtypes.
    Under MultiWorkerMirroredStrategy that reduce is a cross-worker collective on a
    nested batch and fails ("Attempt to convert a value (PerReplica...)"). It also
    costs every ``fit``/``evaluate`` one extra pass over a batch, which a pipeline that
    counts its iterations sees.

    The fix passes KerasTensors made from the distributed dataset's ``element_spec``
    (the spec of one replica's batch) to the same ``_symbolic_build``. That is exactly
    the information the averaged batch carried (shape and dtype; the batch dimension
    may be None, as for any ``keras.Input``), so the model, metrics and loss are built
    identically, and no data is read. When a spec has an unknown rank, it falls back
    to one real batch and takes this worker's first replica's part of it (shapes are
    equal on all replicas), which needs no cross-worker reduce either.
    """
    from keras.src.backend.tensorflow import trainer as tf_trainer

    def make(original):
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            if self._distribute_strategy is None or iterator is None or data_batch is not None:
                return original(self, iterator=iterator, data_batch=data_batch)
            batch = _symbolic_batch(iterator)
            if batch is None:
                batch = _local_batch(self.distribute_strategy, iterator)
            with self.distribute_strategy.scope():
                self._symbolic_build(data_batch=batch)

        return _maybe_symbolic_build

    _patch(
        tf_trainer.TensorFlowTrainer,
        "_maybe_symbolic_build",
        "keras_symbolic_build_from_spec",
        make,
    )


# ------------------------------------------------- fix: multi-worker metric reduction


def _fix_multi_worker_mean() -> None:
    """Averages per-replica step results across workers with ``axis=None``.

    ``train_function``/``test_function`` return each replica's metric results and
    upstream ``reduce_per_replica(..., reduction="auto")`` averages them. On one
    worker it stacks the local results and takes ``tf.reduce_mean(..., axis=0)``: the
    mean across replicas. Under multi-worker it instead calls
    ``strategy.reduce("MEAN", v, axis=0)``, which also reduces along the value's own
    first axis; metric results are scalars, so it fails ("Invalid reduction dimension
    0 for input with 0 dimensions"), and for a non-scalar it would average the wrong
    axis. ``axis=None`` is the cross-worker form of the single-worker branch: the
    mean across all replicas of all workers. Other reductions (``sum``, ``concat`` for
    ``predict``, ``first``) are left to upstream.
    """
    import tensorflow as tf
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer as tf_trainer

    def make(original):
        def reduce_per_replica(values, strategy, reduction):
            tpu = isinstance(strategy, tf.distribute.TPUStrategy)
            if reduction in ("auto", "mean") and not tpu and _multi_worker(strategy):
                return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
            return original(values, strategy, reduction)

        return reduce_per_replica

    _patch(tf_trainer, "reduce_per_replica", "keras_multi_worker_mean", make)


# ------------------------------------------------- fix: gradient accumulation


def _fix_gradient_accumulation() -> None:
    """Makes ``gradient_accumulation_steps`` work under Mirrored/MultiWorkerMirrored.

    Upstream ``BaseOptimizer._backend_apply_gradients`` wraps "update" and
    "accumulate" in ``ops.cond`` in replica context, and both branches reach
    ``merge_call`` (the TF optimizer's all-reduce and variable updates). A
    ``merge_call`` inside a ``tf.cond`` branch is not allowed ("merge_call called while
    defining a new graph"), so any strategy with more than one replica fails.

    The fix keeps the same arithmetic but moves the synchronisation out of the cond:

    1. in replica context, all-reduce (SUM) this step's gradients once. The loss is
       already scaled by 1/replicas, so this is the gradient of the global batch, the
       same value the non-accumulating path all-reduces;
    2. still in replica context, form the update candidate ``(g + acc) / k`` and clip
       it (``clipnorm``/``global_clipnorm`` see the global gradient, as on one device);
    3. one ``merge_call``; in cross-replica context, ``tf.cond(is_update_step, ...)``
       either applies weight decay, the optimizer update (``update_step`` on every
       variable, via ``extended.update``) and zeroes the accumulators, or adds the
       all-reduced gradient to the accumulators.

    Every replica holds identical accumulators (they only ever receive all-reduced
    values), so the result equals accumulation on one device with the same global
    batch. Without a strategy, or in cross-replica context, upstream's code runs.
    """
    import tensorflow as tf
    from keras.src import backend, ops
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    def tf_var(v):
        return v.value if isinstance(v, backend.Variable) else v

    def cross_replica_update(self, distribution, clipped, variables, accumulators):
        if self.weight_decay is not None:

            def weight_decay_fn(variable):
                if self._use_weight_decay(variable):
                    lr = tf.cast(self.learning_rate, variable.dtype)
                    wd = tf.cast(self.weight_decay, variable.dtype)
                    variable.assign_sub(variable * wd * lr)

            for variable in variables:
                distribution.extended.update(tf_var(variable), weight_decay_fn, group=False)
        self._distributed_tf_update_step(
            distribution,
            list(zip(clipped, [tf_var(v) for v in variables], strict=True)),
            self.learning_rate,
        )
        for acc in accumulators:
            distribution.extended.update(
                tf_var(acc), lambda a: a.assign(tf.zeros_like(a)), group=False
            )

    def cross_replica_accumulate(distribution, summed, accumulators):
        for grad, acc in zip(summed, accumulators, strict=True):
            distribution.extended.update(
                tf_var(acc),
                lambda a, g: a.assign_add(tf.convert_to_tensor(g)),  # IndexedSlices too
                args=(grad,),
                group=False,
            )

    def make(upstream):
        def _backend_apply_gradients(self, grads, trainable_variables):
            steps = self.gradient_accumulation_steps
            if (
                not steps
                or not tf.distribute.has_strategy()
                or tf.distribute.in_cross_replica_context()
            ):
                return upstream(self, grads, trainable_variables)
            context = tf.distribute.get_replica_context()
            accumulators = [
                self._accumulated_gradients[self._get_variable_index(v)]
                for v in trainable_variables
            ]
            summed = context.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))
            candidate = [(g + acc) / steps for g, acc in zip(summed, accumulators, strict=True)]
            clipped = self._clip_gradients(candidate)

            def merge_fn(distribution, summed, clipped):
                is_update_step = (self._iterations + 1) % steps == 0
                tf.cond(
                    is_update_step,
                    lambda: cross_replica_update(
                        self, distribution, clipped, trainable_variables, accumulators
                    ),
                    lambda: cross_replica_accumulate(distribution, summed, accumulators),
                )

            context.merge_call(merge_fn, args=(summed, clipped))

            # Unchanged from upstream: the moving average of the weights, if asked for.
            if self.use_ema:
                self._update_model_variables_moving_average(self._trainable_variables)
                if self.ema_overwrite_frequency:
                    should_overwrite = (self.iterations + 1) % self.ema_overwrite_frequency == 0
                    ops.cond(
                        should_overwrite,
                        lambda: self._overwrite_model_variables_with_average_value(
                            self._trainable_variables
                        ),
                        lambda: None,
                    )

        return _backend_apply_gradients

    # Set on the TensorFlow optimizer class (the original is found through its bases), so
    # it shadows BaseOptimizer's method for every Keras optimizer on this backend only.
    _patch(
        tf_optimizer.TFOptimizer, "_backend_apply_gradients", "keras_gradient_accumulation", make
    )


# ------------------------------------------------- fix: progress bars on the chief only


def _fix_progbar_chief_only() -> None:
    """Silences Keras' progress bar on the non-chief workers of a multi-worker job.

    Every worker of a MultiWorkerMirroredStrategy job runs the same ``fit`` and computes
    the same global metrics (the epoch logs come from all-reduced metric variables), so
    N workers print N copies of every progress bar and epoch summary. Keras 3 has no
    chief logic. The fix sets ``verbose=0`` on ``keras.callbacks.ProgbarLogger`` when
    the model's strategy spans several workers and this worker is not the one that
    writes summaries (``strategy.extended.should_save_summary``, True on the chief
    only). Nothing else changes: callbacks, History and the returned logs are the same
    on every worker.
    """
    from keras.src.callbacks import progbar_logger

    def make(original):
        def set_params(self, params):
            original(self, params)
            strategy = getattr(getattr(self, "model", None), "distribute_strategy", None)
            if strategy is not None and _multi_worker(strategy):
                if not strategy.extended.should_save_summary:
                    self.verbose = 0

        return set_params

    _patch(progbar_logger.ProgbarLogger, "set_params", "keras_progbar_chief_only", make)


# ------------------------------------------------- fix: multi-worker timeouts

_timeouts_override: contextvars.ContextVar = contextvars.ContextVar(
    "tfdist_multi_worker_timeouts", default=None
)


@contextlib.contextmanager
def multi_worker_timeouts(timeouts) -> Iterator[None]:
    """Uses ``timeouts`` for the MultiWorkerMirroredStrategy created inside the block.

    ``tfdist.strategy()`` uses it to pass explicit timeouts; without it the fix reads
    them from the environment (``MultiWorkerTimeouts.from_env()``).

    Args:
        timeouts: a ``tfdist.strategy.MultiWorkerTimeouts``.

    Example:
        >>> from tfdist.strategy import MultiWorkerTimeouts
        >>> with multi_worker_timeouts(MultiWorkerTimeouts(heartbeat=20)):  # doctest: +SKIP
        ...     strategy = tf.distribute.MultiWorkerMirroredStrategy()
    """
    from tfdist.strategy import MultiWorkerTimeouts

    if not isinstance(timeouts, MultiWorkerTimeouts):
        raise TypeError(
            "multi_worker_timeouts: timeouts must be a tfdist.strategy.MultiWorkerTimeouts. "
            f"Received: timeouts={timeouts!r}"
        )
    token = _timeouts_override.set(timeouts)
    try:
        yield
    finally:
        _timeouts_override.reset(token)


def _configure_coordination(cluster_resolver, timeouts) -> bool:
    """Configures TensorFlow's coordination service with timeouts; False if already set."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    ctx = context.context()
    if ctx.coordination_service is not None:
        return False  # configured by the user (or an earlier strategy): leave it alone
    spec = multi_worker_util.normalize_cluster_spec(cluster_resolver.cluster_spec())
    if cluster_resolver.task_type not in ("chief", "worker"):
        return False  # evaluators do not join the coordination service upstream either
    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
        for job in ("chief", "worker")
        if job in spec.jobs
    ]
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=int(timeouts.register * 1000),
        heartbeat_timeout_in_ms=int(timeouts.heartbeat * 1000),
        shutdown_barrier_timeout_in_ms=int(timeouts.shutdown * 1000),
    )
    # Registration waits at a barrier, so the register timeout also bounds the wait for
    # a peer that never starts (without it, task 0 waits forever).
    ctx.coordination_service.cluster_register_with_barrier = True
    return True


def _fix_multi_worker_timeouts() -> None:
    """Bounds every wait of a multi-worker job: start-up, dead peers, shutdown.

    Upstream MultiWorkerMirroredStrategy configures TensorFlow's coordination service
    with no register timeout: a worker whose peer never starts waits forever inside
    ``context.ensure_initialized()`` (verified: more than 10 minutes, and SIGTERM does
    not end it because TensorFlow turns SIGTERM into a preemption notice).

    The fix configures the coordination service first, with the same leader and jobs
    upstream would use plus explicit timeouts (``MultiWorkerTimeouts``): all workers
    must register within ``register`` seconds (a barrier, so task 0 gives up too); a
    worker that stops heart-beating for ``heartbeat`` seconds is declared dead and
    every collective on the others is aborted with ``UnavailableError`` naming it;
    shutdown waits at most ``shutdown`` seconds for the others. If a
    ``collective`` timeout is set, it is merged into the strategy's communication
    options (off by default: TensorFlow spends one thread per in-flight collective on
    it). Upstream skips its own configuration when one exists, so nothing else changes.
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars
    from tensorflow.python.distribute import collective_util

    def make(original):
        def _initialize_multi_worker(self, cluster_resolver):
            from tfdist.strategy import MultiWorkerTimeouts

            timeouts = _timeouts_override.get() or MultiWorkerTimeouts.from_env()
            if _configure_coordination(cluster_resolver, timeouts):
                logger.debug("tfdist.compat: coordination service timeouts %s", timeouts)
            if timeouts.collective and self._communication_options.timeout_seconds is None:
                self._communication_options = self._communication_options.merge(
                    collective_util.Options(timeout_seconds=timeouts.collective)
                )
            return original(self, cluster_resolver)

        return _initialize_multi_worker

    _patch(
        cars.CollectiveAllReduceExtended,
        "_initialize_multi_worker",
        "tf_multi_worker_timeouts",
        make,
    )


# ------------------------------------------------- fix: logical CPUs per worker


def _fix_multi_worker_logical_cpus() -> None:
    """Lets a CPU-only multi-worker job use K logical CPU devices per worker.

    Upstream ``CollectiveAllReduceExtended._initialize_local_devices`` gives each worker
    its GPUs, or exactly one CPU device when it has none, ignoring logical CPU devices.
    With ``TFDIST_CPU_DEVICES=K`` (set by ``tfdist launch --devices-per-worker K`` on a
    machine without GPUs) and K logical CPUs configured, the fix returns those K
    devices, so the job has K replicas per worker, as ``MirroredStrategy`` would on one
    machine. The collective all-reduce already handles several CPU devices per worker;
    only the device list changes. With GPUs, or without the variable, upstream's
    answer stands.
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    def make(original):
        def _initialize_local_devices(self, cluster_resolver, worker_device):
            devices, device_type = original(self, cluster_resolver, worker_device)
            wanted = _cpu_devices_wanted()
            if device_type == "CPU" and wanted > 1:
                import tensorflow as tf

                have = len(tf.config.list_logical_devices("CPU"))
                if have < wanted:
                    raise RuntimeError(
                        f"TFDIST_CPU_DEVICES={wanted} but TensorFlow has {have} logical CPU "
                        "device(s). Configure them before creating the strategy: call "
                        f"tfdist.configure_cpu_devices({wanted}), or run the script under "
                        "`tfdist launch` (or `python -m tfdist.compat`), which does it."
                    )
                devices = tuple(f"{worker_device}/device:CPU:{i}" for i in range(wanted))
            return devices, device_type

        return _initialize_local_devices

    _patch(
        cars.CollectiveAllReduceExtended,
        "_initialize_local_devices",
        "tf_multi_worker_logical_cpus",
        make,
    )


def _cpu_devices_wanted() -> int:
    from tfdist.strategy import cpu_devices_from_env

    return cpu_devices_from_env() or 1


# --------------------------------------------------------------------------- registry

FIXES: list[Fix] = [
    Fix(
        "keras_symbolic_build_from_spec",
        "Keras 3 fit/evaluate under MultiWorkerMirroredStrategy: 'Attempt to convert a "
        "value (PerReplica...)' in TensorFlowTrainer._maybe_symbolic_build",
        _keras_tf_backend((3, 0), (4, 0)),
        _fix_symbolic_build,
    ),
    Fix(
        "keras_multi_worker_mean",
        "Keras 3 fit/evaluate under MultiWorkerMirroredStrategy: 'Invalid reduction "
        "dimension 0 for input with 0 dimensions' in reduce_per_replica",
        _keras_tf_backend((3, 0), (4, 0)),
        _fix_multi_worker_mean,
    ),
    Fix(
        "keras_gradient_accumulation",
        "Keras 3 Optimizer(gradient_accumulation_steps=k) under Mirrored/MultiWorker"
        "MirroredStrategy: 'merge_call called while defining a new graph'",
        _keras_tf_backend((3, 4), (4, 0)),
        _fix_gradient_accumulation,
    ),
    Fix(
        "keras_progbar_chief_only",
        "Keras 3 prints progress bars on every worker of a multi-worker job",
        _keras_tf_backend((3, 0), (4, 0)),
        _fix_progbar_chief_only,
    ),
    Fix(
        "tf_multi_worker_timeouts",
        "MultiWorkerMirroredStrategy waits forever for a worker that never starts",
        _tf((2, 16), (3, 0)),
        _fix_multi_worker_timeouts,
    ),
    Fix(
        "tf_multi_worker_logical_cpus",
        "MultiWorkerMirroredStrategy uses one CPU device per worker, ignoring logical CPUs",
        _tf((2, 16), (3, 0)),
        _fix_multi_worker_logical_cpus,
    ),
]

_applied: list[str] = []
_lock = threading.Lock()


def fix_names() -> list[str]:
    """Names of all known fixes, in the order ``apply_all`` applies them.

    Example:
        >>> "keras_multi_worker_mean" in fix_names()
        True
    """
    return [fix.name for fix in FIXES]


def _excluded(exclude: Iterable[str] | None, environ: Mapping[str, str]) -> set[str]:
    if exclude is None:
        text = environ.get(EXCLUDE_ENV, "")
        names, where = [n.strip() for n in text.split(",") if n.strip()], EXCLUDE_ENV
        received = text
    else:
        if isinstance(exclude, str):
            raise TypeError(
                "apply_all: exclude must be a list of fix names, not a string. "
                f"Received: exclude={exclude!r}. Use exclude=[{exclude!r}]."
            )
        names, where, received = list(exclude), "exclude", exclude
    unknown = sorted(set(names) - set(fix_names()))
    if unknown:
        raise ValueError(
            f"apply_all: {where} names unknown fixes {unknown}. Received: "
            f"{where}={received!r}. Known fixes: {fix_names()}."
        )
    return set(names)


def apply_all(
    *, exclude: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """Applies every fix that matches the installed versions; returns the names applied.

    Safe to call any number of times and from several threads; each fix is applied at
    most once per process.

    Args:
        exclude: names of fixes to skip; when None, read from ``TFDIST_COMPAT_EXCLUDE``
            (comma-separated).
        environ: where to read ``TFDIST_COMPAT_EXCLUDE``; defaults to ``os.environ``.

    Raises:
        ValueError: ``exclude`` names a fix that does not exist.

    Example:
        >>> apply_all(exclude=["keras_progbar_chief_only"])  # doctest: +SKIP
        ['keras_symbolic_build_from_spec', 'keras_multi_worker_mean', ...]
    """
    skip = _excluded(exclude, os.environ if environ is None else environ)
    with _lock:
        for fix in FIXES:
            if fix.name in _applied or fix.name in skip:
                continue
            if not fix.applies():
                logger.debug("tfdist.compat: %s does not apply to these versions", fix.name)
                continue
            fix.apply()
            _applied.append(fix.name)
            logger.debug("tfdist.compat: applied %s", fix.name)
        return list(_applied)


def applied() -> list[str]:
    """Names of the fixes applied in this process so far.

    Example:
        >>> applied()  # doctest: +SKIP
        []
    """
    return list(_applied)


# --------------------------------------------------------------------------- bootstrap

_USAGE = (
    "usage: python -m tfdist.compat SCRIPT [ARGS...]\n"
    "       python -m tfdist.compat -m MODULE [ARGS...]\n"
    "Applies tfdist's fixes (and TFDIST_CPU_DEVICES), then runs SCRIPT or MODULE as __main__."
)


def main(argv: Sequence[str] | None = None) -> None:
    """Applies the fixes, then runs a script or module as ``__main__`` in this process.

    This is what every worker started by ``tfdist launch`` runs, so that scripts which
    build ``tf.distribute.MultiWorkerMirroredStrategy()`` themselves get the fixes.
    With ``TFDIST_CPU_DEVICES`` set, the CPU is split into that many logical devices
    first. The script sees the same ``sys.argv`` and ``sys.path[0]`` as under
    ``python SCRIPT ARGS``; its exit status is this process's exit status.

    Args:
        argv: ``[SCRIPT, *ARGS]`` or ``["-m", MODULE, *ARGS]``; defaults to
            ``sys.argv[1:]``.

    Example:
        $ python -m tfdist.compat train.py --epochs 3
        $ python -m tfdist.compat -m mypackage.train --epochs 3
    """
    import runpy

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        print(_USAGE, file=sys.stderr)
        raise SystemExit(0 if args and args[0] in ("-h", "--help") else 2)
    module = args[0] == "-m"
    target = args[1] if module else args[0]
    if not module and not os.path.isfile(target):
        print(f"python -m tfdist.compat: cannot open file {target!r}", file=sys.stderr)
        raise SystemExit(2)

    apply_all()
    cpus = _cpu_devices_wanted()
    if cpus > 1:
        from tfdist.strategy import configure_cpu_devices

        configure_cpu_devices(cpus)

    # sys.path[0] is the current directory under `python -m tfdist.compat`, as it is for
    # `python -m MODULE`; `python SCRIPT` puts the script's directory there instead.
    if module:
        sys.argv = [target, *args[2:]]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args[1:]]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    # Run the imported module's main, so the fixes' state lives in `tfdist.compat` (the
    # module tfdist.strategy imports), not in a second copy named __main__.
    from tfdist.compat import main as _main

    _main()
