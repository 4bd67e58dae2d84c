"""The TensorFlow backend: ``tf.distribute`` strategies, planned from arguments and environment.

``auto`` means MultiWorkerMirroredStrategy when a cluster of more than one training task
is configured (TF_CONFIG or a SLURM step), MirroredStrategy when more than one GPU (or
logical CPU) exists, and the default strategy otherwise. The strategy is created once per
process and kept in ``tfdist.process``.

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
from dataclasses import dataclass

import tensorflow as tf

from tfdist import _private, cluster, compat, config, process, validate
from tfdist.backends import StoreGone
from tfdist.config import Communication, ConfigError, MultiWorkerTimeouts

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
    "describe",
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
KINDS = ("auto", "mirrored", "multi_worker", "one_device", "default")


@dataclass(frozen=True)
class StrategyPlan:
    """What ``strategy()`` builds: resolved once from arguments, environment and devices.

    Attributes:
        kind: one of ``mirrored``, ``multi_worker``, ``one_device``, ``default``.
        devices: the local devices that hold a replica.
        num_workers: training processes in the cluster (1 without one).
        cluster_source: ``TF_CONFIG``, ``SLURM`` or ``none``.
        timeouts: for ``multi_worker`` only: how long the job waits for its peers.
        communication: how gradients are all-reduced (``tfdist.config.Communication``).
    """

    kind: str
    devices: tuple[str, ...]
    num_workers: int = 1
    cluster_source: str = "none"
    timeouts: MultiWorkerTimeouts | None = None
    communication: Communication = Communication()

    @property
    def num_replicas(self) -> int:
        """Replicas in sync: local devices times workers."""
        return max(len(self.devices), 1) * self.num_workers


def configure_cpu_devices(n: int) -> list[str]:
    """Splits the CPU into ``n`` logical devices so MirroredStrategy can run with no GPU.

    TensorFlow fixes its devices the first time it runs an op, so call this (or set
    ``TFDIST_CPU_DEVICES``) before any tensor is created. Calling it again with the same
    ``n`` is a no-op.

    Args:
        n: number of logical CPU devices (>= 1).

    Returns:
        The logical CPU device names, e.g. ``["/device:CPU:0", "/device:CPU:1"]``.

    Raises:
        RuntimeError: TensorFlow already initialised its devices with another count.

    Example:
        >>> configure_cpu_devices(2)  # doctest: +SKIP
        ['/device:CPU:0', '/device:CPU:1']
    """
    n = validate.positive_int(
        n, "n", "configure_cpu_devices", "Pass the number of logical CPUs wanted."
    )
    # Only physical-device queries and device configuration here: listing logical devices
    # would initialise TensorFlow's context, after which MultiWorkerMirroredStrategy can
    # no longer configure its collectives.
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if (current is None and n > 1) or (current is not None and len(current) != n):
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
            )
        except RuntimeError:  # already initialised: say whether the count matches
            have = len(tf.config.list_logical_devices("CPU"))
            if have != n:
                raise RuntimeError(
                    f"configure_cpu_devices: TensorFlow already initialised its devices with "
                    f"{have} logical CPU(s), so it cannot be split into {n}. Received: n={n}. "
                    f"Set {config.CPU_DEVICES_ENV}={n} (or call tfdist.strategy(cpu_devices={n})) "
                    "before anything creates a tensor, or run in a new process."
                ) from None
    process.state().devices_configured = n
    return [f"/device:CPU:{i}" for i in range(n)]


def _check_plan_args(kind, devices, timeouts, communication) -> None:
    validate.one_of(
        kind,
        KINDS,
        "kind",
        "strategy",
        "Use 'auto' to let tfdist choose from the cluster and devices.",
    )
    if devices is not None and (isinstance(devices, str) or not devices):
        raise ValueError(
            validate.message(
                "strategy",
                "devices",
                "a non-empty list of device names such as ['/gpu:0', '/gpu:1']",
                devices,
            )
        )
    if timeouts is not None:
        validate.instance(
            timeouts,
            MultiWorkerTimeouts,
            "timeouts",
            "strategy",
            "a tfdist.config.MultiWorkerTimeouts or None",
        )
    if communication is not None:
        validate.instance(
            communication,
            Communication,
            "communication",
            "strategy",
            "a tfdist.config.Communication or None",
        )


def _auto_kind(info: cluster.ClusterInfo, devices, local: tuple[str, ...]) -> str:
    if info.is_multi_worker:
        return "multi_worker"
    if devices is not None:
        return "mirrored" if len(devices) > 1 else "one_device"
    return "mirrored" if len(local) > 1 else "default"


def _multi_worker_plan(info, devices, local, timeouts, comm, env) -> StrategyPlan:
    if not info.is_multi_worker:
        raise ConfigError(
            "strategy: kind='multi_worker' needs a cluster of more than one training task. "
            f"Received: TF_CONFIG={env.get('TF_CONFIG')!r}. Start the workers with "
            "`tfdist launch -n N script.py`, or set TF_CONFIG for each process."
        )
    if info.source == "JAX_COORDINATOR":
        raise ConfigError(
            "strategy: JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES describe a JAX job (a "
            "Kubeflow TrainJob's JAX runtime): they name the coordinator only, and "
            "TensorFlow's workers need every worker's address. Received: "
            f"JAX_COORDINATOR_ADDRESS={env.get('JAX_COORDINATOR_ADDRESS')!r}. Run it with "
            "KERAS_BACKEND=jax, or as a TFJob (which sets TF_CONFIG)."
        )
    if devices is not None:
        raise ConfigError(
            "strategy: devices cannot be chosen for kind='multi_worker': every worker "
            f"uses all its GPUs (or TFDIST_CPU_DEVICES logical CPUs). Received: "
            f"devices={devices!r}. Limit the GPUs with CUDA_VISIBLE_DEVICES, or use "
            "`tfdist launch --devices-per-worker K`."
        )
    if comm.implementation not in ("auto", "ring", "nccl"):
        raise ConfigError(
            f"strategy: implementation {comm.implementation!r} is a MirroredStrategy "
            "cross_device_ops; MultiWorkerMirroredStrategy takes 'auto', 'ring' or 'nccl'. "
            f"Received: {config.ALLREDUCE_ENV}/Communication(implementation="
            f"{comm.implementation!r}). Use one of those three."
        )
    timeouts = timeouts or MultiWorkerTimeouts.from_env(env)
    return StrategyPlan(
        "multi_worker", local, info.num_workers, info.source, timeouts, communication=comm
    )


def plan(
    kind: str = "auto",
    *,
    devices: Sequence[str] | None = None,
    cpu_devices: int | None = None,
    timeouts: MultiWorkerTimeouts | None = None,
    communication: Communication | None = None,
    environ: Mapping[str, str] | None = None,
) -> StrategyPlan:
    """Resolves which strategy ``strategy()`` would build, without building it.

    Precedence: explicit arguments, then ``TF_CONFIG``/SLURM and ``TFDIST_CPU_DEVICES``,
    then the devices present. A multi-worker plan has one replica per local GPU, else
    per logical CPU, else one. Configures logical CPUs as a side effect; nothing here
    initialises TensorFlow's context (which would stop collectives from being configured).

    Example:
        >>> plan("auto").kind  # doctest: +SKIP
        'default'
    """
    _check_plan_args(kind, devices, timeouts, communication)
    env = os.environ if environ is None else environ
    comm = communication or Communication.from_env(env)
    wanted = config.cpu_devices(cpu_devices, environ=env)
    cpus = configure_cpu_devices(wanted) if wanted else None
    local = _local_devices(cpus)
    info = cluster.cluster_from_env(env)
    if kind == "auto":
        kind = _auto_kind(info, devices, local)
    if kind == "multi_worker":
        return _multi_worker_plan(info, devices, local, timeouts, comm, env)
    chosen = tuple(devices) if devices else local
    if kind == "mirrored":
        return StrategyPlan(kind, chosen, communication=comm)
    if kind == "one_device":
        return StrategyPlan(kind, chosen[:1])
    return StrategyPlan("default", (local[0],))


def _local_devices(cpus: list[str] | None) -> tuple[str, ...]:
    """Devices that each hold a replica: logical CPUs when asked for, else GPUs, else the CPU."""
    if cpus and len(cpus) > 1:
        return tuple(cpus)
    gpus = tf.config.list_physical_devices("GPU")  # physical: does not initialise TensorFlow
    return tuple(f"/device:GPU:{i}" for i in range(len(gpus))) if gpus else ("/device:CPU:0",)


def slurm_cluster_resolver(
    environ: Mapping[str, str] | None = None,
) -> tf.distribute.cluster_resolver.ClusterResolver:
    """The cluster of a SLURM ``srun`` step, resolved with TensorFlow's SlurmClusterResolver.

    ``SlurmClusterResolver`` expands ``SLURM_STEP_NODELIST`` and gives the tasks of a
    node consecutive ports from a base port (``tfdist.config.slurm_port_base``). Its GPU
    bookkeeping pairs every task with GPU slots, which fails on CPU-only nodes and fights
    the GPU binding srun already did; so tfdist uses it for the cluster only (one
    bookkeeping slot per task, ``auto_set_gpu=False``) and reports the GPUs this task sees.

    Example:
        In an ``srun --ntasks=2 --nodes=2`` step:

        >>> slurm_cluster_resolver().cluster_spec()  # doctest: +SKIP
        ClusterSpec({'worker': ['node01:23456', 'node02:23456']})
    """
    env = os.environ if environ is None else environ
    info = cluster.cluster_from_env(env)
    if info.source != "SLURM":
        raise ConfigError(
            "slurm_cluster_resolver: this is not a SLURM job step with more than one task. "
            f"Received: SLURM_STEP_NUM_TASKS={env.get('SLURM_STEP_NUM_TASKS')!r}, "
            f"TF_CONFIG set={bool(env.get('TF_CONFIG'))}. Start the workers with "
            "`srun --ntasks=N python train.py` (and unset TF_CONFIG)."
        )
    slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=config.slurm_port_base(env),
        gpus_per_node=info.num_workers,  # one bookkeeping slot per task, see above
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    gpus = len(tf.config.list_physical_devices("GPU"))  # physical: no context yet
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        slurm.cluster_spec(),
        task_type=slurm.task_type,
        task_id=slurm.task_id,
        num_accelerators={"GPU": gpus} if gpus else {},
        rpc_layer="grpc",
    )


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
        compat.apply_all()
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
    if not _private.tf_in_multi_worker_mode(current()):
        return
    try:
        _private.tf_wait_at_barrier(f"tfdist/{name}", int(timeout * 1000))
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
    return cluster.is_chief()


def describe(environ: Mapping[str, str] | None = None) -> dict:
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
    if not _private.tf_in_multi_worker_mode(s):
        return None
    value = tf.constant([list(row)], tf.int64)
    # Every replica contributes its worker's row; gather them all on every worker.
    return s.gather(s.run(lambda: tf.identity(value)), axis=0).numpy()


def key_value_set(key: str, value: str) -> bool:
    """Publishes ``key=value`` in the coordination service's store; False when another
    worker set ``key`` first. Raises StoreGone when the service is gone."""
    try:
        _private.tf_key_value_set(key, value)
    except tf.errors.AlreadyExistsError:
        return False
    except tf.errors.OpError as err:
        raise StoreGone(str(err)) from err
    return True


def key_value_get(key: str, timeout: float) -> str | None:
    """The value of ``key`` in the coordination service's store, or None when it is not set
    within ``timeout`` seconds. Raises StoreGone when the service is gone."""
    try:
        return _private.tf_key_value_get(key, round(timeout * 1000))
    except tf.errors.DeadlineExceededError:
        return None
    except tf.errors.OpError as err:
        raise StoreGone(str(err)) from err


def phantom_prone_variables(model) -> list:
    """The step counter and the seed generators' states: when a dataset ends before Keras
    expected, its train step runs once more and may still advance them (a race; see
    ``tfdist.checkpoint.rng``)."""
    generators = {id(g): g for g in _private.keras_seed_generators(model)}  # shared: once
    return [model.optimizer.iterations] + [g.state for g in generators.values()]


def saves_sharded() -> bool:
    """False: Orbax writes ``jax.Array``s; TensorFlow models keep ``.keras`` archives."""
    return False


def splits_uneven_batches() -> bool:
    """True: ``tf.distribute`` feeds a partial last batch, however it splits."""
    return True
