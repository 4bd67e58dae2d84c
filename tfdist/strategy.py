"""The one distribution strategy of a process: which kind, on which devices, created once.

Example:
    >>> import tfdist
    >>> with tfdist.scope():             # doctest: +SKIP
    ...     model = build_and_compile()
    >>> tfdist.global_batch_size(64)     # doctest: +SKIP
    128
"""

from __future__ import annotations

import logging
import numbers
import os
import sys
import threading
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import tensorflow as tf

from tfdist import cluster as _cluster

__all__ = [
    "KINDS",
    "MultiWorkerTimeouts",
    "StrategyPlan",
    "configure_cpu_devices",
    "plan",
    "strategy",
    "scope",
    "num_replicas",
    "global_batch_size",
    "is_chief",
    "describe",
    "current_plan",
]

logger = logging.getLogger(__name__)

KINDS = ("auto", "mirrored", "multi_worker", "one_device", "default")
CPU_DEVICES_ENV = "TFDIST_CPU_DEVICES"
SLURM_PORT_BASE_ENV = "TFDIST_SLURM_PORT_BASE"

_lock = threading.Lock()
_created: tuple[StrategyPlan, tf.distribute.Strategy] | None = None


_TIMEOUT_ENV = {
    "register": "TFDIST_REGISTER_TIMEOUT",
    "heartbeat": "TFDIST_HEARTBEAT_TIMEOUT",
    "shutdown": "TFDIST_SHUTDOWN_TIMEOUT",
    "collective": "TFDIST_COLLECTIVE_TIMEOUT",
}


@dataclass(frozen=True)
class MultiWorkerTimeouts:
    """How long a multi-worker job waits before it gives up, in seconds.

    Attributes:
        register: every worker must have started and registered within this time
            (``TFDIST_REGISTER_TIMEOUT``, default 300).
        heartbeat: a worker that sends no heartbeat for this long is declared dead and
            the others' collectives fail with an error naming it
            (``TFDIST_HEARTBEAT_TIMEOUT``, default 10). This is what ends the survivors
            within seconds when a worker is killed or stops answering.
        shutdown: at exit, how long a worker waits for the others
            (``TFDIST_SHUTDOWN_TIMEOUT``, default 60).
        collective: limit for each collective op, or None for none
            (``TFDIST_COLLECTIVE_TIMEOUT``, default None). Catches a worker that is
            alive but stuck; TensorFlow spends one thread per in-flight collective on
            it, so keep it off unless debugging.

    Example:
        >>> MultiWorkerTimeouts(heartbeat=20).register
        300.0
    """

    register: float = 300.0
    heartbeat: float = 10.0
    shutdown: float = 60.0
    collective: float | None = None

    def __post_init__(self):
        for name in _TIMEOUT_ENV:
            value = getattr(self, name)
            if name == "collective" and value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not value > 0
                or value != value
            ):
                raise ValueError(
                    f"MultiWorkerTimeouts: {name} must be a positive number of seconds"
                    f"{' or None' if name == 'collective' else ''}. Received: {name}={value!r}"
                )
            object.__setattr__(self, name, float(value))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MultiWorkerTimeouts:
        """The defaults, overridden by ``TFDIST_*_TIMEOUT`` variables that are set.

        Example:
            >>> MultiWorkerTimeouts.from_env({"TFDIST_HEARTBEAT_TIMEOUT": "30"}).heartbeat
            30.0
        """
        env = os.environ if environ is None else environ
        values = {}
        for name, var in _TIMEOUT_ENV.items():
            text = env.get(var, "").strip()
            if not text:
                continue
            if name == "collective" and text.lower() in ("0", "none", "off"):
                values[name] = None
                continue
            try:
                values[name] = float(text)
            except ValueError:
                raise ValueError(
                    f"{var} must be a number of seconds. Received: {var}={text!r}"
                ) from None
            if not values[name] > 0:
                raise ValueError(
                    f"{var} must be a positive number of seconds. Received: {var}={text!r}"
                )
        return cls(**values)


@dataclass(frozen=True)
class StrategyPlan:
    """What ``strategy()`` builds: resolved once from arguments, environment and devices.

    Attributes:
        kind: one of ``mirrored``, ``multi_worker``, ``one_device``, ``default``.
        devices: the local devices that hold a replica.
        num_workers: training processes in the cluster (1 without one).
        cluster_source: ``TF_CONFIG``, ``SLURM`` or ``none``.
        timeouts: for ``multi_worker`` only: how long the job waits for its peers.
    """

    kind: str
    devices: tuple[str, ...]
    num_workers: int = 1
    cluster_source: str = "none"
    timeouts: MultiWorkerTimeouts | None = None

    @property
    def num_replicas(self) -> int:
        """Replicas in sync: local devices times workers."""
        return max(len(self.devices), 1) * self.num_workers


