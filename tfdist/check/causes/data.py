"""Causes in the data each replica or worker reads: a partial last batch, a ``tf.data`` input
not sharded, workers that start from other weights or see other data.

Example:
    >>> [c.cause for c in unsharded(verdicts)]  # doctest: +SKIP
    ['unsharded_data']
"""

from __future__ import annotations

from tfdist.check.causes import evidence
from tfdist.check.causes.evidence import Cause
from tfdist.check.compare import compare
from tfdist.check.runner import Run
from tfdist.check.verdict import Verdict

__all__ = ["partial_batch", "unsharded", "workers"]


def partial_batch(verdicts: list[Verdict], reference: Run, tolerance: float) -> list[Cause]:
    """A difference that starts at an epoch's last step, whose batch is partial: in the
    values logged for that step, or in its update (then the weights differ, and so do
    the values logged from the next step on)."""
    facts = reference.ranks[0].facts
    per_epoch, batch, last = facts.get("steps_per_epoch"), facts.get("batch"), facts.get("last")
    if not per_epoch or (batch and last == batch):
        return []  # unknown epochs, or every batch full: not this cause
    # A last batch the replicas share evenly (20 as 10 + 10) trains as on one device: the
    # mean of equal parts' means is the batch's mean. Only an uneven share is evidence.
    split = [
        v
        for v in evidence.several_replicas_differing(verdicts)
        if not batch or (last or 0) % evidence.replicas_of(v)
    ]
    # Where the last batch's size is unknown, only a difference in that step's own values.
    found: list[tuple[Verdict, int]] = []
    for verdict in split:
        step = _partial_step(verdict, per_epoch, tolerance, bool(batch))
        if step:
            found.append((verdict, step))
    if not found:
        return []
    size = (
        f"whose batch holds {last} of {batch} examples"
        if batch
        else "whose size fit's input did not tell"
    )
    shown = []
    for verdict, step in found:
        steps = evidence.differing_steps(verdict, reference, tolerance)
        shown.append(
            f"{verdict.name}: step {step} is the last of epoch {step // per_epoch} "
            f"({per_epoch} steps per epoch), {size}; {_partial_where(verdict, step, tolerance)}"
            + (f"; logged values differ at steps {steps}" if steps else "")
        )
    return [
        Cause(
            "partial_batch",
            "a partial last batch split between the replicas: " + "; ".join(shown),
            "make every batch full: drop the remainder (tf.data's batch(..., "
            "drop_remainder=True); tfdist.data.pipeline drops it when shuffling), or a "
            "dataset size divisible by the global batch; with tfdist's fixes on (none "
            "excluded by TFDIST_COMPAT_EXCLUDE) a partial batch of a Keras loss trains "
            "as on one device on TensorFlow",
        )
    ]


def _partial_where(verdict: Verdict, step: int, tolerance: float) -> str:
    """Where the partial step's difference shows, in words true of this verdict."""
    weights_equal = verdict.weights is not None and verdict.weights.equal(tolerance)
    worst = f" (worst {verdict.weights.key} {verdict.weights.value:.1e})" if verdict.weights else ""
    if verdict.first_step == step:
        where = f"the logged values first differ at step {step}"
        return where + (
            f"; the weights after the steps are equal{worst}: only the logged values differ"
            if weights_equal
            else "; the weights differ from there"
        )
    if verdict.first_step:  # the values logged after it: its update differs
        return (
            f"its update differs: the values logged for it are equal, those from step "
            f"{verdict.first_step} on are not, and the weights "
            + ("after the steps are equal" if weights_equal else "differ")
        )
    return (
        "its update differs: every logged value is equal, and the run ended at that "
        f"step with other weights{worst}"
    )


def _partial_step(verdict: Verdict, per_epoch: int, tolerance: float, known: bool) -> int | None:
    """The epoch's last step where ``verdict``'s difference starts, or None: the values
    logged for it differ, or (``known``: that batch is known to be partial) its update
    does (a step logs its loss before updating, so that shows in the next step's values,
    or only in the weights when the run ended there)."""
    if verdict.status != "differs":
        return None
    first = verdict.first_step
    if first and first % per_epoch == 0:
        return first
    if not known:
        return None
    if first and first > 1 and (first - 1) % per_epoch == 0:
        return first - 1
    weights_differ = verdict.weights is not None and not verdict.weights.equal(tolerance)
    if not first and weights_differ and verdict.steps and verdict.steps % per_epoch == 0:
        return verdict.steps
    return None


