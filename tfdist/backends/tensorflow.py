"""The TensorFlow backend: ``tf.distribute`` strategies, planned from arguments and environment.

``auto`` means MultiWorkerMirroredStrategy when a cluster of more than one training task
is configured (TF_CONFIG or a SLURM step), MirroredStrategy when more than one GPU (or
logical CPU) exists, and the default strategy otherwise. The strategy is created once per
process and kept in ``tfdist.core.process``.

Example:
    >>> from tfdist.backends import tensorflow as tf_backend
    >>> tf_backend.plan("auto").kind  # doctest: +SKIP
    'default'
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping, Sequence

import tensorflow as tf

from tfdist.backends import StoreGone
from tfdist.backends.tf_plan import (
    KINDS,
    StrategyPlan,
    configure_cpu_devices,
    plan,
    slurm_cluster_resolver,
)
from tfdist.core import config, exit_hold, fix_registry, process, roles, upstream, validate
from tfdist.core.config import Communication, ConfigError, MultiWorkerTimeouts

__all__ = [
    "NAME",
    "KINDS",
    "StrategyPlan",
    "configure_cpu_devices",
    "plan",
    "strategy",
    "scope",
    "current",
    "num_replicas",
    "num_workers",
    "worker_index",
    "is_chief",
    "barrier",
    "topology",
    "chief_value",
    "gather_rows",
    "key_value_set",
    "key_value_get",
    "phantom_prone_variables",
    "splits_uneven_batches",
    "current_plan",
    "slurm_cluster_resolver",
]

logger = logging.getLogger(__name__)

NAME = "tensorflow"


def _mirrored_cross_device_ops(p: StrategyPlan):
    """MirroredStrategy's ``cross_device_ops`` for the plan; None keeps TensorFlow's choice.

    TensorFlow's own choice is its collective all-reduce: ring on CPUs, NCCL on GPUs.
    """
    comm = p.communication
    if comm.bytes_per_pack:
        logger.warning(
            "tfdist: bytes_per_pack=%d applies to MultiWorkerMirroredStrategy only; "
            "MirroredStrategy packs its gradients itself.",
            comm.bytes_per_pack,
        )
    on_cpu = all("CPU" in d.upper() for d in p.devices)
    impl = comm.implementation
    if impl == "auto" or (impl == "ring" and on_cpu):
        return None
    if impl == "nccl" and not on_cpu:
        return tf.distribute.NcclAllReduce()
    if impl == "hierarchical_copy" and not on_cpu:
        return tf.distribute.HierarchicalCopyAllReduce()
    if impl == "reduce_to_one":
        return tf.distribute.ReductionToOneDevice()
    raise ConfigError(
        f"strategy: MirroredStrategy on {list(p.devices)} cannot all-reduce with "
        f"implementation={impl!r} (nccl and hierarchical_copy need GPUs; TensorFlow has no "
        f"public ring for GPUs in one process). Received: {config.ALLREDUCE_ENV}="
        f"{impl!r}. Use 'auto'."
    )


def _build(p: StrategyPlan) -> tf.distribute.Strategy:
    if p.kind == "mirrored":
        return tf.distribute.MirroredStrategy(
            devices=list(p.devices), cross_device_ops=_mirrored_cross_device_ops(p)
        )
    if p.kind == "one_device":
        return tf.distribute.OneDeviceStrategy(p.devices[0])
    if p.kind == "multi_worker":
        return _build_multi_worker(p)
    return tf.distribute.get_strategy()


_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


def _build_multi_worker(p: StrategyPlan) -> tf.distribute.Strategy:
    if p.cluster_source == "SLURM":
        resolver = slurm_cluster_resolver()
    else:
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    assert p.timeouts is not None  # a multi_worker plan has them (tf_plan._multi_worker_plan)
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=p.communication.bytes_per_pack,
        timeout_seconds=p.timeouts.collective,
        implementation=_IMPLEMENTATIONS[p.communication.implementation],
    )
    # The coordination-service timeouts are applied by compat's tf_multi_worker_timeouts
    # fix while the strategy initialises; it reads them from the process state.
    process.state().multi_worker_timeouts = p.timeouts
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=options
    )


def _check_same(existing: StrategyPlan, kind, devices, cpu_devices, timeouts, comm) -> None:
    # Compare only what the caller asked for explicitly: the environment was already
    # read when the strategy was created.
    conflicts = (
        (kind != "auto" and kind != existing.kind)
        or (devices is not None and tuple(devices) != existing.devices)
        or (cpu_devices is not None and cpu_devices != len(existing.devices))
        or (timeouts is not None and timeouts != existing.timeouts)
        or (comm is not None and comm != existing.communication)
    )
    if conflicts:
        raise RuntimeError(
            f"strategy: this process already has a {existing.kind!r} strategy on "
            f"{list(existing.devices)}; it cannot also have kind={kind!r}, "
            f"devices={devices!r}, cpu_devices={cpu_devices!r}, timeouts={timeouts!r}, "
            f"communication={comm!r}. "
            "Create the strategy once, before building models (call tfdist.strategy(...) "
            "first), or use a new process."
        )


def strategy(
    kind: str = "auto",
    *,
    devices: Sequence[str] | None = None,
    cpu_devices: int | None = None,
    timeouts: MultiWorkerTimeouts | None = None,
    communication: Communication | None = None,
) -> tf.distribute.Strategy:
    """The process's strategy: created on the first call, the same object afterwards.

    Args:
        kind: ``auto`` (default), ``mirrored``, ``multi_worker``, ``one_device`` or ``default``.
        devices: local devices for ``mirrored``/``one_device``; all GPUs (or logical CPUs)
            when None.
        cpu_devices: split the CPU into this many logical devices (overrides
            ``TFDIST_CPU_DEVICES``); only possible before TensorFlow initialises devices.
        timeouts: for multi-worker: how long to wait for peers (overrides the
            ``TFDIST_*_TIMEOUT`` variables; see ``tfdist.config.MultiWorkerTimeouts``).
        communication: all-reduce implementation and gradient packing (overrides
            ``TFDIST_ALLREDUCE`` / ``TFDIST_BYTES_PER_PACK``; see
            ``tfdist.config.Communication``).

    Raises:
        RuntimeError: a strategy of another kind or on other devices already exists.

    Example:
        >>> s = strategy()            # doctest: +SKIP
        >>> s is strategy()           # doctest: +SKIP
        True
    """
    st = process.state()
    with st.lock:
        if st.distribution is not None:
            _check_same(st.distribution[0], kind, devices, cpu_devices, timeouts, communication)
            return st.distribution[1]
        wanted = plan(
            kind,
            devices=devices,
            cpu_devices=cpu_devices,
            timeouts=timeouts,
            communication=communication,
        )
        fix_registry.apply_registered()  # tfdist.compat.apply_all
        obj = _build(wanted)
        st.distribution = (wanted, obj)
    logger.info(
        "tfdist: %s strategy with %d replica(s) on %s",
        wanted.kind,
        obj.num_replicas_in_sync,
        list(wanted.devices),
    )
    return obj


def current_plan() -> StrategyPlan | None:
    """The plan of the strategy ``strategy()`` created, or None before the first call."""
    created = process.state().distribution
    return created[0] if created else None


def current(explicit: tf.distribute.Strategy | None = None) -> tf.distribute.Strategy:
    """An explicit strategy, else the one whose scope is open, else tfdist's own."""
    if explicit is not None:
        return validate.instance(
            explicit,
            tf.distribute.Strategy,
            "strategy",
            "tfdist",
            "a tf.distribute.Strategy or None",
        )
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    return strategy()