def _positive_int(value, name: str, where: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{where}: {name} must be a positive int. Received: {name}={value!r}. {hint}"
        )
    if value < 1:
        raise ValueError(
            f"{where}: {name} must be a positive int. Received: {name}={value!r}. {hint}"
        )
    return int(value)


def cpu_devices_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """``TFDIST_CPU_DEVICES`` as a positive int, or None when unset or empty."""
    env = os.environ if environ is None else environ
    text = env.get(CPU_DEVICES_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = text
    return _positive_int(
        value, CPU_DEVICES_ENV, "tfdist", "Set it to the number of logical CPU devices, e.g. 2."
    )


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
    n = _positive_int(n, "n", "configure_cpu_devices", "Pass the number of logical CPUs wanted.")
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
                    f"Set {CPU_DEVICES_ENV}={n} (or call tfdist.strategy(cpu_devices={n})) "
                    "before anything creates a tensor, or run in a new process."
                ) from None
    return [f"/device:CPU:{i}" for i in range(n)]


def plan(
    kind: str = "auto",
    *,
    devices: Sequence[str] | None = None,
    cpu_devices: int | None = None,
    timeouts: MultiWorkerTimeouts | None = None,
    environ: Mapping[str, str] | None = None,
) -> StrategyPlan:
    """Resolves which strategy ``strategy()`` would build, without building it.

    Precedence: explicit arguments, then ``TF_CONFIG``/SLURM and ``TFDIST_CPU_DEVICES``,
    then the devices present. ``auto`` means multi-worker when a cluster of more than one
    training task is configured, mirrored when more than one GPU (or logical CPU) exists,
    and the default strategy otherwise. Configures logical CPUs as a side effect.

    A multi-worker plan has one replica per local GPU, else per logical CPU
    (``TFDIST_CPU_DEVICES``), else one; and ``timeouts`` (default: from the
    environment, see ``MultiWorkerTimeouts``). Nothing here initialises TensorFlow's
    context, which would stop the strategy from configuring its collectives.

    Example:
        >>> plan("auto").kind  # doctest: +SKIP
        'default'
    """
    if kind not in KINDS:
        raise ValueError(
            f"strategy: kind must be one of {KINDS}. Received: kind={kind!r}. "
            "Use 'auto' to let tfdist choose from the cluster and devices."
        )
    if devices is not None and (isinstance(devices, str) or not devices):
        raise ValueError(
            "strategy: devices must be a non-empty list of device names such as "
            f"['/gpu:0', '/gpu:1']. Received: devices={devices!r}"
        )
    if timeouts is not None and not isinstance(timeouts, MultiWorkerTimeouts):
        raise TypeError(
            "strategy: timeouts must be a tfdist.strategy.MultiWorkerTimeouts or None. "
            f"Received: timeouts={timeouts!r}"
        )
    env = os.environ if environ is None else environ
    if cpu_devices is None:
        cpu_devices = cpu_devices_from_env(env)
    else:
        cpu_devices = _positive_int(
            cpu_devices, "cpu_devices", "strategy", "Pass the number of logical CPUs wanted."
        )
    cpus = configure_cpu_devices(cpu_devices) if cpu_devices else None
    info = _cluster.cluster_from_env(env)

    if kind == "auto":
        if info.is_multi_worker:
            kind = "multi_worker"
        elif devices is not None:
            kind = "mirrored" if len(devices) > 1 else "one_device"
        elif len(_local_devices(cpus)) > 1:
            kind = "mirrored"
        else:
            kind = "default"

    if kind == "multi_worker":
        if not info.is_multi_worker:
            raise ValueError(
                "strategy: kind='multi_worker' needs a cluster of more than one training task. "
                f"Received: TF_CONFIG={env.get('TF_CONFIG')!r}. Start the workers with "
                "`tfdist launch -n N script.py`, or set TF_CONFIG for each process."
            )
        if devices is not None:
            raise ValueError(
                "strategy: devices cannot be chosen for kind='multi_worker': every worker "
                f"uses all its GPUs (or TFDIST_CPU_DEVICES logical CPUs). Received: "
                f"devices={devices!r}. Limit the GPUs with CUDA_VISIBLE_DEVICES, or use "
                "`tfdist launch --devices-per-worker K`."
            )
        return StrategyPlan(
            kind,
            _local_devices(cpus),
            info.num_workers,
            info.source,
            timeouts or MultiWorkerTimeouts.from_env(env),
        )
    if kind == "mirrored":
        return StrategyPlan(kind, tuple(devices) if devices else _local_devices(cpus))
    if kind == "one_device":
        return StrategyPlan(kind, (tuple(devices) if devices else _local_devices(cpus))[:1])
    return StrategyPlan("default", (_local_devices(cpus)[0],))


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
    node consecutive ports from a base port. Its GPU bookkeeping pairs every task with
    GPU slots, which fails on CPU-only nodes (it runs ``nvidia-smi``, and zero GPUs
    per task make an empty task list) and fights the GPU binding srun already did
    (``--gpus-per-task``). So tfdist uses it for the cluster only (one bookkeeping
    slot per task, ``auto_set_gpu=False``) and reports the GPUs this task can see.

    The base port is ``TFDIST_SLURM_PORT_BASE``, else ``20000 + SLURM_JOB_ID % 20000``
    so that two jobs sharing a node do not collide.

    Example:
        In an ``srun --ntasks=2 --nodes=2`` step:

        >>> slurm_cluster_resolver().cluster_spec()  # doctest: +SKIP
        ClusterSpec({'worker': ['node01:23456', 'node02:23456']})
    """
    env = os.environ if environ is None else environ
    info = _cluster.cluster_from_env(env)
    if info.source != "SLURM":
        raise ValueError(
            "slurm_cluster_resolver: this is not a SLURM job step with more than one task. "
            f"Received: SLURM_STEP_NUM_TASKS={env.get('SLURM_STEP_NUM_TASKS')!r}, "
            f"TF_CONFIG set={bool(env.get('TF_CONFIG'))}. Start the workers with "
            "`srun --ntasks=N python train.py` (and unset TF_CONFIG)."
        )
    text = env.get(SLURM_PORT_BASE_ENV, "").strip()
    if text:
        try:
            port_base = int(text)
        except ValueError:
            port_base = -1
        if not 1024 <= port_base <= 65000:
            raise ValueError(
                f"{SLURM_PORT_BASE_ENV} must be a port number in [1024, 65000]. Received: "
                f"{SLURM_PORT_BASE_ENV}={text!r}"
            )
    else:
        job = env.get("SLURM_JOB_ID", "0").strip()
        port_base = 20000 + (int(job) if job.isdigit() else 0) % 20000
    slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=port_base,
        gpus_per_node=info.num_workers,  # one bookkeeping slot per task, see above
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    spec = slurm.cluster_spec()
    gpus = len(tf.config.list_physical_devices("GPU"))  # physical: no context yet
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec,
        task_type=slurm.task_type,
        task_id=slurm.task_id,
        num_accelerators={"GPU": gpus} if gpus else {},
        rpc_layer="grpc",
    )


def _build(p: StrategyPlan) -> tf.distribute.Strategy:
    if p.kind == "mirrored":
        return tf.distribute.MirroredStrategy(devices=list(p.devices))
    if p.kind == "one_device":
        return tf.distribute.OneDeviceStrategy(p.devices[0])
    if p.kind == "multi_worker":
        return _build_multi_worker(p)
    return tf.distribute.get_strategy()


def _build_multi_worker(p: StrategyPlan) -> tf.distribute.Strategy:
    from tfdist import compat

    if p.cluster_source == "SLURM":
        resolver = slurm_cluster_resolver()
    else:
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    timeouts = p.timeouts or MultiWorkerTimeouts.from_env()
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeouts.collective)
    # The coordination-service timeouts and the logical CPUs per worker are applied by
    # compat's fixes while the strategy initialises (tf_multi_worker_timeouts,
    # tf_multi_worker_logical_cpus); this block hands them the explicit timeouts.
    with compat.multi_worker_timeouts(timeouts):
        return tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver, communication_options=options
        )


def strategy(
    kind: str = "auto",
    *,
    devices: Sequence[str] | None = None,
    cpu_devices: int | None = None,
    timeouts: MultiWorkerTimeouts | None = None,
) -> tf.distribute.Strategy:
    """The process's strategy: created on the first call, the same object afterwards.

    Args:
        kind: ``auto`` (default), ``mirrored``, ``multi_worker``, ``one_device`` or ``default``.
        devices: local devices for ``mirrored``/``one_device``; all GPUs (or logical CPUs)
            when None.
        cpu_devices: split the CPU into this many logical devices (overrides
            ``TFDIST_CPU_DEVICES``); only possible before TensorFlow initialises devices.
        timeouts: for multi-worker: how long to wait for peers (overrides the
            ``TFDIST_*_TIMEOUT`` variables; see ``MultiWorkerTimeouts``).

    Raises:
        RuntimeError: a strategy of another kind or on other devices already exists.

    Example:
        >>> s = strategy()            # doctest: +SKIP
        >>> s is strategy()           # doctest: +SKIP
        True
    """
    global _created
    with _lock:
        if _created is not None:
            existing, obj = _created
            # Compare only what the caller asked for explicitly: the environment was
            # already read when the strategy was created.
            conflicts = (
                (kind != "auto" and kind != existing.kind)
                or (devices is not None and tuple(devices) != existing.devices)
                or (cpu_devices is not None and cpu_devices != len(existing.devices))
                or (timeouts is not None and timeouts != existing.timeouts)
            )
            if conflicts:
                raise RuntimeError(
                    f"strategy: this process already has a {existing.kind!r} strategy on "
                    f"{list(existing.devices)}; it cannot also have kind={kind!r}, "
                    f"devices={devices!r}, cpu_devices={cpu_devices!r}, timeouts={timeouts!r}. "
                    "Create the strategy "
                    "once, before building models (call tfdist.strategy(...) first), or use "
                    "a new process."
                )
            return obj
        wanted = plan(kind, devices=devices, cpu_devices=cpu_devices, timeouts=timeouts)
        _apply_compat_fixes()
        obj = _build(wanted)
        _created = (wanted, obj)
        logger.info(
            "tfdist: %s strategy with %d replica(s) on %s",
            wanted.kind,
            obj.num_replicas_in_sync,
            list(wanted.devices),
        )
        return obj


def _apply_compat_fixes() -> None:
    # Imported here: compat patches Keras and needs nothing from this module.
    from tfdist import compat

    compat.apply_all()


def current_plan() -> StrategyPlan | None:
    """The plan of the strategy ``strategy()`` created, or None before the first call."""
    return _created[0] if _created else None


def _current(strategy_arg: tf.distribute.Strategy | None) -> tf.distribute.Strategy:
    """An explicit strategy, else the one whose scope is open, else tfdist's own."""
    if strategy_arg is not None:
        if not isinstance(strategy_arg, tf.distribute.Strategy):
            raise TypeError(
                "strategy must be a tf.distribute.Strategy or None. "
                f"Received: strategy={strategy_arg!r}"
            )
        return strategy_arg
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    return strategy()


