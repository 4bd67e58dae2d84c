"""What each worker is started with: addresses, command line and environment.

Pure functions of ``LaunchOptions`` and an environment mapping (``free_ports`` and
``group_addresses`` also probe this host's ports), so they are tested without starting
a process.

Example:
    >>> opts = LaunchOptions(nproc=2, target="train.py", port=2222)
    >>> cluster_addresses(opts)
    ['127.0.0.1:2222', '127.0.0.1:2223']
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

from tfdist.core import quiet, validate
from tfdist.core.cluster import worker_tf_config
from tfdist.core.config import (
    COMPAT_EXCLUDE_ENV,
    CPU_DEVICES_ENV,
    RESTART_ENV,
    ConfigError,
)
from tfdist.launch.options import (
    LOOPBACK,
    LaunchOptions,
    check_options,
    is_loopback,
    split_host,
    visible_gpus,
)

__all__ = [
    "BOOTSTRAP_MODULE",
    "free_ports",
    "visible_gpus",
    "cluster_addresses",
    "group_addresses",
    "worker_command",
    "worker_envs",
    "intra_op_threads",
    "INTRA_OP_ENV",
]

BOOTSTRAP_MODULE = "tfdist.bootstrap"  # applies tfdist's fixes, then runs the script
# Set by a SLURM step around the launcher; a worker that saw them would resolve SLURM.
_SLURM_TASK_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID")


def free_ports(n: int, *, host: str = LOOPBACK) -> list[int]:
    """``n`` distinct TCP ports that are free on ``host`` right now (loopback only).

    The ports are only reserved while this function runs, so a worker should bind them
    soon; the launcher picks new ones for every restart.

    Example:
        >>> len(set(free_ports(3)))
        3
    """
    validate.positive_int(n, "n", "free_ports")
    if not is_loopback(host):
        raise ValueError(validate.message("free_ports", "host", "a loopback address", host))
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((LOOPBACK if host == "localhost" else host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _check_ports_free(ports: Sequence[int]) -> None:
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError as err:
                raise ConfigError(
                    f"launch: port {port} on {LOOPBACK} is in use ({err.strerror}). Received: "
                    f"ports={list(ports)}. Choose another --port, or leave --port out to use "
                    "free ports."
                ) from None


def cluster_addresses(options: LaunchOptions, ports: Sequence[int] | None = None) -> list[str]:
    """``host:port`` of every worker of the job, in rank order.

    Args:
        options: the launch options.
        ports: this node's ports for a single-node job without a fixed port.

    Example:
        >>> cluster_addresses(LaunchOptions(nproc=2, target="t.py", port=2222))
        ['127.0.0.1:2222', '127.0.0.1:2223']
    """
    check_options(options, "cluster_addresses")
    split = [split_host(h) for h in options.hosts]
    if options.fixed_ports:
        addresses: list[str] = []
        for host, port in split:
            first = port if port is not None else options.port
            assert first is not None  # fixed_ports: each host names its port, or port is set
            addresses.extend(f"{host}:{first + i}" for i in range(options.nproc))
        return addresses
    if ports is None or len(ports) != options.nproc:
        raise ValueError(
            f"cluster_addresses: ports must list {options.nproc} ports when no fixed port is "
            f"set. Received: ports={ports!r}"
        )
    return [f"{split[0][0]}:{port}" for port in ports]


def group_addresses(options: LaunchOptions) -> list[str]:
    """The addresses for one start of the worker group: fresh free ports, or the fixed ones.

    Raises:
        ConfigError: a fixed port of this node is taken (checked when every host is
            this host, instead of letting TensorFlow fail later).
    """
    check_options(options, "group_addresses")
    if not options.fixed_ports:
        return cluster_addresses(options, free_ports(options.nproc))
    addresses = cluster_addresses(options)
    if all(is_loopback(split_host(h)[0]) for h in options.hosts):
        mine = addresses[options.ranks().start : options.ranks().stop]
        _check_ports_free([int(a.rpartition(":")[2]) for a in mine])
    return addresses


def worker_command(options: LaunchOptions) -> list[str]:
    """The command line of every worker.

    Example:
        >>> worker_command(LaunchOptions(nproc=1, target="t.py", args=("-x",)))[1:]
        ['-m', 'tfdist.bootstrap', 't.py', '-x']
    """
    check_options(options, "worker_command")
    target = ["-m", options.target] if options.module else [options.target]
    if options.fixes:
        return [options.python, "-m", BOOTSTRAP_MODULE, *target, *options.args]
    return [options.python, *target, *options.args]


def _gpus_per_worker(options: LaunchOptions, gpus: list[str]) -> int:
    per = options.devices_per_worker
    if per is None:
        if len(gpus) % options.nproc:
            raise ConfigError(
                f"launch: {len(gpus)} visible GPU(s) {gpus} cannot be split evenly between "
                f"{options.nproc} workers. Received: nproc={options.nproc}. Pass "
                "--devices-per-worker K, or set CUDA_VISIBLE_DEVICES to the GPUs to use "
                "(CUDA_VISIBLE_DEVICES= trains on CPU)."
            )
        per = len(gpus) // options.nproc
    if per * options.nproc > len(gpus):
        raise ConfigError(
            f"launch: {options.nproc} workers x {per} GPU(s) need {per * options.nproc} "
            f"GPUs, but {len(gpus)} are visible {gpus}. Received: devices_per_worker="
            f"{options.devices_per_worker}. Use fewer workers or devices per worker."
        )
    return per


def _rank_variables(options: LaunchOptions, addresses: Sequence[str], rank: int) -> dict:
    """torchrun's and Keras's (JAX) names for the worker's place in the job."""
    master_host, _, master_port = addresses[0].rpartition(":")
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(options.world_size),
        "LOCAL_RANK": str(rank - options.ranks().start),
        "LOCAL_WORLD_SIZE": str(options.nproc),
        "MASTER_ADDR": master_host.strip("[]"),
        "MASTER_PORT": master_port,
        # keras.distribution.initialize() reads these (the first address is the
        # coordinator, as in TF_CONFIG, which tfdist's own start-up reads first).
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": ",".join(addresses),
        "KERAS_DISTRIBUTION_NUM_PROCESSES": str(options.world_size),
        "KERAS_DISTRIBUTION_PROCESS_ID": str(rank),
    }


