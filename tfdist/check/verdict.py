"""One topology's run against the reference's: equal, or which variable differs and by how much.

Every process of a run is compared with the reference (process 0 of ``1 device``): its
weights after the steps, per variable path, and its logged history (loss and metrics per
step). Equal means every difference is finite and at most the tolerance.

Example:
    >>> v = judge(reference_run, run, tolerance=1e-5)  # doctest: +SKIP
    >>> v.status, v.weights.key, v.weights.value       # doctest: +SKIP
    ('differs', 'sequential/dense/kernel', 0.0031)
"""

from __future__ import annotations

from dataclasses import dataclass

from tfdist.check.compare import Difference, compare, first_differing_step, history_arrays
from tfdist.check.runner import Run

__all__ = ["Verdict", "judge"]


@dataclass
class Verdict:
    """``status``: ``equal``, ``differs``, ``timeout``, ``failed`` or ``no-fit``."""

    run: Run
    status: str
    weights: Difference | None = None  # worst over the run's processes
    history: Difference | None = None
    rank: int = 0  # the process the worst weight difference is on
    first_step: int | None = None  # first step whose loss differs
    steps: int = 0
    # A global batch that grew with the replicas: (that batch, how this run compares with
    # 1 device re-run at it), e.g. (128, "equal (worst dense/kernel 2.4e-07)").
    at_global_batch: tuple[int, str] | None = None

    @property
    def name(self) -> str:
        return str(self.run.topology)


def _weights_and_history(reference: Run, run: Run):
    ref = reference.ranks[0]
    worst_w, worst_h, worst_rank = Difference(None, -1.0), Difference(None, -1.0), 0
    for rank, result in sorted(run.ranks.items()):
        w = compare(ref.final, result.final)
        h = compare(
            history_arrays(ref.facts["history"]),
            history_arrays(result.facts["history"]),
            relative=True,
        )
        if not h.reason and result.facts["steps"] != ref.facts["steps"]:
            h = Difference("steps", float("inf"), "a different number of steps")
        if w.value > worst_w.value:
            worst_w, worst_rank = w, rank
        if h.value > worst_h.value:
            worst_h = h
    return worst_w, worst_h, worst_rank


def judge(reference: Run, run: Run, tolerance: float) -> Verdict:
    """``run`` against ``reference`` (a run that is done)."""
    if run.status != "done":
        return Verdict(run, run.status)
    weights, history, rank = _weights_and_history(reference, run)
    equal = weights.equal(tolerance) and history.equal(tolerance)
    ref_loss = reference.ranks[0].facts["history"].get("loss", [])
    loss = run.ranks[rank].facts["history"].get("loss", [])
    return Verdict(
        run,
        "equal" if equal else "differs",
        weights,
        history,
        rank,
        None if equal else first_differing_step(ref_loss, loss, tolerance),
        run.ranks[rank].facts["steps"],
    )
