"""The JAX backend: ``keras.distribution`` (DataParallel, ModelParallel) over jax's devices.

``scope()`` sets a ``DataParallel`` over every device of the job (all processes), or a
``ModelParallel`` when given a ``layout_map`` (and optionally its ``mesh``), and restores
the previous distribution on exit. Replicas are the size of the mesh's data axis; the
chief is process 0. Multi-process jobs (``tfdist launch`` sets ``KERAS_DISTRIBUTION_*``)
are initialised once, at start-up, with tfdist's timeouts (see ``tfdist.startup``).

Batches: a dataset given to ``fit`` holds GLOBAL batches on every process; Keras's own
``distribute_dataset`` (``auto_shard_dataset=True``) gives each process its share of
each batch. tfdist's pipelines produce global batches and leave the sharding to Keras.

Example:
    >>> with tfdist.scope():                                    # doctest: +SKIP
    ...     model = build_and_compile()                         # DataParallel
    >>> mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])  # doctest: +SKIP
    >>> layout = keras.distribution.LayoutMap(mesh)             # doctest: +SKIP
    >>> layout["dense.*kernel"] = (None, "model")               # doctest: +SKIP
    >>> with tfdist.scope(layout_map=layout):                   # doctest: +SKIP
    ...     model = build_and_compile()                         # ModelParallel
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping

import jax
import keras
import numpy as np
from keras import distribution as kd

from tfdist.backends import StoreGone, layouts
from tfdist.core import config, process, roles, upstream, validate
from tfdist.core.config import ConfigError

__all__ = [
    "NAME",
    "distribution",
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
    "data_axis",
]

logger = logging.getLogger(__name__)

NAME = "jax"


def _check_cpu_devices() -> None:
    wanted = config.cpu_devices()
    if wanted and jax.default_backend() == "cpu" and jax.local_device_count() != wanted:
        raise RuntimeError(
            f"tfdist: TFDIST_CPU_DEVICES={wanted}, but jax started with "
            f"{jax.local_device_count()} CPU device(s). Import tfdist before jax (or keras), "
            "or set JAX_NUM_CPU_DEVICES before the process starts."
        )


def _check_layout_map(layout_map, mesh):
    validate.instance(
        layout_map, kd.LayoutMap, "layout_map", "scope", "a keras.distribution.LayoutMap"
    )
    if mesh is not None:
        validate.instance(mesh, kd.DeviceMesh, "mesh", "scope", "a keras.distribution.DeviceMesh")
        if mesh is not layout_map.device_mesh:
            raise ValueError(
                "scope: mesh must be the mesh the layout_map was built on. Received: "
                f"mesh={mesh}, layout_map.device_mesh={layout_map.device_mesh}. "
                "Pass keras.distribution.LayoutMap(mesh)."
            )
    devices = len(jax.devices())
    mesh = layout_map.device_mesh
    if mesh.devices.size != devices:
        shape = dict(zip(mesh.axis_names, mesh.shape, strict=True))
        raise ConfigError(
            f"scope: the mesh {shape} has {mesh.devices.size} devices, but the job has "
            f"{devices}. Build the DeviceMesh over keras.distribution.list_devices()."
        )


def _device(name_or_device):
    """A jax device from a ``keras.distribution`` device name ("cpu:3") or a device."""
    if not isinstance(name_or_device, str):
        return name_or_device
    platform, _, index = name_or_device.partition(":")
    for device in jax.devices():
        if device.platform == platform and device.id == int(index):
            return device
    raise ConfigError(f"scope: the mesh names device {name_or_device!r}, which jax does not have.")


def _check_batch_axis_follows_processes(mesh, axis: str) -> None:
    """Keras feeds process p the p-th slice of every global batch (or all of it when the
    batch axis is 1): the devices of process p must hold exactly those batch rows. A mesh
    built in another order (e.g. its columns across processes) would train on the wrong
    rows, silently: refused here."""
    processes = roles.jax_process().count
    rows = mesh.shape[mesh.axis_names.index(axis)]
    if processes == 1 or rows == 1:
        return
    grid = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(axis), 0)
    owners = [{_device(d).process_index for d in np.ravel(grid[row])} for row in range(rows)]
    for rank in range(processes):
        held = [row for row in range(rows) if rank in owners[row]]
        if rows >= processes:
            expected = list(range(rank * rows // processes, (rank + 1) * rows // processes))
        else:
            expected = [rank // (processes // rows)]
        if held != expected:
            shape = dict(zip(mesh.axis_names, mesh.shape, strict=True))
            raise ConfigError(
                f"scope: on the mesh {shape}, process {rank}'s devices hold rows {held} of "
                f"the batch axis {axis!r}, but Keras feeds process {rank} the rows "
                f"{expected} of each global batch, so it would train on the wrong examples. "
                "Build the DeviceMesh over keras.distribution.list_devices() in its order "
                "(process by process) with the batch axis first, e.g. DeviceMesh((2, 2), "
                "['batch', 'model'], devices=keras.distribution.list_devices())."
            )


def distribution(
    *,
    mesh=None,
    layout_map=None,
    batch_dim_name: str | None = None,
    allow_unmatched_keys: bool = False,
):
    """The ``keras.distribution`` tfdist would set: DataParallel, or ModelParallel.

    Args:
        mesh: the ``DeviceMesh`` of a ``layout_map`` (optional, checked when given).
        layout_map: a ``keras.distribution.LayoutMap``: model parallel with its regex keys.
        batch_dim_name: the mesh axis that splits the batch (default: the first axis).
        allow_unmatched_keys: accept ``layout_map`` keys that match no variable (keys
            meant for other models); by default such a key is an error (``tfdist.backends.layouts``).

    Example:
        >>> distribution().device_mesh.shape  # doctest: +SKIP
        (4,)
    """
    _check_cpu_devices()
    validate.instance(allow_unmatched_keys, bool, "allow_unmatched_keys", "scope", "a bool")
    if layout_map is None:
        if mesh is not None or batch_dim_name is not None:
            raise ValueError(
                "scope: mesh and batch_dim_name need a layout_map (model parallel). "
                f"Received: mesh={mesh}, batch_dim_name={batch_dim_name!r}, layout_map=None."
            )
        return kd.DataParallel(devices=kd.list_devices())
    _check_layout_map(layout_map, mesh)
    axis = batch_dim_name or layout_map.device_mesh.axis_names[0]
    validate.one_of(axis, tuple(layout_map.device_mesh.axis_names), "batch_dim_name", "scope")
    _check_batch_axis_follows_processes(layout_map.device_mesh, axis)
    return layouts.ModelParallel(
        layout_map=layout_map, batch_dim_name=axis, allow_unmatched_keys=allow_unmatched_keys
    )


def _warn_communication() -> None:
    """TFDIST_ALLREDUCE / TFDIST_BYTES_PER_PACK are TensorFlow's: say so, never ignore silently.

    Under JAX the all-reduce is XLA's, planned by the compiler (NCCL on GPUs, gloo between
    CPU processes), and it fuses gradients itself; there is nothing to set per job.
    """
    comm = config.Communication.from_env()
    if not comm.is_default:
        logger.warning(
            "tfdist: %s has no effect on the JAX backend (XLA chooses and fuses the "
            "all-reduce itself); unset %s and %s.",
            comm,
            config.ALLREDUCE_ENV,
            config.BYTES_PER_PACK_ENV,
        )


@contextlib.contextmanager
def scope(
    *,
    mesh=None,
    layout_map=None,
    batch_dim_name: str | None = None,
    allow_unmatched_keys: bool = False,
    **ignored,
):
    """Sets tfdist's distribution inside the block and restores the previous one after.

    Example:
        >>> with scope():  # doctest: +SKIP
        ...     model = keras.Sequential([keras.layers.Dense(1)])
    """
    if ignored:
        raise TypeError(
            f"scope: {sorted(ignored)} are TensorFlow-backend options. Received: {ignored}. "
            "Under KERAS_BACKEND=jax pass mesh=, layout_map= or batch_dim_name=."
        )
    chosen = distribution(
        mesh=mesh,
        layout_map=layout_map,
        batch_dim_name=batch_dim_name,
        allow_unmatched_keys=allow_unmatched_keys,
    )
    _warn_communication()
    _check_pipeline_batches(data_axis(chosen))
    st = process.state()
    previous = kd.distribution()
    with st.lock:
        st.distribution = (type(chosen).__name__, chosen)
    kd.set_distribution(chosen)
    try:
        yield chosen
    finally:
        kd.set_distribution(previous)
    # Reached only when the block ended normally: an error inside it is the user's news.
    if isinstance(chosen, layouts.ModelParallel):
        chosen.check_at_scope_exit()


def _check_pipeline_batches(replicas: int) -> None:
    """Pipelines built before this scope, against its data axis (``replicas``).

    A ``global_batch`` must divide between the replicas; a pipeline sized with
    ``per_replica_batch`` for another number of replicas (built before a ModelParallel
    scope, it counted every device as a replica) has another global batch than meant.
    """
    for batch, built_for, per_replica_given in list(process.state().batch_plans.values()):
        if built_for == replicas:
            continue
        if not per_replica_given and batch % replicas:
            raise ValueError(
                f"tfdist.scope: a pipeline's global_batch={batch} does not divide between "
                f"this distribution's {replicas} data-parallel replicas. Received: "
                f"global_batch={batch}. Build it with a multiple of {replicas}."
            )
        if per_replica_given:
            logger.warning(
                "tfdist.scope: a pipeline built for %d replicas has global batch %d "
                "(%d per replica); this distribution has %d data-parallel replicas, so "
                "each gets %d examples, not %d. Build the pipeline inside the scope, or "
                "size it with pipeline(..., global_batch=N).",
                built_for,
                batch,
                batch // built_for,
                replicas,
                batch // replicas,
                batch // built_for,
            )


def current(explicit=None):
    """An explicit distribution, else the one set now, else tfdist's (DataParallel)."""
    if explicit is not None:
        return validate.instance(
            explicit,
            (kd.DataParallel, kd.ModelParallel),
            "strategy",
            "tfdist",
            "a keras.distribution DataParallel or ModelParallel",
        )
    active = kd.distribution()
    if active is not None:
        return active
    created = process.state().distribution
    return created[1] if created else distribution()