def _warn_keras_distribution() -> None:
    """keras.distribution is a stub on TensorFlow: say so instead of ignoring it silently."""
    import keras

    active = keras.distribution.distribution()
    if active is not None:
        warnings.warn(
            f"tfdist: keras.distribution.set_distribution({type(active).__name__}) has no "
            "effect on the TensorFlow backend (Keras implements it for JAX only); tfdist "
            "distributes with a tf.distribute strategy instead. Remove the call, or run "
            "with KERAS_BACKEND=jax.",
            UserWarning,
            stacklevel=3,
        )


def scope(**kwargs):
    """``with scope():`` opens the scope of ``strategy(**kwargs)``."""
    _warn_keras_distribution()
    return strategy(**kwargs).scope()


def num_replicas(explicit: tf.distribute.Strategy | None = None) -> int:
    """Replicas in sync under ``explicit`` (or the current strategy)."""
    return current(explicit).num_replicas_in_sync


def num_workers(explicit: tf.distribute.Strategy | None = None) -> int:
    """Training processes the strategy spans (1 unless it is multi-worker)."""
    s = current(explicit)
    if not isinstance(s, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    local = max(len(s.extended.worker_devices), 1)
    return max(s.num_replicas_in_sync // local, 1)


def worker_index(explicit: tf.distribute.Strategy | None = None) -> int:
    """This process's index among the training tasks, chief first (0 without a cluster)."""
    resolver = getattr(current(explicit), "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return 0
    spec = resolver.cluster_spec().as_dict()
    if resolver.task_type == "worker" and "chief" in spec:
        return len(spec["chief"]) + int(resolver.task_id)
    return int(resolver.task_id or 0)


def barrier(name: str, timeout: float) -> None:
    """Waits until every worker reaches barrier ``name``; nothing to wait for on one worker."""
    if not upstream.tf_in_multi_worker_mode(current()):
        return
    exit_hold.arm_tensorflow()
    try:
        upstream.tf_wait_at_barrier(f"tfdist/{name}", int(timeout * 1000))
    except tf.errors.OpError as err:
        raise RuntimeError(_barrier_error(name, timeout, err)) from None


def _barrier_error(name: str, timeout: float, err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"tfdist.barrier({name!r}): not every worker arrived within {timeout:.0f} s ({first}). "
        "Every worker must make the same tfdist calls (barrier, save, load in a scope, fit, "
        "evaluate, predict) in the same order; a call made on the chief only waits here."
    )


def is_chief() -> bool:
    """Whether this process is the chief (always True on one machine)."""
    return roles.is_chief()


def topology(environ: Mapping[str, str] | None = None) -> dict:
    """Devices and the strategy ``auto`` picks (planned, never created: no server starts)."""
    env = os.environ if environ is None else environ
    p = current_plan() or plan("auto", environ=env)
    st = process.state()
    auto, st.auto_strategy = st.auto_strategy, False  # listing devices starts TensorFlow
    try:
        gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    finally:
        st.auto_strategy = auto
    return {
        "devices": {
            "gpus": gpus,
            "cpus": cpus,
            config.CPU_DEVICES_ENV: env.get(config.CPU_DEVICES_ENV) or None,
        },
        "strategy": {
            "kind": p.kind,
            "num_replicas": p.num_replicas,
            "devices": list(p.devices),
            "num_workers": p.num_workers,
        },
    }


def chief_value(name: str, value: int, timeout: float, explicit=None) -> int:
    """The chief's ``value`` on every worker: an all-reduce to which only replica 0 adds.

    Every worker must join it, in the same order; the wait is bounded by ``timeout``.

    Example:
        >>> chief_value("shuffle seed", 1804289383, timeout=60)  # doctest: +SKIP
        1804289383
    """
    s = current(explicit)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)

    def from_chief():
        ctx = tf.distribute.get_replica_context()
        mine = tf.where(
            tf.equal(ctx.replica_id_in_sync_group, 0),
            tf.constant(value, tf.int64),
            tf.constant(0, tf.int64),
        )
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, mine, options=options)

    try:
        shared = s.run(from_chief)
        return int(s.experimental_local_results(shared)[0])
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as err:
        raise TimeoutError(
            f"the workers did not agree on a {name} within {timeout:.0f} s."
        ) from err


def gather_rows(row, explicit=None):
    """Every worker's ``row`` (small ints), one per replica, on every worker; None on one.

    Example:
        >>> gather_rows((2, 50, 0))  # two workers, one replica each  # doctest: +SKIP
        array([[2, 50, 0], [2, 50, 0]])
    """
    s = current(explicit)
    if not upstream.tf_in_multi_worker_mode(s):
        return None
    value = tf.constant([list(row)], tf.int64)
    # Every replica contributes its worker's row; gather them all on every worker.
    return s.gather(s.run(lambda: tf.identity(value)), axis=0).numpy()


def key_value_set(key: str, value: str) -> bool:
    """Publishes ``key=value`` in the coordination service's store; False when another
    worker set ``key`` first. Raises StoreGone when the service is gone."""
    exit_hold.arm_tensorflow()
    try:
        upstream.tf_key_value_set(key, value)
    except tf.errors.AlreadyExistsError:
        return False
    except tf.errors.OpError as err:
        raise StoreGone(str(err)) from err
    return True


def key_value_get(key: str, timeout: float) -> str | None:
    """The value of ``key`` in the coordination service's store, or None when it is not set
    within ``timeout`` seconds. Raises StoreGone when the service is gone."""
    exit_hold.arm_tensorflow()
    try:
        return upstream.tf_key_value_get(key, round(timeout * 1000))
    except tf.errors.DeadlineExceededError:
        return None
    except tf.errors.OpError as err:
        raise StoreGone(str(err)) from err


def phantom_prone_variables(model) -> list:
    """The step counter and the seed generators' states: when a dataset ends before Keras
    expected, its train step runs once more and may still advance them (a race; see
    ``tfdist.checkpoint.rng``)."""
    generators = {id(g): g for g in upstream.keras_seed_generators(model)}  # shared: once
    return [model.optimizer.iterations] + [g.state for g in generators.values()]


def saves_sharded() -> bool:
    """False: Orbax writes ``jax.Array``s; TensorFlow models keep ``.keras`` archives."""
    return False


def splits_uneven_batches() -> bool:
    """True: ``tf.distribute`` feeds a partial last batch, however it splits."""
    return True
