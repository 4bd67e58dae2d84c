"""Which tf.distribute strategy a process should build: the plan, decided without building it.

``plan()`` reads the cluster (TF_CONFIG or SLURM), the local devices and the knobs and
returns a frozen ``StrategyPlan`` (kind, devices, timeouts, communication); the backend
(``tfdist.backends.tensorflow``) builds it once per process.

Example:
    >>> plan("auto").kind  # doctest: +SKIP
    'mirrored'
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import tensorflow as tf

from tfdist.core import cluster, config, process, validate
from tfdist.core.config import Communication, ConfigError, MultiWorkerTimeouts

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
