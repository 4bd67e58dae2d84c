"""The private TensorFlow names tfdist uses, one helper each (listed in ``tfdist.core.upstream``)."""

from __future__ import annotations


def tf_context_class():
    """TensorFlow's eager ``Context`` class: tfdist wraps ``ensure_initialized`` to set
    the process up (devices, collectives) before the context exists."""
    from tensorflow.python.eager import context

    return context.Context


def tf_context():
    """The process's eager context (coordination service, key-value store, collectives)."""
    from tensorflow.python.eager import context

    return context.context()


def tf_context_initialized(ctx=None) -> bool:
    """Whether TensorFlow has created its context (after which devices are fixed).

    Reads ``Context._context_handle``: ``tf.executing_eagerly()`` and friends would
    create the context instead of telling whether it exists.
    """
    ctx = tf_context() if ctx is None else ctx
    return getattr(ctx, "_context_handle", None) is not None


def tf_collectives_configured(ctx=None) -> bool:
    """Whether some MultiWorkerMirroredStrategy already configured collective ops."""
    ctx = tf_context() if ctx is None else ctx
    return getattr(ctx, "_collective_leader", None) is not None


def tf_collective_extended_class():
    """``CollectiveAllReduceExtended``: its multi-worker and local-device set-up is where
    the timeouts and logical-CPU fixes hook in."""
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    return cars.CollectiveAllReduceExtended


def tf_extended_num_workers(extended) -> int:
    """How many workers a ``CollectiveAllReduceExtended`` spans (1 without a cluster)."""
    # No default: a renamed attribute must not silently read as "one worker" (the
    # auto-shard fix's guard checks it exists before the fix is applied).
    return int(extended._num_workers)


def tf_distributed_delegate_class():
    """``values.DistributedDelegate``, the base of mirrored variables: its ``__getattr__``
    hands an attribute it lacks (``__array__``) to the value on this device."""
    from tensorflow.python.distribute import values

    return values.DistributedDelegate


def tf_is_distributed_variable(value) -> bool:
    """Whether ``value`` is a Mirrored/SyncOnRead variable of a strategy."""
    from tensorflow.python.distribute import distribute_utils

    return distribute_utils.is_distributed_variable(value)


def tf_collective_options(**kwargs):
    """``collective_util.Options`` (the strategy's internal form of CommunicationOptions),
    needed to merge a timeout into options a strategy already holds."""
    from tensorflow.python.distribute import collective_util

    return collective_util.Options(**kwargs)


def tf_in_multi_worker_mode(strategy) -> bool:
    """Whether a MultiWorkerMirroredStrategy really spans several workers (a strategy
    built without a cluster is single-worker; only ``extended`` knows)."""
    import tensorflow as tf

    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


def tf_configure_coordination(cluster_resolver, *, register_ms, heartbeat_ms, shutdown_ms):
    """Configures TensorFlow's coordination service as upstream would, plus timeouts.

    Returns False (and changes nothing) when one is configured already or this task
    does not join it (evaluators). Upstream exposes no timeouts on this path.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util

    ctx = tf_context()
    if ctx.coordination_service is not None:
        return False
    if cluster_resolver.task_type not in ("chief", "worker"):
        return False
    spec = multi_worker_util.normalize_cluster_spec(cluster_resolver.cluster_spec())
    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
        for job in ("chief", "worker")
        if job in spec.jobs
    ]
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=register_ms,
        heartbeat_timeout_in_ms=heartbeat_ms,
        shutdown_barrier_timeout_in_ms=shutdown_ms,
    )
    # Registration then waits at a barrier, so the register timeout also bounds the wait
    # for a peer that never starts (without it, task 0 waits forever).
    ctx.coordination_service.cluster_register_with_barrier = True
    return True


def tf_key_value_set(key: str, value: str) -> None:
    """Publishes ``key=value`` in the coordination service's store (all workers see it)."""
    tf_context().set_config_key_value(key, value)


def tf_key_value_get(key: str, timeout_ms: int) -> str:
    """Waits up to ``timeout_ms`` for ``key`` in the coordination service's store.

    Raises ``tf.errors.DeadlineExceededError`` when it does not appear in time, and
    another ``tf.errors.OpError`` when the service is gone.
    """
    return tf_context().get_config_key_value(key, timeout_in_ms=timeout_ms)


def tf_per_replica_spec_class():
    """``PerReplicaSpec``: the element spec of a distributed dataset, one per replica."""
    from tensorflow.python.distribute.values import PerReplicaSpec

    return PerReplicaSpec


def tf_per_replica_component_spec(spec):
    """The spec of one replica's part of a ``PerReplicaSpec`` (all parts are alike)."""
    return spec._component_specs[0]


def tf_distributed_dataset(iterator):
    """The distributed dataset a Keras ``TFEpochIterator`` step iterator reads, or None."""
    return getattr(iterator, "_distributed_dataset", None)


def tf_dataset_variant(dataset):
    """A dataset's variant tensor, to wrap the same graph in a ``tf.data.Dataset``
    subclass that reports another cardinality."""
    return dataset._variant_tensor


def tf_dataset_inputs(dataset) -> list:
    """The datasets ``dataset`` reads from (empty for a source), to walk a pipeline back."""
    try:
        return list(dataset._inputs())
    except Exception:  # noqa: BLE001 - a dataset that cannot say: treat it as a source
        return []


