"""Likely causes of a difference, each shown with evidence the check gathered itself.

- ``failed``: a run that crashed, with the last lines of its output.
- ``hang``: a run that did not finish its steps within the timeout; where each process
  waited (its stack's innermost line of the script) or how far it got.
- ``batchnorm``: unsynchronized ``BatchNormalization`` layers on TensorFlow, and a re-run
  of a differing topology with them synchronized (``TFDIST_CHECK_SYNC_BN=1``): equal
  again, or not.
- ``global_batch``: another number of steps per epoch than ``1 device`` (the global batch
  grows with the replicas), or ``unseeded``: ``N devices`` starts from other initial
  weights than ``1 device``: the other causes are not looked for then.
- ``fewer_steps``: a run whose fit trained fewer steps than the reference's.
- ``worker_seeds`` / ``worker_data``: ``N devices`` equal but ``N workers`` not: the
  workers start from other initial weights (a seed from the worker index), or from the
  same ones but see other data (numpy arrays or a dataset not sharded).

Example:
    >>> [c.cause for c in find(verdicts, reference, rerun, 1e-5)]  # doctest: +SKIP
    ['batchnorm']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tfdist.check.compare import compare
from tfdist.check.runner import Run
from tfdist.check.topology import Topology
from tfdist.check.verdict import Verdict, judge

__all__ = ["Cause", "find"]


@dataclass(frozen=True)
class Cause:
    """A likely cause: a short name, what the check saw, and what to do."""

    cause: str
    evidence: str
    fix: str


Rerun = Callable[[Topology], Run]  # the topology again, BatchNormalization synchronized


def find(verdicts: list[Verdict], reference: Run, rerun: Rerun, tolerance: float) -> list[Cause]:
    """The causes the evidence supports, most certain first."""
    causes = [_hang(v) for v in verdicts if v.status == "timeout"]
    causes += [_failed(v) for v in verdicts if v.status == "failed"]
    causes += _short(verdicts, reference)
    first = _global_batch(verdicts, reference) or _unseeded(verdicts, reference, tolerance)
    if first:  # every step differs from the start: the causes below would be guesses
        return [*causes, first]
    causes += _batchnorm(verdicts, reference, rerun, tolerance)
    causes += _workers(verdicts, reference, tolerance)
    return causes


def _short(verdicts: list[Verdict], reference: Run) -> list[Cause]:
    """Runs whose fit trained fewer steps than the reference's."""
    want = reference.ranks[0].facts["steps"]
    short = [f"{v.name} {v.steps}" for v in verdicts if v.status == "differs" and v.steps < want]
    if not short:
        return []
    return [
        Cause(
            "fewer_steps",
            f"1 device trained {want} steps, {', '.join(short)}: that fit ended early",
            "a shorter epoch (steps_per_epoch, or a dataset that ends sooner on this "
            "topology) or a resumed job (checkpoints the script found); see --keep DIR's "
            "output.log of the run",
        )
    ]


def _unseeded(verdicts: list[Verdict], reference: Run, tolerance: float) -> Cause | None:
    """A one-process topology that starts from other initial weights than the reference."""
    for verdict in verdicts:
        if verdict.status != "differs" or verdict.run.topology.kind != "device":
            continue
        start = compare(reference.ranks[0].initial, verdict.run.ranks[0].initial)
        if not start.equal(tolerance):
            return Cause(
                "unseeded",
                f"{verdict.name} started from other initial weights than 1 device "
                f"({start.key} differs by {start.value:.1e}): the script draws new random "
                "weights at every run",
                "seed it once at the top, e.g. keras.utils.set_random_seed(0), so that "
                "every run (and every worker) starts from the same weights",
            )
    return None


def _global_batch(verdicts: list[Verdict], reference: Run) -> Cause | None:
    """Another number of steps per epoch than ``1 device``: another global batch."""
    ref = reference.ranks[0].facts.get("steps_per_epoch")
    other = {
        v.name: v.run.ranks[0].facts.get("steps_per_epoch")
        for v in verdicts
        if v.status == "differs" and v.run.ranks[0].facts.get("steps_per_epoch") != ref
    }
    if not ref or not other:
        return None
    seen = ", ".join(f"{name} {steps}" for name, steps in other.items())
    return Cause(
        "global_batch",
        f"1 device runs {ref} steps per epoch, {seen}: the global batch changes with the "
        "replicas (a per-replica batch, or tfdist.global_batch_size), so each step averages "
        "the gradient over other samples",
        "to compare, keep the global batch fixed (e.g. per_replica_batch=GLOBAL // "
        "tfdist.num_replicas()); a global batch that grows with the replicas is a choice, "
        "but it trains another model (scale the learning rate with it)",
    )


