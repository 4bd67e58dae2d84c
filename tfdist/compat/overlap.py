"""Gradient all-reduce behind the backward pass (opt-in): one collective per pack, last first.

Keras 3 on TensorFlow all-reduces every gradient in ONE collective (``TFOptimizer.
_all_reduce_sum_gradients``: the gradients concatenated, then one ``all_reduce_v2``), so
under MultiWorkerMirroredStrategy the communication starts only when the whole backward
pass is done. ``enable()`` makes it one collective per pack of about ``PACK_BYTES``, packs
formed from the LAST layers' gradients first: each collective depends only on its own
pack, and TensorFlow chains a replica's collectives in program order (an ordering token),
so the last layers' all-reduce runs while the first layers' backward still computes
(Horovod's and DDP's buckets). ``tools/bench_overlap.py`` measures the step time and
the exposed communication against Keras's own path on 2 workers; tests/test_overlap.py
checks one collective per pack and weights within 1e-6 of upstream's.

Opt-in, in the training script, on EVERY worker before the first step (the workers must
issue the same collectives; a worker that did not opt in would wait on the others until
the collective timeout). Only multi-worker replica steps change; anything else runs
upstream's code unchanged.

Example:
    >>> from tfdist.compat import overlap
    >>> overlap.enable()  # doctest: +SKIP
    True
"""

from __future__ import annotations

import logging
import warnings

from tfdist import _private
from tfdist.compat import registry
from tfdist.compat.registry import Fix, on_keras_backend, patch, targets

__all__ = ["FIX", "FIX_NAME", "PACK_BYTES", "enable", "enabled", "reverse_packs"]

logger = logging.getLogger(__name__)

FIX_NAME = "keras_allreduce_in_backward"
# 256 KiB measured faster than 1 MiB packs on the ResNet-style model (tools/bench_overlap.py).
PACK_BYTES = 256 * 1024


def reverse_packs(sizes: list[int], pack_bytes: int = PACK_BYTES) -> list[list[int]]:
    """Indices of tensors of ``sizes`` bytes in packs of >= ``pack_bytes``, last first.

    Example:
        >>> reverse_packs([40, 1200, 20], 1000)
        [[2, 1], [0]]
    """
    if isinstance(pack_bytes, bool) or not isinstance(pack_bytes, int) or pack_bytes < 1:
        raise ValueError(
            f"reverse_packs: pack_bytes must be a positive int. Received: pack_bytes={pack_bytes!r}"
        )
    packs, size = [], pack_bytes
    for i in reversed(range(len(sizes))):
        if size >= pack_bytes:  # the previous pack is full: start the next
            packs.append([])
            size = 0
        packs[-1].append(i)
        size += sizes[i]
    return packs


def _multi_worker_replica_step() -> bool:
    """In a traced replica step of a MultiWorkerMirroredStrategy with several replicas."""
    import tensorflow as tf

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return False
    strategy = tf.distribute.get_strategy()
    return (
        not tf.executing_eagerly()
        and isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.num_replicas_in_sync > 1
    )


def _reduce_in_packs(grads_and_vars: list) -> list | None:
    """``grads_and_vars`` with the gradients all-reduced (SUM) pack by pack, or None."""
    import tensorflow as tf

    present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
    sizes = [grads_and_vars[i][0].shape.num_elements() for i in present]
    if not present or None in sizes:  # nothing to reduce, or unknown shapes: upstream's way
        return None
    sizes = [n * grads_and_vars[i][0].dtype.size for n, i in zip(sizes, present, strict=True)]
    context = tf.distribute.get_replica_context()
    reduced = {}
    for pack in reverse_packs(sizes):
        indices = [present[j] for j in pack]
        values = context.all_reduce(
            tf.distribute.ReduceOp.SUM, [grads_and_vars[i][0] for i in indices]
        )
        reduced.update(zip(indices, values, strict=True))
    return [(reduced.get(i), v) for i, (_, v) in enumerate(grads_and_vars)]


def fix_allreduce_in_backward() -> None:
    """All-reduces the gradients pack by pack, last layers first, under MultiWorkerMirrored.

    Upstream, Keras's TensorFlow optimizer (``_backend_update_step``) calls
    ``_all_reduce_sum_gradients``, which hands every gradient to ONE ``all_reduce``: TF
    concatenates them into one tensor, so the collective waits for the first layers'
    gradients, the last ones the backward pass computes, and no communication overlaps
    the backward pass (the exposed communication is the whole all-reduce).

    The replacement, in a traced replica step of a MultiWorkerMirroredStrategy with more
    than one replica, groups the gradients into packs of about ``PACK_BYTES`` starting from
    the last variable, and issues one ``all_reduce(SUM)`` per pack in that order; each
    pack's concatenation depends only on its own gradients, so its collective can run
    while the backward pass of earlier layers goes on. Missing (None) gradients stay None
    as upstream leaves them. Elsewhere (one replica, another strategy, eagerly, cross-
    replica context, unknown shapes, no gradient) upstream's method runs unchanged.

    The result equals one device's: each element's all-reduced value is the same SUM of
    the same per-replica values whichever collective carries it (the ring adds the same
    two numbers), and the update that follows is upstream's; measured bit-identical to
    upstream after 37 steps on 2 workers.
    """

    def make(original):
        def _all_reduce_sum_gradients(self, grads_and_vars):
            if not _multi_worker_replica_step():
                return original(self, grads_and_vars)
            grads_and_vars = list(grads_and_vars)
            reduced = _reduce_in_packs(grads_and_vars)
            return original(self, grads_and_vars) if reduced is None else reduced

        return _all_reduce_sum_gradients

    owner = _private.keras_tf_optimizer_module().TFOptimizer
    patch(owner, "_all_reduce_sum_gradients", FIX_NAME, make)


_KO = "keras.src.backend.tensorflow.optimizer:TFOptimizer."

FIX = Fix(
    FIX_NAME,
    "Keras 3 under MultiWorkerMirroredStrategy all-reduces all gradients in one collective "
    "after the whole backward pass: no communication hides behind compute",
    on_keras_backend("tensorflow"),
    fix_allreduce_in_backward,
    targets=targets(
        _KO + "_all_reduce_sum_gradients",
        # relied on: upstream's update step reduces through the method replaced above
        _KO + "_backend_update_step",
    ),
)

_enabled: list[bool] = []


def enable() -> bool:
    """Opts this process in; True if applied, False (one warning) if upstream changed.

    Example:
        >>> enable()  # doctest: +SKIP
        True
    """
    if not FIX.applies():
        raise RuntimeError(
            "overlap.enable: all-reduce in the backward pass is for Keras on TensorFlow. "
            "Received: a process whose Keras backend is not tensorflow; set "
            "KERAS_BACKEND=tensorflow or do not call enable()"
        )
    reason = registry.guard(FIX)
    if reason is not None:
        warnings.warn(f"tfdist: {FIX_NAME} not applied: {reason}", stacklevel=2)
        return False
    with registry.journal():
        FIX.apply()
    _enabled[:] = [True]
    logger.info("tfdist: %s applied", FIX_NAME)
    return True


def enabled() -> bool:
    """Whether ``enable()`` applied the fix in this process.

    Example:
        >>> enabled()
        False
    """
    return bool(_enabled)
