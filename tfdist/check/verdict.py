"""One topology's run against the reference's: equal, or which variable differs and by how much.

Every process of a run is compared with the reference (process 0 of ``1 device``): its
weights after the steps, per variable path, and its logged history (loss and metrics per
step). Equal means every difference is finite and at most the tolerance.

Two things are never "equal": a run whose model trained on fewer replicas than its
topology has (``not-distributed``: nothing was split, so nothing was checked), and a
comparison of no variable at all (``nothing``: the script's state lives outside Keras).

Example:
    >>> v = judge(reference_run, run, tolerance=1e-5)  # doctest: +SKIP
    >>> v.status, v.weights.key, v.weights.value       # doctest: +SKIP
    ('differs', 'sequential/dense/kernel', 0.0031)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tfdist.check.compare import Difference, compare, first_differing_step, history_arrays
from tfdist.check.runner import Run

__all__ = ["NOTHING", "ZERO_SIGNAL", "Verdict", "judge", "replicas_trained", "set_apart"]


@dataclass
class Verdict:
    """``status``: ``equal``, ``differs``, ``not-distributed``, ``nothing``, ``timeout``,
    ``failed`` or ``no-fit``."""

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
    replicas: int | None = None  # the fewest replicas a process's model trained on
    processes: int = 0
    # Variables above the tolerance judged by the zero-signal rule (no one-device
    # gradient: rounding that Adam and the like amplify), with their difference.
    set_apart: dict[str, float] = field(default_factory=dict)

    @property
    def asked(self) -> int:
        """The replicas the topology has: its devices, or its processes of one device."""
        return self.run.topology.count

    @property
    def name(self) -> str:
        return str(self.run.topology)


# A trainable variable whose gradient on one device's first batch is below this fraction
# of the model's largest (root mean square per variable) carries no signal: measured,
# the biases feeding a BatchNormalization (which subtracts their mean) 6.7e-8 to 1.1e-6,
# every other variable of a Conv2D or Dense + BatchNormalization + Adam model 3.8e-2 or
# more. Adam divides such a gradient's rounding by its own scale: steps of up to its
# learning rate, 1.1e-4 to 4.6e-4 apart after 20 steps where the rest is within 3.4e-6.
ZERO_SIGNAL = 1e-4


def set_apart(reference, got: dict, tolerance: float) -> dict[str, float]:
    """``{variable: difference}`` of the variables above ``tolerance`` that the zero-signal
    rule sets apart: trainable variables with no one-device gradient (``ZERO_SIGNAL``),
    and moving means of their shape within their difference (a BatchNormalization's
    moving mean averages the mean its input's bias shifts: measured 0.1 of it)."""
    import numpy as np

    grads = reference.facts.get("gradient_rms") or {}
    if not grads or max(grads.values()) <= 0:
        return {}
    largest = max(grads.values())
    out: dict[str, float] = {}
    diffs = {}
    for key, value in reference.final.items():
        if key in got and np.shape(got[key]) == np.shape(value):
            diffs[key] = float(np.max(np.abs(np.asarray(value, np.float64) - got[key]), initial=0))
    silent = {k for k, g in grads.items() if g <= ZERO_SIGNAL * largest and k in diffs}
    for key in silent:
        if diffs[key] > tolerance:
            out[key] = diffs[key]
    for key, diff in diffs.items():
        if not key.endswith("moving_mean") or diff <= tolerance or not np.isfinite(diff):
            continue  # a moving variance is shift-invariant: a bias does not move it
        shape = np.shape(reference.final[key])
        bound = max((diffs[k] for k in silent if np.shape(reference.final[k]) == shape), default=0)
        if diff <= bound:
            out[key] = diff
    return out


def _weights_and_history(reference: Run, run: Run, tolerance: float = 0.0):
    ref = reference.ranks[0]
    worst_w, worst_h, worst_rank = Difference(None, -1.0), Difference(None, -1.0), 0
    apart: dict[str, float] = {}
    for rank, result in sorted(run.ranks.items()):
        w = compare(ref.final, result.final)
        if not w.reason and not w.equal(tolerance):
            mine = set_apart(ref, result.final, tolerance)
            if mine:
                rest = {k: v for k, v in ref.final.items() if k not in mine}
                w = compare(rest, {k: v for k, v in result.final.items() if k not in mine})
                for key, diff in mine.items():
                    apart[key] = max(diff, apart.get(key, 0.0))
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
    return worst_w, worst_h, worst_rank, apart


# Why a comparison of no variable is not a verdict.
NOTHING = (
    "nothing to compare: no Keras model, optimizer or variable of one was found (a state "
    "of plain tf.Variables or jax arrays is not read)"
)


def replicas_trained(run: Run) -> int | None:
    """The fewest replicas any process's model trained on (None: not recorded)."""
    counts = [r.facts.get("replicas") for r in run.ranks.values()]
    known = [int(c) for c in counts if c]
    return min(known) if known else None


def judge(reference: Run, run: Run, tolerance: float) -> Verdict:
    """``run`` against ``reference`` (a run that is done)."""
    if run.status != "done":
        return Verdict(run, run.status)
    weights, history, rank, apart = _weights_and_history(reference, run, tolerance)
    if not reference.ranks[0].final and not run.ranks[rank].final:
        weights = Difference(None, float("inf"), NOTHING)
    equal = weights.equal(tolerance) and history.equal(tolerance)
    ref_loss = reference.ranks[0].facts["history"].get("loss", [])
    loss = run.ranks[rank].facts["history"].get("loss", [])
    verdict = Verdict(
        run,
        "equal" if equal else "differs",
        weights,
        history,
        rank,
        None if equal else first_differing_step(ref_loss, loss, tolerance),
        run.ranks[rank].facts["steps"],
        replicas=replicas_trained(run),
        processes=len(run.ranks),
        set_apart=apart,
    )
    if weights.reason == NOTHING:
        verdict.status, verdict.first_step = "nothing", None
    elif verdict.replicas is not None and verdict.replicas < verdict.asked:
        verdict.status, verdict.first_step = "not-distributed", None
    return verdict
