"""Custom loops on JAX (``stateless_call``/``stateless_apply`` under ``jax.jit``): the mesh
over every worker's devices, the replicated train state, global batches split over it.

Every worker passes the SAME global batch (what ``tfdist.data.pipeline`` yields on JAX)
and keeps only the rows its own devices hold.

Example:
    >>> state = replicate((model.trainable_variables, ...), on=mesh())  # doctest: +SKIP
    >>> x, y = shard_batch((images, labels), on=mesh())                 # doctest: +SKIP
"""

from __future__ import annotations

import keras
import numpy as np

from tfdist.core import validate

__all__ = ["BATCH_AXIS", "mesh", "to_host", "replicate", "shard_batch"]

BATCH_AXIS = "batch"


def mesh(axis_name: str = BATCH_AXIS):
    """A 1-D ``jax.sharding.Mesh`` over ``jax.devices()`` of EVERY worker (not local ones).

    Example:
        >>> mesh().devices.size  # 2 processes x 2 devices  # doctest: +SKIP
        4
    """
    import jax

    validate.instance(axis_name, str, "axis_name", "tfdist.loops.mesh", "a mesh axis name")
    return jax.sharding.Mesh(np.array(jax.devices()), (axis_name,))


def to_host(value) -> np.ndarray:
    """A host copy of a variable, a tensor or a jax array spanning processes.

    Example:
        >>> float(to_host(loss))  # a replicated scalar of a jitted step  # doctest: +SKIP
        0.93
    """
    value = getattr(value, "value", value)
    if not getattr(value, "is_fully_addressable", True):  # a jax array over processes
        if value.sharding.is_fully_replicated:
            return np.asarray(value.addressable_shards[0].data)  # each shard is the whole
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(keras.ops.convert_to_numpy(value))


def replicate(tree, *, on=None):
    """Places every leaf of ``tree`` (arrays, tensors, ``keras.Variable``s) whole on every
    device of ``mesh()`` (``NamedSharding`` with ``P()``): the train state.

    Every worker must pass the same values (they are built from the same seed, or
    restored from the same checkpoint).

    Example:
        >>> state = replicate(([v.value for v in model.trainable_variables], ...))  # doctest: +SKIP
    """
    import jax

    sharding = jax.sharding.NamedSharding(on or mesh(), jax.sharding.PartitionSpec())

    def place(leaf):
        value = to_host(leaf)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree_util.tree_map(place, tree, is_leaf=_is_variable)


def _is_variable(leaf) -> bool:
    return isinstance(leaf, keras.Variable)


def _process_rows(sharding, shape) -> slice:
    """The rows of a global batch of ``shape`` this process's devices hold."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0]
        starts.append(rows.start or 0)
        stops.append(shape[0] if rows.stop is None else rows.stop)
    first, last = min(starts), max(stops)
    if sum(b - a for a, b in sorted(set(zip(starts, stops, strict=True)))) != last - first:
        raise ValueError(
            f"tfdist.loops.shard_batch: this process's devices hold non-contiguous rows "
            f"{sorted(zip(starts, stops, strict=True))} of the batch. Received: shape={shape}. "
            "Use tfdist.loops.mesh(), which orders devices by process."
        )
    return slice(first, last)


def shard_batch(batch, *, on=None):
    """Places a GLOBAL batch split along its first axis over ``mesh()``'s devices.

    Every worker passes the same global batch (numpy arrays or tensors: what
    ``tfdist.data.pipeline`` yields on JAX, in every worker) and contributes only the
    rows its own devices hold (``jax.make_array_from_process_local_data``).

    Raises:
        ValueError: the batch's first axis is not divisible by the mesh's devices.

    Example:
        >>> x, y = shard_batch((images, labels))  # global arrays, 1/N per device  # doctest: +SKIP
    """
    import jax

    grid = on or mesh()
    sharding = jax.sharding.NamedSharding(grid, jax.sharding.PartitionSpec(grid.axis_names[0]))
    devices = grid.devices.size

    def place(leaf):
        value = np.asarray(keras.ops.convert_to_numpy(leaf))
        if value.ndim == 0 or value.shape[0] % devices:
            raise ValueError(
                f"tfdist.loops.shard_batch: every array's first axis must be divisible by "
                f"the {devices} devices of the mesh. Received: shape={value.shape}. Use a "
                "global batch that is a multiple of the devices (drop_remainder=True)."
            )
        rows = _process_rows(sharding, value.shape)
        return jax.make_array_from_process_local_data(sharding, value[rows], value.shape)

    return jax.tree_util.tree_map(place, batch)