def data_axis(dist) -> int:
    """The size of the mesh axis that splits the batch (the data-parallel size)."""
    mesh = dist.device_mesh
    name = getattr(dist, "batch_dim_name", None) or mesh.axis_names[0]
    return int(mesh.shape[list(mesh.axis_names).index(name)])


def num_replicas(explicit=None) -> int:
    """Data-parallel replicas: the size of the data axis of the mesh."""
    return data_axis(current(explicit))


def num_workers(explicit=None) -> int:
    """Processes in the job (``jax.process_count()``)."""
    return roles.jax_process().count


def worker_index(explicit=None) -> int:
    """This process's index (``jax.process_index()``); 0 is the chief."""
    return roles.jax_process().rank


def barrier(name: str, timeout: float) -> None:
    """Waits until every process reaches barrier ``name``; nothing to wait for in one."""
    if roles.jax_process().count == 1:
        return
    try:
        upstream.jax_wait_at_barrier(f"tfdist/{name}", int(timeout * 1000))
    except Exception as err:  # jax raises its runtime's own error types
        raise RuntimeError(
            f"tfdist.barrier({name!r}): not every process arrived within {timeout:.0f} s "
            f"({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}). "
            "Every process must make the same tfdist calls in the same order."
        ) from None


def chief_value(name: str, value: int, timeout: float, explicit=None) -> int:
    """Process 0's ``value``, on every process (through jax's coordination store).

    Every process must make the same calls in the same order: the n-th call of each
    process reads the n-th value process 0 published.

    Example:
        >>> chief_value("shuffle seed", 1804289383, timeout=60)  # doctest: +SKIP
        1804289383
    """
    role = roles.jax_process()
    if role.count == 1:
        return value
    state = process.state()
    with state.lock:
        state.chief_values += 1
        key = f"tfdist/{name}/{state.chief_values}"
    if role.is_chief:
        upstream.jax_key_value_set(key, str(value))
        return value
    try:
        return int(upstream.jax_key_value_get(key, int(timeout * 1000)))
    except Exception as err:  # jax raises its runtime's own error types
        first = str(err).strip().splitlines()
        raise TimeoutError(
            f"tfdist: process {role.rank} did not receive process 0's {name} "
            f"within {timeout:.0f} s ({first[0] if first else type(err).__name__})."
        ) from None


