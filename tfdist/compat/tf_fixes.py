"""Fixes to TensorFlow's multi-worker runtime: bounded waits and logical CPUs per worker.

Each ``fix_*`` function's docstring says what breaks upstream and what the fix changes.
Every private TensorFlow name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import logging

from tfdist.core import config, process, shard_policy, startup_watch, upstream
from tfdist.core.fix_registry import Fix, on_tensorflow_backend, patch, targets

__all__ = [
    "TF_MULTI_WORKER_AUTO_SHARD",
    "TF_MULTI_WORKER_LOGICAL_CPUS",
    "TF_MULTI_WORKER_TIMEOUTS",
    "tf_multi_worker_timeouts",
    "tf_multi_worker_logical_cpus",
    "tf_multi_worker_auto_shard",
]

# The fixes' names, declared once (other layers import them).
TF_MULTI_WORKER_TIMEOUTS = "tf_multi_worker_timeouts"
TF_MULTI_WORKER_LOGICAL_CPUS = "tf_multi_worker_logical_cpus"
TF_MULTI_WORKER_AUTO_SHARD = "tf_multi_worker_auto_shard"

logger = logging.getLogger(__name__)


def _timeouts() -> config.MultiWorkerTimeouts:
    """The timeouts tfdist's strategy asked for, else the ``TFDIST_*_TIMEOUT`` variables."""
    return process.state().multi_worker_timeouts or config.MultiWorkerTimeouts.from_env()


def _before_multi_worker_init(extended, cluster_resolver) -> None:
    timeouts = _timeouts()
    configured = upstream.tf_configure_coordination(
        cluster_resolver,
        register_ms=int(timeouts.register * 1000),
        heartbeat_ms=int(timeouts.heartbeat * 1000),
        shutdown_ms=int(timeouts.shutdown * 1000),
    )
    if configured:
        logger.debug("tfdist.compat: coordination service timeouts %s", timeouts)
    options = upstream.tf_communication_options(extended)
    if timeouts.collective and options.timeout_seconds is None:
        upstream.tf_set_communication_options(
            extended,
            options.merge(upstream.tf_collective_options(timeout_seconds=timeouts.collective)),
        )
    if upstream.tf_collectives_enabled():
        upstream.tf_mark_server_started(extended)


def _peers(cluster_resolver) -> tuple[list[str], int, str]:
    """This task's job's addresses, its index in them, and the job's name."""
    job = cluster_resolver.task_type or "worker"
    addresses = list(cluster_resolver.cluster_spec().as_dict().get(job, []))
    return addresses, int(cluster_resolver.task_id or 0), job


def _watched(start, cluster_resolver):
    """``start()`` saying whom it waits for; a start-up timeout as one line naming them."""
    import tensorflow as tf

    addresses, me, job = _peers(cluster_resolver)
    try:
        return startup_watch.watch_startup(addresses, me, start)
    except tf.errors.DeadlineExceededError as err:
        missing = startup_watch.missing_peers(addresses, me)
        if not missing:
            raise
        # Upstream: ~80 lines ending in "Barrier timed out"; what to do fits on one.
        raise tf.errors.DeadlineExceededError(
            None,
            None,
            f"tfdist: worker {me} gave up after {_timeouts().register:.0f} s waiting for "
            f"{startup_watch.missing_workers(addresses, missing, job)} to start: start it, or "
            "raise TFDIST_REGISTER_TIMEOUT.",
        ) from (err if config.debug() else None)


