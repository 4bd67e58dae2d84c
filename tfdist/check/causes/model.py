"""Causes in the model and its step: a loss averaged per replica, a sum over the batch axis,
unsynchronized BatchNormalization, random layers drawing apart on each replica.

Example:
    >>> [c.cause for c in batchnorm(verdicts, reference, rerun, 1e-5)]  # doctest: +SKIP
    ['batchnorm']
"""

from __future__ import annotations

from tfdist.check.causes import evidence
from tfdist.check.causes.evidence import Cause, Rerun
from tfdist.check.compare import compare
from tfdist.check.runner import Run
from tfdist.check.verdict import Verdict

__all__ = ["loss_per_replica", "batch_sum", "batchnorm", "random_layers", "random_steps"]


# A first update this close to R times one device's (relative to R), along one device's
# (relative residual), is named: rounding gives ~1e-6; other causes change its direction.
_SCALE_CLOSE = 1e-2


def loss_per_replica(verdicts: list[Verdict], reference: Run, tolerance: float) -> list[Cause]:
    """Differing topologies whose first update is R times one device's (R replicas)."""
    shown = []
    for verdict in evidence.several_replicas_differing(verdicts):
        rank = verdict.run.ranks[verdict.rank]
        replicas = rank.facts.get("replicas") or verdict.run.topology.count
        found = _update_scale(reference.ranks[0], rank, tolerance)
        if found and abs(found[0] - replicas) <= _SCALE_CLOSE * replicas:
            if found[1] <= _SCALE_CLOSE:
                shown.append(
                    f"{verdict.name} ({replicas} replicas): its first update is "
                    f"{found[0]:.3f} times one device's, from the same initial weights "
                    f"(all the model's variables together, residual {found[1]:.1e})"
                )
    if not shown:
        return []
    return [
        Cause(
            "loss_per_replica",
            "; ".join(shown) + ": the loss is averaged over each replica's own batch "
            "(tf.reduce_mean of the per-example loss inside strategy.run) and the replicas' "
            "gradients are summed, so every step moves R times as far as on one device",
            "average the loss over the GLOBAL batch: tfdist.loops.average_loss("
            "per_example_loss), or tf.nn.compute_average_loss(per_example_loss, "
            "global_batch_size=GLOBAL_BATCH) with a Keras loss built with reduction=None; "
            "regularization losses through tf.nn.scale_regularization_loss",
        )
    ]


def _update_scale(reference, rank, tolerance: float) -> tuple[float, float] | None:
    """``(s, residual)``: the first update of ``rank`` is ``s`` times the reference's,
    off that line by ``residual`` (relative); None without both first updates or when
    the initial weights differ."""
    import numpy as np

    keys = sorted(reference.initial.keys() & reference.first.keys() & rank.first.keys())
    if not keys or not compare(reference.initial, rank.initial).equal(tolerance):
        return None
    ours = np.concatenate([np.ravel(reference.first[k] - reference.initial[k]) for k in keys])
    theirs = np.concatenate([np.ravel(rank.first[k] - rank.initial[k]) for k in keys])
    ours, theirs = ours.astype(np.float64), theirs.astype(np.float64)
    norm = float(ours @ ours)
    if not norm or not np.all(np.isfinite(theirs)):
        return None
    scale = float(theirs @ ours) / norm
    residual = float(np.linalg.norm(theirs - scale * ours)) / max(abs(scale), 1e-12) / norm**0.5
    return scale, residual


# A model's outputs or loss on one batch, split in replica parts, that change by more than
# this (relative) are named: examples computed apart change by rounding (measured 0 for
# the outputs and up to 5e-8 for a loss); a sum over the batch axis by 1e-3 and more.
_SPLIT_CLOSE = 1e-4