def gather_rows(row, explicit=None) -> np.ndarray | None:
    """Every process's ``row`` (small ints), one each, on every process; None in one.

    Example:
        >>> gather_rows((2, 50, 0))  # two processes  # doctest: +SKIP
        array([[2, 50, 0], [2, 50, 0]], dtype=int32)
    """
    if roles.jax_process().count == 1:
        return None
    from jax.experimental import multihost_utils

    # int32: jax without x64 would narrow int64 with a warning; the rows are small.
    rows = multihost_utils.process_allgather(np.array([row], np.int32), tiled=True)
    return np.asarray(rows)


def key_value_set(key: str, value: str) -> bool:
    """Publishes ``key=value`` in jax's distributed runtime store; False when another
    process set ``key`` first. Raises StoreGone when the runtime is gone."""
    try:
        upstream.jax_key_value_set(key, value)
    except Exception as err:  # jax raises its runtime's one error type: tell by status
        if "ALREADY_EXISTS" in str(err):
            return False
        raise StoreGone(str(err)) from err
    return True


def key_value_get(key: str, timeout: float) -> str | None:
    """The value of ``key`` in jax's distributed runtime store, or None when it is not set
    within ``timeout`` seconds. Raises StoreGone when the runtime is gone."""
    try:
        return upstream.jax_key_value_get(key, round(timeout * 1000))
    except Exception as err:  # jax raises its runtime's one error type: tell by status
        if "DEADLINE_EXCEEDED" in str(err):
            return None
        raise StoreGone(str(err)) from err


