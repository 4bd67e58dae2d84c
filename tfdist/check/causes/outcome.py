"""Causes read from how a run ended: it split nothing, trained fewer steps, started from other
weights or another global batch, hung or failed. When one of these holds the check looks
no further into that run.

Example:
    >>> [c.cause for c in [failed(verdict)]]  # doctest: +SKIP
    ['failed']
"""

from __future__ import annotations

from tfdist.check.causes.evidence import Cause
from tfdist.check.compare import compare
from tfdist.check.runner import Run, excerpt
from tfdist.check.verdict import Verdict

__all__ = ["not_distributed", "short", "unseeded", "global_batch", "hang", "failed"]


def not_distributed(verdict: Verdict) -> Cause:
    """A topology that split nothing: the model trained on fewer replicas than it has."""
    return Cause(
        "not_distributed",
        f"on {verdict.name} the model trained on {verdict.replicas} replica(s) of "
        f"{verdict.asked}, on {verdict.processes} process(es): each process trained a copy "
        "of its own, so a comparison would check nothing",
        "build the model in tfdist.scope() (or the strategy's scope), or leave "
        "TFDIST_UNSCOPED_MODELS at job so that models built outside any scope train on the "
        "job; a custom loop runs its step with strategy.run",
    )


def short(verdicts: list[Verdict], reference: Run) -> list[Cause]:
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


def unseeded(verdicts: list[Verdict], reference: Run, tolerance: float) -> Cause | None:
    """A one-process topology that starts from other initial weights than the reference."""
    for verdict in verdicts:
        if verdict.status != "differs" or verdict.run.topology.kind != "device":
            continue
        start = compare(reference.ranks[0].initial, verdict.run.ranks[0].initial)
        if start.reason:  # initial weights not read on one side: no evidence either way
            continue
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


def global_batch(verdicts: list[Verdict], reference: Run) -> Cause | None:
    """Another number of steps per epoch than ``1 device``: another global batch; with
    how each such topology compares with ``1 device`` re-run at its global batch."""
    ref = reference.ranks[0].facts.get("steps_per_epoch")
    grown = [
        v
        for v in verdicts
        if v.at_global_batch
        or (v.status == "differs" and v.run.ranks[0].facts.get("steps_per_epoch") != ref)
    ]
    if not ref or not grown:
        return None
    seen = ", ".join(f"{v.name} {v.run.ranks[0].facts.get('steps_per_epoch')}" for v in grown)
    again = "".join(
        f"; {v.name} against 1 device re-run at its global batch of {v.at_global_batch[0]}: "
        f"{v.at_global_batch[1]}"
        for v in grown
        if v.at_global_batch
    )
    same = all(v.status == "equal" for v in grown)
    return Cause(
        "global_batch",
        f"1 device runs {ref} steps per epoch, {seen}: the global batch grows with the "
        "replicas (a per-replica batch, or tfdist.global_batch_size)" + again,
        (
            "nothing to fix if a global batch that grows with the replicas is meant (the "
            "guides' per_replica * num_replicas): the script trains one device's model at "
            "that batch; scale the learning rate with it if needed"
        )
        if same
        else (
            "to compare, keep the global batch fixed (e.g. per_replica_batch=GLOBAL // "
            "tfdist.num_replicas()); a global batch that grows with the replicas is a "
            "choice, but it trains another model (scale the learning rate with it)"
        ),
    )


def hang(verdict: Verdict) -> Cause:
    run = verdict.run
    where = []
    for rank in range(max(len(run.progress), len(run.waiting_at))):
        state = run.progress.get(rank, {})
        place = run.waiting_at.get(rank)
        if place:
            where.append(f"process {rank} waiting at {place}")
        elif state.get("state") in ("fit", "loop"):
            where.append(f"process {rank} in {state['state']} at step {state.get('step', 0)}")
        else:
            where.append(f"process {rank} {state.get('state', 'not started')}")
    return Cause(
        "hang",
        f"{verdict.name} did not finish within {run.seconds:.0f} s: " + "; ".join(where),
        "a save, barrier, evaluate or callback that only some workers reach waits for the "
        "others forever: every worker must make the same calls (write files on the chief "
        "only, but let every worker call the function; tfdist.save does)",
    )


def failed(verdict: Verdict) -> Cause:
    return Cause(
        "failed",
        f"{verdict.name} exited with code {verdict.run.returncode} before its result; its "
        "output ends: " + " | ".join(excerpt(verdict.run.output)),
        "run it alone to see the whole error (tfdist check --keep DIR keeps each run's output.log)",
    )
