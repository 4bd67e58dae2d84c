"""The check's report: one line per topology and the likely causes, as text or as JSON.

Example (text)::

    tfdist check: train.py, 20 steps of fit, tensorflow, tolerance 1e-05
      1 device    reference: 20 steps, loss 2.31 -> 1.87
      2 devices   equal (worst sequential/dense/kernel 2.4e-07)
      2 workers   DIFFERS: sequential/dense/kernel by 3.1e-03 (loss from step 1)
    total 31.2 s
    likely causes:
      - worker_data: ...
        fix: ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tfdist.check.causes import Cause
from tfdist.check.verdict import Verdict

__all__ = ["Report", "render", "as_json"]


@dataclass
class Report:
    """Everything the check found; ``exit_code``: 0 equal, 1 a topology differs, 2 not run."""

    script: str
    backend: str
    steps: int
    tolerance: float
    verdicts: list[Verdict] = field(default_factory=list)
    causes: list[Cause] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""  # why the script could not be run or stopped
    one_worker: bool = False  # it read TF_CONFIG: one-process runs got one worker's

    @property
    def exit_code(self) -> int:
        """0: every topology equal; 1: one differs or was not distributed; 2: the check
        could not judge (the script could not be run, or nothing could be compared)."""
        if self.error or any(v.status == "nothing" for v in self.verdicts):
            return 2
        return 0 if all(v.status == "equal" for v in self.verdicts[1:]) else 1


def _line(verdict: Verdict) -> str:
    if verdict.run.topology.is_reference and verdict.run.status == "done":
        facts = verdict.run.ranks[0].facts
        loss = facts["history"].get("loss") or []
        trend = f", loss {loss[0]:.4g} -> {loss[-1]:.4g}" if loss else ""
        if facts.get("loop"):
            trend = " (a custom loop: weights compared, no loss recorded)"
        return f"reference: {facts['steps']} steps{trend}"
    return _judged_line(verdict) + _trained_on(verdict) + _apart(verdict)


def _apart(verdict: Verdict) -> str:
    """``; set apart (no gradient on 1 device): conv2d/bias 4.6e-04``: the variables the
    zero-signal rule judged (``verdict.ZERO_SIGNAL``), worst first."""
    if not verdict.set_apart or verdict.status not in ("equal", "differs"):
        return ""
    worst = sorted(verdict.set_apart.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{k} {v:.1e}" for k, v in worst[:3])
    more = f" and {len(worst) - 3} more" if len(worst) > 3 else ""
    return (
        "; set apart by the zero-signal rule (no gradient on 1 device, or the moving "
        f"statistics that follow such a variable): {shown}{more}"
    )


def _judged_line(verdict: Verdict) -> str:
    if verdict.status == "equal" and verdict.at_global_batch:
        batch = verdict.at_global_batch[0]
        return f"equal at its global batch of {batch} (worst {_worst(verdict)}; see notes)"
    if verdict.status == "equal":
        return f"equal (worst {_worst(verdict)})"
    if verdict.status == "differs":
        where = f" on process {verdict.rank}" if len(verdict.run.ranks) > 1 else ""
        step = f" (loss from step {verdict.first_step})" if verdict.first_step else ""
        return f"DIFFERS: {_worst(verdict)}{where}{step}"
    if verdict.status == "not-distributed":
        return (
            f"NOT DISTRIBUTED: its model trained on {verdict.replicas} replica(s), not "
            f"{verdict.asked}: nothing was split, so nothing was checked (see notes)"
        )
    if verdict.status == "nothing" and verdict.weights is not None:
        return f"NOT JUDGED: {verdict.weights.reason}"
    return {
        "timeout": f"TIMEOUT: not done after {verdict.run.seconds:.0f} s (see hang below)",
        "failed": f"FAILED: exit code {verdict.run.returncode}",
        "no-fit": "NO FIT: ended without calling fit or drawing a batch of its loop",
        "no-steps": "NO STEPS: fit trained no step",
        "nothing": "NOTHING TO COMPARE: no Keras model or optimizer variable was found",
    }[verdict.status]


def _trained_on(verdict: Verdict) -> str:
    """``; 2 replicas, 2 processes``: what the judged run trained on."""
    if verdict.replicas is None or verdict.status not in ("equal", "differs"):
        return ""
    plural = "es" if verdict.processes != 1 else ""
    return f"; {verdict.replicas} replicas, {verdict.processes} process{plural}"


def _worst(verdict: Verdict) -> str:
    """The worse of the weights' and the history's differences, with its name."""
    parts = [d for d in (verdict.weights, verdict.history) if d is not None]
    worst = max(parts, key=lambda d: d.value)
    if worst.reason:
        return f"{worst.key}: {worst.reason}"
    value = "inf" if math.isinf(worst.value) else f"{worst.value:.1e}"
    return f"{worst.key} by {value}" if verdict.status == "differs" else f"{worst.key} {value}"


def render(report: Report) -> str:
    """The report a person reads in ten seconds."""
    first = report.verdicts[0].run.ranks.get(0) if report.verdicts else None
    what = "its loop" if first and first.facts.get("loop") else "fit"
    head = (
        f"tfdist check: {report.script}, {report.steps} steps of {what}, {report.backend}, "
        f"tolerance {report.tolerance:g}"
    )
    lines = [head]
    if report.one_worker:
        lines.append(
            "  the script reads TF_CONFIG: 1 device and N devices run as 1 worker "
            "(a TF_CONFIG of one worker on a free loopback port)"
        )
    lines += [f"  {v.name:<13}{_line(v)}" for v in report.verdicts]
    if report.error:
        judged = report.verdicts and report.verdicts[0].status == "nothing"
        lines.append(f"could not {'judge' if judged else 'stop'} this script: {report.error}")
    lines.append(f"total {report.seconds:.1f} s")
    if report.causes:
        lines.append("likely causes:" if report.exit_code else "notes:")
        for cause in report.causes:
            lines += [f"  - {cause.cause}: {cause.evidence}", f"    fix: {cause.fix}"]
    elif report.exit_code == 1:
        lines.append("likely causes: none the check can show (see docs/check.md)")
    return "\n".join(lines)


def _number(value: float | None):
    return None if value is None or not math.isfinite(value) else value


def _verdict_json(verdict: Verdict) -> dict:
    weights, history = verdict.weights, verdict.history
    return {
        "topology": verdict.name,
        "status": "reference"
        if verdict.run.topology.is_reference and verdict.run.status == "done"
        else verdict.status,
        "seconds": round(verdict.run.seconds, 2),
        "steps": verdict.steps,
        "worst_variable": weights.key if weights else None,
        "weight_difference": _number(weights.value) if weights else None,
        "history_difference": _number(history.value) if history else None,
        "not_comparable": (weights and weights.reason) or (history and history.reason) or None,
        "first_differing_step": verdict.first_step,
        "at_global_batch": list(verdict.at_global_batch) if verdict.at_global_batch else None,
        "replicas": verdict.replicas,
        "asked_replicas": verdict.asked,
        "processes": verdict.processes,
        "set_apart": dict(verdict.set_apart),
        "waiting_at": {str(k): v for k, v in verdict.run.waiting_at.items()},
    }


def as_json(report: Report) -> dict:
    """The report as a JSON-ready dict (a difference that is not finite is ``null``)."""
    return {
        "script": report.script,
        "backend": report.backend,
        "steps": report.steps,
        "tolerance": report.tolerance,
        "exit_code": report.exit_code,
        "error": report.error or None,
        "one_worker": report.one_worker,
        "total_seconds": round(report.seconds, 2),
        "topologies": [_verdict_json(v) for v in report.verdicts],
        "causes": [vars(c) for c in report.causes],
    }
