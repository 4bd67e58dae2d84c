"""Fixes to TensorFlow's multi-worker runtime: bounded waits and logical CPUs per worker.

Each ``fix_*`` function's docstring says what breaks upstream and what the fix changes.
Every private TensorFlow name used comes from ``tfdist._private``.
"""

from __future__ import annotations

import logging

from tfdist import _private, config, process
from tfdist.compat.registry import patch

__all__ = ["fix_multi_worker_timeouts", "fix_multi_worker_logical_cpus"]

logger = logging.getLogger(__name__)


def _timeouts() -> config.MultiWorkerTimeouts:
    """The timeouts tfdist's strategy asked for, else the ``TFDIST_*_TIMEOUT`` variables."""
    return process.state().multi_worker_timeouts or config.MultiWorkerTimeouts.from_env()


def _before_multi_worker_init(extended, cluster_resolver) -> None:
    timeouts = _timeouts()
    configured = _private.tf_configure_coordination(
        cluster_resolver,
        register_ms=int(timeouts.register * 1000),
        heartbeat_ms=int(timeouts.heartbeat * 1000),
        shutdown_ms=int(timeouts.shutdown * 1000),
    )
    if configured:
        logger.debug("tfdist.compat: coordination service timeouts %s", timeouts)
    options = _private.tf_communication_options(extended)
    if timeouts.collective and options.timeout_seconds is None:
        _private.tf_set_communication_options(
            extended,
            options.merge(_private.tf_collective_options(timeout_seconds=timeouts.collective)),
        )
    if _private.tf_collectives_enabled():
        _private.tf_mark_server_started(extended)


def fix_multi_worker_timeouts() -> None:
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

    Second strategy: when the process's collectives were already started (tfdist set
    the process up before TensorFlow's first op, see ``tfdist.startup``) and a script
    builds its own MultiWorkerMirroredStrategy afterwards, upstream would start the
    same gRPC server a second time. The fix marks that server as started for the new
    strategy, which then shares the running one, as a strategy built first would.
    """

    def make(original):
        def _initialize_multi_worker(self, cluster_resolver):
            _before_multi_worker_init(self, cluster_resolver)
            return original(self, cluster_resolver)

        return _initialize_multi_worker

    patch(
        _private.tf_collective_extended_class(),
        "_initialize_multi_worker",
        "tf_multi_worker_timeouts",
        make,
    )


def _logical_cpus(worker_device: str, wanted: int) -> tuple[str, ...]:
    import tensorflow as tf

    have = len(tf.config.list_logical_devices("CPU"))
    if have < wanted:
        raise RuntimeError(
            f"TFDIST_CPU_DEVICES={wanted} but TensorFlow has {have} logical CPU "
            "device(s). Configure them before creating the strategy: import tfdist "
            "before TensorFlow, or run the script under `tfdist launch` (or "
            "`python -m tfdist.bootstrap`), which does it."
        )
    return tuple(f"{worker_device}/device:CPU:{i}" for i in range(wanted))


def fix_multi_worker_logical_cpus() -> None:
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

    def make(original):
        def _initialize_local_devices(self, cluster_resolver, worker_device):
            devices, device_type = original(self, cluster_resolver, worker_device)
            wanted = config.cpu_devices() or 1
            if device_type == "CPU" and wanted > 1:
                devices = _logical_cpus(worker_device, wanted)
            return devices, device_type

        return _initialize_local_devices

    patch(
        _private.tf_collective_extended_class(),
        "_initialize_local_devices",
        "tf_multi_worker_logical_cpus",
        make,
    )