def unsharded(verdicts: list[Verdict]) -> list[Cause]:
    """Differing workers whose tf.data input turns auto-sharding off."""
    for verdict in verdicts:
        if verdict.status != "differs" or verdict.run.topology.kind != "worker":
            continue
        off = [r for r, rank in sorted(verdict.run.ranks.items()) if _policy(rank) == "OFF"]
        if off:
            return [
                Cause(
                    "unsharded_data",
                    f"{verdict.name} differs and the tf.data input of process(es) {off} "
                    "sets AutoShardPolicy.OFF: every worker reads the whole dataset rather "
                    "than its share, so the workers train on the same examples where one "
                    "device trains on all of them",
                    "leave the auto-shard policy to TensorFlow (AUTO) or set DATA, or build "
                    "the input with tfdist.data.pipeline (it sets the policy); with OFF, "
                    "shard it yourself: dataset.shard(num_workers, worker_index) before batch",
                )
            ]
    return []


def _policy(rank) -> str | None:
    return rank.facts.get("shard_policy")


def workers(verdicts: list[Verdict], reference: Run, tolerance: float) -> list[Cause]:
    devices = [v for v in verdicts if v.run.topology.kind == "device" and v.run.topology.count > 1]
    workers = [v for v in verdicts if v.run.topology.kind == "worker" and v.status == "differs"]
    if not workers or not devices or any(v.status != "equal" for v in devices):
        return []
    verdict = workers[0]
    for rank, result in sorted(verdict.run.ranks.items()):
        start = compare(reference.ranks[0].initial, result.initial)
        if not start.reason and not start.equal(tolerance):
            return [_seeds(verdict, devices[0], rank, start)]
    step = f"the loss differs from step {verdict.first_step}" if verdict.first_step else ""
    if _jax_loop(verdict):
        return [_jax_loop_data(verdict, devices[0], step)]
    return [
        Cause(
            "worker_data",
            f"{devices[0].name} equal but {verdict.name} not; every worker started from the "
            f"reference's initial weights, and {step or 'its weights differ'}: the workers "
            f"train on other data than their share of the global batch ({_given(verdict)})",
            "give every worker the same data, order and seed, and let tfdist shard it: "
            "keras.utils.set_random_seed(0) and tfdist.data.pipeline(dataset, "
            "per_replica_batch=..., seed=0) on every worker",
        )
    ]


def _jax_loop(verdict: Verdict) -> bool:
    return verdict.run.topology.backend == "jax" and bool(
        verdict.run.ranks[verdict.rank].facts.get("loop")
    )


def _jax_loop_data(verdict: Verdict, devices: Verdict, step: str) -> Cause:
    """``worker_data`` for a JAX custom loop: its processes' global batches differ."""
    return Cause(
        "worker_data",
        f"{devices.name} equal but {verdict.name} not; every process started from the "
        f"reference's initial weights, and {step or 'its weights differ'}: the processes "
        "train on other examples than one device. A JAX loop's step takes each process's "
        "rows of ONE global batch (tfdist.loops.shard_batch, jax.make_array_from_process_"
        "local_data): data sliced per process before it (jax.process_index()), or shuffled "
        "or seeded per process, gives each process another global batch",
        "give every process the same global batches, and let shard_batch keep its rows: "
        "tfdist.data.pipeline((x, y), global_batch=..., seed=0) over the whole data in "
        "every process, then tfdist.loops.shard_batch(batch)",
    )


def _given(verdict: Verdict) -> str:
    """What the processes' fit inputs say: other arrays, the same ones, or unknown."""
    prints = {r: rank.facts.get("fingerprint") for r, rank in sorted(verdict.run.ranks.items())}
    if None in prints.values() or len(prints) < 2:
        return (
            "a dataset not sharded, or a shuffle, augmentation or dropout seeded from the "
            "worker index"
        )
    if len(set(prints.values())) > 1:
        shown = ", ".join(f"process {r} {p}" for r, p in prints.items())
        return f"fit was given other arrays on each worker: fingerprints {shown}"
    return (
        "every worker was given the same arrays (fingerprint "
        f"{prints[0]}): a shuffle, augmentation or dropout seeded from the worker index"
    )


def _seeds(verdict: Verdict, devices: Verdict, rank: int, start) -> Cause:
    return Cause(
        "worker_seeds",
        f"{devices.name} equal but {verdict.name} not; process {rank} started from other "
        f"initial weights ({start.key} differs by {start.value:.1e}): its random seed "
        "differs from the reference's (a seed from the worker index, or none)",
        "seed every worker alike, e.g. keras.utils.set_random_seed(0) on every worker, "
        "and data order from the same seed",
    )