def tf_multi_worker_timeouts() -> None:
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
            return _watched(lambda: original(self, cluster_resolver), cluster_resolver)

        return _initialize_multi_worker

    patch(
        upstream.tf_collective_extended_class(),
        "_initialize_multi_worker",
        TF_MULTI_WORKER_TIMEOUTS,
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


def tf_multi_worker_logical_cpus() -> None:
    """Lets a CPU-only multi-worker job use K logical CPU devices per worker.

    Upstream ``CollectiveAllReduceExtended._initialize_local_devices`` gives each worker
    its GPUs, or exactly one CPU device when it has none, ignoring logical CPU devices.
    With ``TFDIST_CPU_DEVICES=K`` (set by ``tfdist launch --devices-per-worker K`` on a
    machine without GPUs) and K logical CPUs configured, the fix returns those K
    devices, so the job has K replicas per worker, as ``MirroredStrategy`` would on one
    machine. The collective all-reduce already handles several CPU devices per worker;
    only the device list changes. With GPUs, or without the variable, upstream's
    answer stands. The CPU is split before the strategy starts TensorFlow's context (a
    strategy the script builds as its first TensorFlow work copies the device
    configuration then: a one-worker job had 1 device).
    """

    def make(original):
        def _initialize_local_devices(self, cluster_resolver, worker_device):
            devices, device_type = original(self, cluster_resolver, worker_device)
            wanted = config.cpu_devices() or 1
            if device_type == "CPU" and wanted > 1:
                devices = _logical_cpus(worker_device, wanted)
            return devices, device_type

        return _initialize_local_devices

    def make_start(original):
        def _initialize_strategy(self, cluster_resolver, devices):
            # The strategy copies the context's device configuration into its server
            # definition before it starts the context, so tfdist's start-up hook (run when
            # the context starts) splits the CPU too late for a strategy the script builds
            # itself as the process's first TensorFlow work (a one-worker job): split it
            # here. A no-op where the devices are already split; explicit devices: upstream.
            wanted = config.cpu_devices() or 1
            if wanted > 1 and not devices:
                from tfdist.backends.tf_plan import configure_cpu_devices

                configure_cpu_devices(wanted)
            return original(self, cluster_resolver, devices)

        return _initialize_strategy

    owner = upstream.tf_collective_extended_class()
    patch(owner, "_initialize_local_devices", TF_MULTI_WORKER_LOGICAL_CPUS, make)
    patch(owner, "_initialize_strategy", TF_MULTI_WORKER_LOGICAL_CPUS, make_start)


# Reasons already logged: "said once", not once per fit/evaluate/predict call.
_SHARD_LOGGED: set[str] = set()


def explicit_shard_policy(dataset, num_workers: int):
    """``dataset`` with the auto-shard policy AUTO should pick set explicitly, or as is."""
    import tensorflow as tf

    policy, reason = shard_policy.auto_shard_policy(dataset, num_workers)
    if policy is None:
        return dataset
    line = f"tfdist: sharding the input pipeline by {policy.name} ({reason})"
    if line not in _SHARD_LOGGED:
        _SHARD_LOGGED.add(line)
        logger.info(line)
    if (
        policy.name == "DATA"
        and shard_policy.unseeded_shuffle(dataset)
        and "unseeded" not in _SHARD_LOGGED
    ):
        _SHARD_LOGGED.add("unseeded")
        # Every worker reads the whole pipeline and keeps its slice: with a shuffle
        # seeded at run time their orders differ, so slices overlap.
        logger.warning(
            "tfdist: the input pipeline shuffles without a seed and is sharded by DATA: "
            "workers would see different orders, some examples twice and others never. "
            "Pass shuffle(..., seed=N) or call keras.utils.set_random_seed(N) (the same N "
            "on every worker) before building the dataset."
        )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def tf_multi_worker_auto_shard() -> None:
    """Shards a dataset with fewer files than workers by DATA instead of failing.

    ``MultiWorkerMirroredStrategy.experimental_distribute_dataset`` (what Keras'
    ``fit``/``evaluate``/``predict`` call on any tf.data pipeline) shards with the
    dataset's auto-shard policy, AUTO unless the user set one. AUTO tries FILE first and
    only falls back to DATA when the pipeline has no file reader: a pipeline reading
    one file on two workers (``tfds.load("mnist")``, a single TFRecord, the official
    Distributed-training tutorial) fails with "Could not apply FILE based sharding: the
    dataset only has 1 file(s), which is not enough for the required 2 shards/workers".

    The fix counts the files on the dataset's serialised graph (``tfdist.core.shard_policy``)
    and sets the policy AUTO means explicitly: FILE with at least one file per worker
    (what upstream does), DATA with fewer (upstream fails) or without a file reader
    (upstream's fallback, minus its warning). The choice is logged once. A policy the
    user set is left alone, and so is a pipeline whose files cannot be counted (file
    names computed at run time): upstream decides as before. Single-worker strategies
    are not touched.
    """

    def make(original):
        def _experimental_distribute_dataset(self, dataset, options):
            workers = upstream.tf_extended_num_workers(self)
            if workers > 1:
                dataset = explicit_shard_policy(dataset, workers)
            return original(self, dataset, options)

        return _experimental_distribute_dataset

    patch(
        upstream.tf_collective_extended_class(),
        "_experimental_distribute_dataset",
        TF_MULTI_WORKER_AUTO_SHARD,
        make,
    )


# Module prefixes of the targets below.
_CARS = "tensorflow.python.distribute.collective_all_reduce_strategy:"
_CTX = "tensorflow.python.eager.context:"
_DS = "tensorflow.python.data.ops.dataset_ops:"

FIXES: list[Fix] = [
    Fix(
        TF_MULTI_WORKER_TIMEOUTS,
        "MultiWorkerMirroredStrategy waits forever for a worker that never starts",
        on_tensorflow_backend(),
        tf_multi_worker_timeouts,
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
        acts_where=(
            "initialising a MultiWorkerMirroredStrategy that has a cluster (TF_CONFIG with "
            "several tasks); a strategy without one: upstream's path"
        ),
        no_harm=(
            "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes[2 workers]",
        ),
    ),
    Fix(
        TF_MULTI_WORKER_LOGICAL_CPUS,
        "MultiWorkerMirroredStrategy uses one CPU device per worker, ignoring logical CPUs",
        on_tensorflow_backend(),
        tf_multi_worker_logical_cpus,
        "tensorflow",
        targets=targets(
            _CARS + "CollectiveAllReduceExtended._initialize_local_devices",
            _CARS + "CollectiveAllReduceExtended._initialize_strategy",
        ),
        acts_where=(
            "MultiWorkerMirroredStrategy without explicit devices, no GPU/TPU, "
            "TFDIST_CPU_DEVICES > 1 (the CPU split before the strategy starts the context); "
            "otherwise upstream's devices"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        TF_MULTI_WORKER_AUTO_SHARD,
        "MultiWorkerMirroredStrategy: a dataset with fewer files than workers (tfds MNIST, "
        "one TFRecord) fails: 'Could not apply FILE based sharding: the dataset only has "
        "1 file(s)'",
        on_tensorflow_backend(),
        tf_multi_worker_auto_shard,
        "tensorflow",
        targets=targets(
            _CARS + "CollectiveAllReduceExtended._experimental_distribute_dataset",
            _CARS + "CollectiveAllReduceExtended._num_workers (instance)",
            _DS + "DatasetV2._as_serialized_graph",
            _DS + "DatasetV2._inputs",
        ),
        acts_where=(
            "tf.data input distributed by MultiWorkerMirroredStrategy over >1 worker with "
            "policy AUTO; numpy input (Keras sets DATA), a policy the user set, uncountable "
            "files, one worker: upstream's"
        ),
        no_harm=(),  # none yet
    ),
]