def scope(**kwargs):
    """``with tfdist.scope():`` opens the scope of ``strategy(**kwargs)``.

    Example:
        >>> with scope():  # doctest: +SKIP
        ...     model = keras.Sequential([keras.layers.Dense(1)])
    """
    return strategy(**kwargs).scope()


def num_replicas(*, strategy: tf.distribute.Strategy | None = None) -> int:
    """Replicas in sync under ``strategy`` (or the current one).

    Example:
        >>> num_replicas()  # doctest: +SKIP
        2
    """
    return _current(strategy).num_replicas_in_sync


def global_batch_size(per_replica: int, *, strategy: tf.distribute.Strategy | None = None) -> int:
    """The global batch: ``per_replica`` times the number of replicas.

    Args:
        per_replica: examples each replica processes per step (positive int).
        strategy: defaults to the current strategy.

    Example:
        >>> global_batch_size(64)  # doctest: +SKIP
        128
    """
    per_replica = _positive_int(
        per_replica,
        "per_replica",
        "global_batch_size",
        "Pass the batch size of one replica as an int, e.g. global_batch_size(64).",
    )
    return per_replica * num_replicas(strategy=strategy)


def is_chief() -> bool:
    """Whether this process is the chief (always True on one machine).

    Example:
        >>> is_chief()  # doctest: +SKIP
        True
    """
    return _cluster.is_chief()