def phantom_prone_variables(model) -> list:
    """Empty: a JAX train step runs only once Python holds its batch, so no step runs
    after the data ends (and reading variables mid-epoch would force a host sync)."""
    return []


def saves_sharded() -> bool:
    """True: the variables are ``jax.Array``s, which Orbax writes shard by shard."""
    return True


def splits_uneven_batches() -> bool:
    """False: Keras on JAX splits every batch evenly between the devices (and, with
    ``keras_jax_partial_batch_share``, between the processes)."""
    return False


def is_chief() -> bool:
    """Whether this is process 0."""
    return roles.jax_process().is_chief


def topology(environ: Mapping[str, str] | None = None) -> dict:
    """Devices and the mesh tfdist's scope would use (nothing is set)."""
    env = os.environ if environ is None else environ
    dist = distribution()
    mesh = dist.device_mesh
    return {
        "devices": {
            "platform": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()],
            "local_devices": jax.local_device_count(),
            config.CPU_DEVICES_ENV: env.get(config.CPU_DEVICES_ENV) or None,
        },
        "strategy": {
            "kind": type(dist).__name__,
            "num_replicas": data_axis(dist),
            "mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.shape), strict=True)),
            "num_workers": roles.jax_process().count,
        },
        "keras": keras.__version__,
    }
