"""The ``Cause`` record, and what every cause reads off the verdicts: which topologies differ on
several replicas, the worst difference, the steps that differ, a re-run shown.

Example:
    >>> Cause("hang", "2 workers did not finish", "call it on every worker").cause
    'hang'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tfdist.check.compare import first_differing_step
from tfdist.check.runner import Run
from tfdist.check.topology import Topology
from tfdist.check.verdict import Verdict, judge

__all__ = [
    "Cause",
    "Rerun",
    "several_replicas_differing",
    "replicas_of",
    "rerun_shown",
    "differing_steps",
    "worst",
]


@dataclass(frozen=True)
class Cause:
    """A likely cause: a short name, what the check saw, and what to do."""

    cause: str
    evidence: str
    fix: str


# The topology again, as a variant (runner.VARIANTS): "sync_batchnorm", "inert_random".
Rerun = Callable[[Topology, str], Run]


def several_replicas_differing(verdicts: list[Verdict]) -> list[Verdict]:
    """Differing topologies whose model trained on several replicas (what each replica
    computes apart can only differ there): the replicas it trained on, else its count."""
    return [v for v in verdicts if v.status == "differs" and replicas_of(v) > 1]


def replicas_of(verdict: Verdict) -> int:
    return verdict.replicas or verdict.run.topology.count


def rerun_shown(
    differing: list[Verdict], reference: Run, rerun: Rerun, tolerance: float, variant: str, how: str
) -> str:
    """Each differing topology re-run as ``variant`` and judged against ``reference`` (a
    run of the same variant when the variant changes one device's model too): "2 devices
    with them HOW: equal (...)"."""
    shown = []
    for verdict in differing:
        again = judge(reference, rerun(verdict.run.topology, variant), tolerance)
        before = verdict.weights.value if verdict.weights else float("nan")
        if again.status == "equal":
            after = f"equal (worst {worst(again)}, was {before:.1e})"
        else:
            now = again.weights.value if again.weights else float("nan")
            # How much of the difference the variant took away, where it took most of it.
            less = f", {before / now:.0f} times less" if 0 < now * 10 <= before else ""
            after = f"still {again.status} ({worst(again)}; was {before:.1e}{less})"
        shown.append(f"{verdict.name} with them {how}: {after}")
    return "; ".join(shown)


def differing_steps(verdict: Verdict, reference: Run, tolerance: float) -> list[int]:
    """The steps (1-based) at which any logged value differs from the reference's."""
    ref = reference.ranks[0].facts["history"]
    got = verdict.run.ranks[verdict.rank].facts["history"]
    steps = set()
    for key in ref.keys() & got.keys():
        for step, (a, b) in enumerate(zip(ref[key], got[key], strict=False), 1):
            if first_differing_step([a], [b], tolerance):
                steps.add(step)
    return sorted(steps)


def worst(verdict: Verdict) -> str:
    if verdict.weights is None:
        return verdict.status
    return f"{verdict.weights.key} {verdict.weights.value:.1e}"