def tf_dataset_batching(dataset) -> tuple[int, bool] | None:
    """``(batch_size, drop_remainder)`` when ``dataset`` is a ``batch`` or
    ``padded_batch`` op whose arguments are constants, else None: with its input's
    cardinality, the size of its last batch, known before any data is read (tf.data has no
    public accessor for an op's arguments)."""
    import tensorflow as tf

    size = getattr(dataset, "_batch_size", None)
    drop = getattr(dataset, "_drop_remainder", None)
    if size is None or drop is None:
        return None
    size, drop = tf.get_static_value(size), tf.get_static_value(drop)
    if size is None or drop is None:
        return None
    return int(size), bool(drop)


def tf_dataset_graph_def(dataset, **kwargs):
    """A dataset's serialized graph: the only way to count the files it reads."""
    return dataset._as_serialized_graph(**kwargs)


def tf_static_batch_size(dataset) -> int | None:
    """The batch size every batch of ``dataset`` has but perhaps the last, as tf.data
    computes it from the pipeline's ops without reading data (what Keras's
    ``distribute_tf_dataset`` checks before training); None when it cannot tell."""
    from tensorflow.python.data.experimental.ops import distribute

    size = int(distribute.compute_batch_size(dataset).numpy())
    return size if size >= 0 else None


def tf_multi_device_iterator_module():
    """``multi_device_iterator_ops``: tf.distribute feeds several local devices (and a
    multi-worker job's own devices) through its ``OwnedMultiDeviceIterator``, which builds
    one small dataset per device with ``_create_device_dataset``; the epoch-start fix sets
    options on both (no public hook reaches the datasets tf.distribute makes itself)."""
    from tensorflow.python.data.ops import multi_device_iterator_ops

    return multi_device_iterator_ops


def tf_distributed_dataset_class():
    """``input_lib.DistributedDataset``: the even-split fix replaces its
    ``_make_rebatch_fn`` (how a global batch is cut into the replicas' batches)."""
    from tensorflow.python.distribute import input_lib

    return input_lib.DistributedDataset


def tf_communication_options(extended):
    """The ``collective_util.Options`` a collective strategy's ``extended`` holds."""
    return extended._communication_options


def tf_set_communication_options(extended, options) -> None:
    """Replaces them (to merge tfdist's collective timeout in before initialisation)."""
    extended._communication_options = options


def tf_collectives_enabled(ctx=None) -> bool:
    """Whether this process's collective ops (and their gRPC server) are running."""
    ctx = tf_context() if ctx is None else ctx
    return tf_context_initialized(ctx) and ctx._collective_ops_server_def is not None


def tf_mark_server_started(extended) -> None:
    """Tells a collective strategy that the process's gRPC server already runs, so it
    shares it instead of starting a second one on the same port."""
    extended._std_server_started = True


def tf_wait_at_barrier(name: str, timeout_ms: int) -> None:
    """Waits until every worker of the job reaches barrier ``name`` (coordination service).

    Raises ``tf.errors.DeadlineExceededError`` naming the tasks that did not arrive.
    """
    tf_context().wait_at_barrier(name, timeout_ms)


def tf_check_peer_health(task: str, timeout_ms: int) -> None:
    """Probes task ``task`` (``/job:worker/replica:0/task:1``) of a multi-worker job.

    Raises ``tf.errors.UnavailableError`` when nothing answers there (the process is
    gone), another ``tf.errors.OpError`` when it answers late or is a restarted process.
    """
    tf_context().check_collective_ops_peer_health(task, timeout_in_ms=timeout_ms)


def tf_can_reduce_across_replicas_here() -> bool:
    """Whether code of a replica function runs in that function's own graph, where a
    cross-replica all-reduce may be issued; False inside a ``tf.cond`` or ``while`` branch
    or a nested ``tf.function``, where ``merge_call`` raises ("called while defining a new
    graph") and a collective could run on some replicas only. ``mirrored_run``'s replica
    threads (MirroredStrategy, MultiWorkerMirroredStrategy) record that graph as
    ``graph``; outside one, True."""
    import threading

    import tensorflow as tf

    graph = getattr(threading.current_thread(), "graph", None)
    return graph is None or tf.compat.v1.get_default_graph() is graph


def tf_maybe_merge_call(fn, strategy, *args) -> None:
    """``fn(strategy, *args)`` through ``merge_call``, or directly where the strategy runs
    without one (XLA on GPUs): how Keras' own TensorFlow optimizer reaches cross-replica
    context for its update, so the fix behaves alike under either mode."""
    from tensorflow.python.distribute import merge_call_interim

    merge_call_interim.maybe_merge_call(fn, strategy, *args)


def tf_distribute_lib():
    """tf.distribute's ``distribute_lib`` module: ``tfdist.unscoped`` wraps its check
    ``_require_cross_replica_or_default_context_extended``, through which a script's own
    strategy refuses to run while another strategy is the process default."""
    from tensorflow.python.distribute import distribute_lib

    return distribute_lib


def tf_process_default_scope():
    """The scope ``tf.distribute.experimental_set_strategy`` opened on the global graph, or
    None: whether (and with which strategy) a process default is set."""
    from tensorflow.python.framework import ops

    return getattr(ops.get_default_graph(), "_global_distribute_strategy_scope", None)


def tf_mirrored_extended_class():
    """MirroredStrategy's extended class: ``_make_collective_ops_with_fallbacks`` makes its
    ``CollectiveKeys`` from ``_collective_key_base`` (tfdist.compat.collective_keys)."""
    from tensorflow.python.distribute import mirrored_strategy

    return mirrored_strategy.MirroredExtended


def tf_collective_key_base(extended) -> int:
    """The base of a MirroredStrategy's collective group keys (0 unless set)."""
    return extended._collective_key_base


def tf_set_collective_key_base(extended, base: int) -> None:
    """Sets that base, before the strategy makes its collective keys."""
    extended._collective_key_base = base
