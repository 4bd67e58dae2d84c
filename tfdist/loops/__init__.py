"""Custom training loops in the TensorFlow and Keras-JAX guides' style, on 1 device, N
devices and N workers with the same result, and their exact resume.

TensorFlow (``strategy.run``): ``distribute(pipeline)`` hands a ``tfdist.data.pipeline``
of GLOBAL batches to tfdist's strategy; ``average_loss(per_example_loss)`` divides by
the step's global batch (summed over replicas, so a short last batch counts right).

JAX (``model.stateless_call``/``optimizer.stateless_apply`` under ``jax.jit``): ``mesh()``
spans ``jax.devices()`` of every worker; ``replicate(tree)`` places the train state
replicated on it; ``shard_batch(batch)`` places a global batch split along its first
axis. Every worker passes the SAME global batch (what ``tfdist.data.pipeline`` yields
on JAX) and keeps only the rows its own devices hold.

``Checkpointer`` gives a loop ``make_or_restore``'s guarantees: atomic ``.keras``
archives written by the chief only (with the optimizer state, the step and the RNG
state in extra members), a damaged newest archive skipped for the previous one, every
worker agreeing on what it restores, the data pipeline moved to the step's batch, and
SIGTERM turned into a save at an agreed step and exit ``RESTART_EXIT_CODE`` (75).
docs/custom_loops.md has both recipes; tests/test_custom_loops.py runs them.

Example:
    >>> ckpt = Checkpointer("ckpt/", model=model, optimizer=opt, pipeline=train)  # doctest: +SKIP
    >>> step = ckpt.restore()                                                    # doctest: +SKIP
    >>> ckpt.maybe_save(step, every=100)                                         # doctest: +SKIP
"""

from __future__ import annotations

from tfdist.loops.checkpointer import OPTIMIZER_MEMBER, Checkpointer
from tfdist.loops.jax import mesh, replicate, shard_batch, to_host
from tfdist.loops.tensorflow import average_loss, distribute

__all__ = [
    "distribute",
    "average_loss",
    "mesh",
    "replicate",
    "shard_batch",
    "to_host",
    "Checkpointer",
    "OPTIMIZER_MEMBER",
]
