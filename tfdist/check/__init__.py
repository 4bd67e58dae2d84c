"""``tfdist check script.py``: does this unchanged script train one device's model when distributed?

It runs the script's first ``steps`` training steps of its first ``fit`` (or of its
custom loop: ``loops``, one watcher per backend) on each
topology on this machine's CPU, each in fresh processes (``runner``; the hook that stops
``fit`` and records the weights is ``hook``), compares every topology with ``1 device``
(``verdict``, through ``compare``: per variable, the largest absolute difference, a NaN
never equal), shows the likely causes it has evidence for (``causes``), and reports
(``report``). docs/check.md is the manual.

Example:
    >>> options = CheckOptions("train.py", steps=5)  # doctest: +SKIP
    >>> report = check(options, progress=print)      # doctest: +SKIP
    >>> report.exit_code                             # doctest: +SKIP
    0
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CheckOptions", "DEFAULT_TOLERANCE", "check"]

# Measured (docs/check.md, "Tolerance"): 2 devices or workers against one device after 20
# steps differ by up to ~1e-7 (summation order in float32); a real defect by 1e-4 and more.
DEFAULT_TOLERANCE = 1e-5


@dataclass(frozen=True)
class CheckOptions:
    """What ``tfdist check`` runs: the script, its arguments, and how to check it."""

    script: str
    args: tuple[str, ...] = ()
    steps: int = 20
    backend: str = "tensorflow"
    topologies: str = ""  # "" -> topology.DEFAULTS
    tolerance: float = DEFAULT_TOLERANCE
    timeout: float = 300.0
    keep: str | None = None  # a folder to keep the runs' files in


def check(options: CheckOptions, progress: Callable[[str], None] = lambda _line: None):
    """Runs every topology, compares it with ``1 device``, and returns the ``Report``."""
    from tfdist.check import causes, report, runner, topology, verdict

    started = time.monotonic()
    topologies = topology.parse_topologies(options.topologies or topology.DEFAULTS, options.backend)
    # Absolute: every run works in a folder of its own, where a relative --keep is not.
    folder = Path(options.keep or tempfile.mkdtemp(prefix="tfdist-check-")).absolute()
    result = report.Report(options.script, options.backend, options.steps, options.tolerance)

    def run(which, variant: str = ""):
        name = str(which).replace(" ", "-") + (f"-{variant.replace(':', '-')}" if variant else "")
        how = _VARIANT_NAMES.get(variant, f" (at a global batch of {variant.split(':')[-1]})")
        alone = result.one_worker and which.kind == "device"
        progress(f"tfdist check: running {which}{how if variant else ''}{_AS_ONE * alone}")
        done = runner.run_topology(
            which,
            options.script,
            options.args,
            steps=options.steps,
            timeout=options.timeout,
            folder=folder / (name + "-as-1-worker" * alone),
            variant=variant,
            one_worker=result.one_worker,
        )
        progress(f"tfdist check: {which}: {done.status} in {done.seconds:.1f} s")
        return done

    try:
        reference = run(topologies[0])
        if reference.reads_tf_config and options.backend == "tensorflow":
            # A script for workers only (json.loads(os.environ["TF_CONFIG"]), the
            # TensorFlow tutorial's): every one-process run from here on is one worker.
            result.one_worker = True
            reference = run(topologies[0])
        if reference.status == "done" and not reference.ranks[0].facts["steps"]:
            reference.status = "no-steps"
        elif reference.status == "done" and not reference.ranks[0].final:
            reference.status = "nothing"
        if reference.status != "done":
            result.error = _why_not(reference, options)
            result.verdicts = [verdict.Verdict(reference, reference.status)]
        else:
            runs = [reference, *(run(t) for t in topologies[1:])]
            result.verdicts = [verdict.judge(reference, r, options.tolerance) for r in runs]
            _judge_at_their_global_batch(result.verdicts, reference, run, options.tolerance)
            result.causes = causes.find(result.verdicts, reference, run, options.tolerance)
    finally:
        if not options.keep:
            shutil.rmtree(folder, ignore_errors=True)
    result.seconds = time.monotonic() - started
    return result


def _judge_at_their_global_batch(verdicts, reference, run, tolerance: float) -> None:
    """A topology whose global batch grew with its replicas (other steps per epoch than
    ``1 device``, a larger batch) is judged again against ``1 device`` re-run at that
    global batch (the hook rebatches fit's input): equal there, it trains what one device
    trains at that batch, which is what a script that scales its batch with the replicas
    means (``per_replica * num_replicas``, the guides' idiom); that verdict is then
    ``equal`` and the ``global_batch`` cause says so."""
    from tfdist.check import runner, verdict

    facts = reference.ranks[0].facts
    again_at: dict = {}
    for judged in verdicts[1:]:
        mine = judged.run.ranks[0].facts if judged.run.ranks else {}
        batch = mine.get("batch")
        grew = mine.get("steps_per_epoch") != facts.get("steps_per_epoch")
        if judged.status != "differs" or not batch or not grew or batch == facts.get("batch"):
            continue
        if batch not in again_at:
            again_at[batch] = run(reference.topology, f"{runner.GLOBAL_BATCH}{batch}")
        scaled = again_at[batch]
        if scaled.status != "done" or "rebatched" not in scaled.ranks[0].facts:
            why = scaled.ranks[0].facts.get("rebatch_failed") if scaled.ranks else None
            judged.at_global_batch = (batch, f"not compared ({why or scaled.status})")
            continue
        again = verdict.judge(scaled, judged.run, tolerance)
        worst = max((d for d in (again.weights, again.history) if d), key=lambda d: d.value)
        judged.at_global_batch = (batch, f"{again.status} (worst {worst.key} {worst.value:.1e})")
        if again.status == "equal":
            judged.status, judged.weights, judged.history = "equal", again.weights, again.history
            judged.first_step = None


_AS_ONE = " (as 1 worker: the script reads TF_CONFIG)"
# How the progress line names a re-run (runner.VARIANTS).
_VARIANT_NAMES = {
    "sync_batchnorm": " (BatchNormalization synchronized)",
    "inert_random": " (random layers inert)",
}


def _why_not(reference, options: CheckOptions) -> str:
    """Why ``1 device`` gave no result: the line a person needs, and the output's end."""
    if reference.status == "no-fit":
        why = reference.progress.get(0, {}).get("reason")
        loops = (
            f"its custom loop cannot be stopped: {why}"
            if why
            else "tfdist check measures fit; a custom loop on TensorFlow drawing its "
            "batches from strategy.experimental_distribute_dataset or "
            "tfdist.loops.distribute; and on JAX a jax.jit step that takes and returns the "
            "state (trainable_variables, non_trainable_variables, optimizer_variables)"
        )
        return (
            f"on 1 device it ended (exit code {reference.returncode}) without calling "
            f"keras.Model.fit or drawing a batch of a distributed dataset: {loops}"
        )
    if reference.status == "nothing":
        return (
            "on 1 device it trained, but the check found nothing to compare: no Keras "
            "model or optimizer holding variables (a state of plain tf.Variables or jax "
            "arrays is not read). Keep the trained state in a Keras model or optimizer "
            "(keras.Variable / add_weight) to check it"
        )
    if reference.status == "no-steps":
        return (
            "on 1 device its first fit returned without training a step (it resumed a "
            "finished job from checkpoints in this folder? no data?)"
        )
    if reference.status == "timeout":
        where = reference.waiting_at.get(0) or "before its first fit" + (
            f" (fit at step {reference.progress[0].get('step')})"
            if reference.progress.get(0, {}).get("state") == "fit"
            else ""
        )
        return (
            f"on 1 device it did not finish {options.steps} steps of fit within "
            f"{options.timeout:g} s (waiting at {where}); raise --timeout if it is only slow"
        )
    from tfdist.check.runner import excerpt

    tail = "\n".join(excerpt(reference.output, 8))
    return f"on 1 device it failed (exit code {reference.returncode}); its output ends:\n{tail}"