INTRA_OP_ENV = "TF_NUM_INTRAOP_THREADS"


def intra_op_threads(workers_here: int) -> int:
    """Each worker's share of this host's cores, for TensorFlow's intra-op thread pool.

    TensorFlow sizes each process's pool to every core, so N workers on one host start N
    times too many threads (torchrun sets ``OMP_NUM_THREADS=1`` for the same reason).
    Measured, 2 workers on 2 cores: a ``fit`` step 22.4 ms with one thread each against
    26.7 ms with TensorFlow's default (medians of 5 alternated runs).

    Example:
        >>> intra_op_threads(2) >= 1
        True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, workers_here))


def worker_envs(
    options: LaunchOptions,
    addresses: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    restart: int = 0,
) -> list[dict[str, str]]:
    """The environment of each of this node's workers (a pure function).

    ``environ`` (default ``os.environ``) plus the variables listed in the
    ``tfdist.launch`` docstring: ``TF_CONFIG`` for the worker's rank,
    ``PYTHONUNBUFFERED=1``, ``TFDIST_RESTART=restart``, torchrun's ``RANK`` ...
    ``MASTER_PORT``, Keras's ``KERAS_DISTRIBUTION_*``, its devices,
    ``TFDIST_COMPAT_EXCLUDE=all`` with ``fixes=False``, ``TF_CPP_MIN_LOG_LEVEL=2``
    (unless set) without ``verbose``, and with several workers on this node
    ``TF_NUM_INTRAOP_THREADS`` = their share of its cores (unless set).

    Raises:
        ConfigError: the GPUs cannot be split as asked.

    Example:
        >>> envs = worker_envs(LaunchOptions(nproc=2, target="t.py", devices_per_worker=2),
        ...                    ["127.0.0.1:1", "127.0.0.1:2"], environ={})
        >>> envs[1]["TFDIST_CPU_DEVICES"], envs[1]["TF_CONFIG"][-30:]
        ('2', '"type": "worker", "index": 1}}')
    """
    check_options(options, "worker_envs")
    env = dict(os.environ if environ is None else environ)
    if isinstance(addresses, str) or len(addresses) != options.world_size:
        raise ValueError(
            f"worker_envs: addresses must list all {options.world_size} workers of the job. "
            f"Received: addresses={list(addresses)!r}"
        )
    gpus = visible_gpus(env)
    per = _gpus_per_worker(options, gpus) if gpus else options.devices_per_worker
    threads = intra_op_threads(options.nproc)
    envs = []
    for local, rank in enumerate(options.ranks()):
        child = dict(env)
        child["TF_CONFIG"] = worker_tf_config(list(addresses), rank)
        child["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
        child[RESTART_ENV] = str(restart)
        child.update(_rank_variables(options, addresses, rank))
        if not options.verbose:  # TensorFlow's C++ INFO/WARNING banner off
            child = quiet.quiet_environment(child)
        if gpus:
            assert per is not None  # _gpus_per_worker's count when GPUs are visible
            child["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[local * per : (local + 1) * per])
            child.pop(CPU_DEVICES_ENV, None)
        elif per is not None:
            child[CPU_DEVICES_ENV] = str(per)
        if options.nproc > 1:  # a value the user set is kept
            child.setdefault(INTRA_OP_ENV, str(threads))
        for key in _SLURM_TASK_VARS:
            child.pop(key, None)
        if not options.fixes:  # upstream behaviour, also for scripts that import tfdist
            child[COMPAT_EXCLUDE_ENV] = "all"
        envs.append(child)
    return envs