def batch_sum(verdicts: list[Verdict], reference: Run) -> list[Cause]:
    """Differing TensorFlow topologies of R replicas where the reference's model or loss
    on its first batch changes when that batch is split in R parts (``batch_split``)."""
    if reference.topology.backend != "tensorflow":
        return []  # on JAX the model and its loss see the global batch as one array
    split = reference.ranks[0].facts.get("batch_split") or {}
    names: dict[int, list[str]] = {}
    for verdict in evidence.several_replicas_differing(verdicts):
        rank = verdict.run.ranks[verdict.rank]
        replicas = rank.facts.get("replicas") or verdict.run.topology.count
        names.setdefault(replicas, []).append(verdict.name)
    shown = []
    for replicas, topologies in sorted(names.items()):
        found = split.get(str(replicas)) or {}
        outputs, loss = found.get("outputs") or 0.0, found.get("loss") or 0.0
        if outputs > _SPLIT_CLOSE:
            seen = (
                f"the model's outputs change by {outputs:.1e} (relative): its call mixes "
                "the examples of a batch (a sum or mean over the batch axis)"
            )
        elif loss > _SPLIT_CLOSE:  # the same outputs: the loss alone
            seen = (
                f"its outputs do not, but the loss as Keras combines the replicas' losses "
                f"changes by {loss:.1e} (relative): a loss that is not a mean of "
                "per-example terms (Keras sums the replicas' values of a loss that "
                "returns one scalar, and averages those of per-example losses)"
            )
        else:
            continue
        shown.append(
            f"{', '.join(topologies)} ({replicas} replicas): on 1 device's first batch, "
            f"whole against split in {replicas} parts as the replicas get it, {seen}"
        )
    if not shown:
        return []
    return [
        Cause(
            "batch_sum",
            "; ".join(shown) + ". On TensorFlow each replica computes over its own part "
            "of the global batch, so an operation across the batch axis sees fewer "
            "examples than on one device",
            "compute every example apart in call (no ops.sum/ops.mean/tensordot over "
            "axis 0), or take batch-wide values across the replicas; return per-example "
            "losses (shape (batch,)) and let Keras average them",
        )
    ]


def batchnorm(verdicts, reference: Run, rerun: Rerun, tolerance: float) -> list[Cause]:
    unsynced = reference.ranks[0].facts.get("unsynchronized", [])
    differing = evidence.several_replicas_differing(verdicts)
    if not unsynced or not differing or reference.topology.backend != "tensorflow":
        return []
    shown = evidence.rerun_shown(
        differing, reference, rerun, tolerance, "sync_batchnorm", "synchronized"
    )
    return [
        Cause(
            "batchnorm",
            f"unsynchronized BatchNormalization layers {unsynced}: each replica normalises "
            "with its own part of the batch; " + shown,
            "build the model inside tfdist.scope(sync_batchnorm=True), or pass "
            "synchronized=True to each BatchNormalization",
        )
    ]


def random_layers(verdicts, reference: Run, rerun: Rerun, tolerance: float) -> list[Cause]:
    """Random layers that draw on every replica apart, shown by a re-run with them inert."""
    random = reference.ranks[0].facts.get("random", [])
    differing = evidence.several_replicas_differing(verdicts)
    if not random or not differing:
        return []
    # Inert layers change one device's training too: the re-runs are compared with one
    # device's re-run, not with the script's reference.
    inert_reference = rerun(reference.topology, "inert_random")
    if inert_reference.status != "done":
        shown = f"1 device with them inert: {inert_reference.status} (no comparison)"
    else:
        shown = "1 device re-run with them inert as the reference; " + evidence.rerun_shown(
            differing, inert_reference, rerun, tolerance, "inert_random", "inert"
        )
        made = inert_reference.ranks[0].facts.get("inert", [])
        left = [name for name in random if name not in made]
        if left:  # a call without a training argument: nothing to switch off
            shown += f"; not made inert (their call takes no training argument): {left}"
    return [
        Cause(
            "random_layers",
            f"random layers {random} (dropout, noise or augmentation): on several replicas "
            "each replica draws for its own part of the batch, so no step draws what one "
            "device draws; " + shown,
            "not a defect in itself: the draws are random on one device too, and the model "
            "trains as well. To compare a script with this check, make the layers draw "
            "nothing (rate=0, or a flag that leaves them out) and check again; or accept "
            "the difference. A topology still differing with them inert has another cause",
        )
    ]


def random_steps(verdicts) -> list[Cause]:
    """Models whose own ``train_step`` draws random numbers (a ``SeedGenerator`` they hold),
    on a differing topology of several replicas."""
    differing = evidence.several_replicas_differing(verdicts)
    models = sorted(
        {
            m
            for v in differing
            for r in v.run.ranks.values()
            for m in r.facts.get("random_steps", [])
        }
    )
    if not models:
        return []
    names = ", ".join(v.name for v in differing)
    return [
        Cause(
            "random_steps",
            f"{names}: the model(s) {models} hold a keras.random.SeedGenerator, so their own "
            "train_step draws random numbers (latent vectors, noise); on several replicas each "
            "replica draws for its own part of the batch, so no step draws what one device draws",
            "not a defect in itself: the draws are random on one device too. To compare a "
            "script with this check, make its step draw nothing (a flag, or fixed inputs) and "
            "check again; or accept the difference",
        )
    ]