def _hang(verdict: Verdict) -> Cause:
    run = verdict.run
    where = []
    for rank in range(max(len(run.progress), len(run.waiting_at))):
        state = run.progress.get(rank, {})
        place = run.waiting_at.get(rank)
        if place:
            where.append(f"process {rank} waiting at {place}")
        elif state.get("state") == "fit":
            where.append(f"process {rank} in fit at step {state.get('step', 0)}")
        else:
            where.append(f"process {rank} {state.get('state', 'not started')}")
    return Cause(
        "hang",
        f"{verdict.name} did not finish within {run.seconds:.0f} s: " + "; ".join(where),
        "a save, barrier, evaluate or callback that only some workers reach waits for the "
        "others forever: every worker must make the same calls (write files on the chief "
        "only, but let every worker call the function; tfdist.save does)",
    )


def _failed(verdict: Verdict) -> Cause:
    lines = [line.strip() for line in verdict.run.output.splitlines() if line.strip()]
    return Cause(
        "failed",
        f"{verdict.name} exited with code {verdict.run.returncode} before its result; its "
        "output ends: " + " | ".join(lines[-3:]),
        "run it alone to see the whole error (tfdist check --keep DIR keeps each run's output.log)",
    )


def _batchnorm(verdicts, reference: Run, rerun: Rerun, tolerance: float) -> list[Cause]:
    unsynced = reference.ranks[0].facts.get("unsynchronized", [])
    differing = [v for v in verdicts if v.status == "differs" and v.run.topology.count > 1]
    if not unsynced or not differing or reference.topology.backend != "tensorflow":
        return []
    shown = []
    for verdict in differing:
        again = judge(reference, rerun(verdict.run.topology), tolerance)
        before = verdict.weights.value if verdict.weights else float("nan")
        after = (
            f"equal (worst {_worst(again)}, was {before:.1e})"
            if again.status == "equal"
            else f"still {again.status} ({_worst(again)}; was {before:.1e})"
        )
        shown.append(f"{verdict.name} with them synchronized: {after}")
    return [
        Cause(
            "batchnorm",
            f"unsynchronized BatchNormalization layers {unsynced}: each replica normalises "
            "with its own part of the batch; " + "; ".join(shown),
            "build the model inside tfdist.scope(sync_batchnorm=True), or pass "
            "synchronized=True to each BatchNormalization",
        )
    ]


def _worst(verdict: Verdict) -> str:
    if verdict.weights is None:
        return verdict.status
    return f"{verdict.weights.key} {verdict.weights.value:.1e}"


def _workers(verdicts: list[Verdict], reference: Run, tolerance: float) -> list[Cause]:
    devices = [v for v in verdicts if v.run.topology.kind == "device" and v.run.topology.count > 1]
    workers = [v for v in verdicts if v.run.topology.kind == "worker" and v.status == "differs"]
    if not workers or not devices or any(v.status != "equal" for v in devices):
        return []
    verdict = workers[0]
    for rank, result in sorted(verdict.run.ranks.items()):
        start = compare(reference.ranks[0].initial, result.initial)
        if not start.equal(tolerance):
            return [_seeds(verdict, devices[0], rank, start)]
    step = f"from step {verdict.first_step}" if verdict.first_step else "in its weights"
    return [
        Cause(
            "worker_data",
            f"{devices[0].name} equal but {verdict.name} not; every worker started from the "
            f"reference's initial weights, and the loss differs {step}: the workers train "
            "on other data than their share of the global batch (a dataset not sharded, or "
            "a shuffle, augmentation or dropout seeded from the worker index)",
            "give every worker the same data, order and seed, and let tfdist shard it: "
            "keras.utils.set_random_seed(0) and tfdist.data.pipeline(dataset, "
            "per_replica_batch=..., seed=0) on every worker",
        )
    ]


def _seeds(verdict: Verdict, devices: Verdict, rank: int, start) -> Cause:
    return Cause(
        "worker_seeds",
        f"{devices.name} equal but {verdict.name} not; process {rank} started from other "
        f"initial weights ({start.key} differs by {start.value:.1e}): its random seed "
        "differs from the reference's (a seed from the worker index, or none)",
        "seed every worker alike, e.g. keras.utils.set_random_seed(0) on every worker, "
        "and data order from the same seed",
    )