def describe(environ: Mapping[str, str] | None = None) -> dict:
    """What this process sees: versions, devices, the strategy ``auto`` picks, the cluster.

    Used by ``tfdist info``. It plans the strategy without creating it, so it never
    starts a gRPC server or waits for other workers.

    Example:
        >>> describe()["strategy"]["kind"]  # doctest: +SKIP
        'default'
    """
    import importlib.metadata as md
    import platform

    import keras

    env = os.environ if environ is None else environ

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    p = current_plan() or plan("auto", environ=env)
    from tfdist import __version__

    return {
        "versions": {
            "python": platform.python_version(),
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "tensorflow_datasets": version("tensorflow-datasets"),
            "tfdist": __version__,
        },
        "devices": {
            "gpus": [d.name for d in tf.config.list_logical_devices("GPU")],
            "cpus": [d.name for d in tf.config.list_logical_devices("CPU")],
            CPU_DEVICES_ENV: env.get(CPU_DEVICES_ENV) or None,
        },
        "strategy": {
            "kind": p.kind,
            "num_replicas": p.num_replicas,
            "devices": list(p.devices),
            "num_workers": p.num_workers,
        },
        "cluster": _cluster.cluster_from_env(env).summary(),
        "TFDS_DATA_DIR": env.get("TFDS_DATA_DIR") or None,
    }


class _CallableModule(types.ModuleType):
    """Lets ``tfdist.strategy(...)`` call ``strategy()`` although the name is also this module.

    Python binds ``tfdist.strategy`` to this module whenever anything imports
    ``tfdist.strategy``; making the module callable keeps the documented call working.
    """

    def __call__(self, *args, **kwargs) -> tf.distribute.Strategy:
        return strategy(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
