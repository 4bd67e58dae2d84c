"""Likely causes of a difference, each shown with evidence the check gathered itself.

- ``not_distributed``: a topology whose model trained on fewer replicas than it has (a
  model built outside the job's strategy, or ``TFDIST_UNSCOPED_MODELS=local``): no other
  cause is looked for in it, since nothing was split.
- ``failed``: a run that crashed, with the last lines of its output.
- ``hang``: a run that did not finish its steps within the timeout; where each process
  waited (its stack's innermost line of the script) or how far it got.
- ``loss_per_replica``: a topology of R replicas whose first update is R times one
  device's (from the same initial weights): a loss averaged over each replica's own
  batch, whose gradients the replicas then sum.
- ``batch_sum``: a differing TensorFlow topology of R replicas where one device's model
  outputs or loss on its first batch change when that batch is split in R parts (a sum
  or mean over the batch axis; a loss that is not a mean of per-example terms).
- ``batchnorm``: unsynchronized ``BatchNormalization`` layers on TensorFlow, and a re-run
  of a differing topology with them synchronized (``TFDIST_CHECK_SYNC_BN=1``): equal
  again, or not.
- ``random_layers``: random layers (``Dropout``, ``GaussianNoise``, ``RandomFlip``...)
  draw on every replica apart, and a re-run of a differing topology with them inert
  (``TFDIST_CHECK_INERT_RANDOM=1``): equal again, or not.
- ``partial_batch``: the difference starts at an epoch's last step, whose batch
  is partial (or of a size ``fit``'s input did not tell).
- ``unseeded``: ``N devices`` starts from other initial weights than ``1 device``, or
  else ``global_batch``: another number of steps per epoch than ``1 device`` (the global
  batch grows with the replicas): the other causes are not looked for then.
- ``fewer_steps``: a run whose fit trained fewer steps than the reference's.
- ``unsharded_data``: a differing ``N workers`` whose ``tf.data`` input turns auto-sharding
  off (``AutoShardPolicy.OFF``): every worker reads the whole dataset.
- ``worker_seeds`` / ``worker_data``: ``N devices`` equal but ``N workers`` not: the
  workers start from other initial weights (a seed from the worker index), or from the
  same ones but see other data (other arrays, told by their fingerprints, or the same
  arrays in another order).

Example:
    >>> [c.cause for c in find(verdicts, reference, rerun, 1e-5)]  # doctest: +SKIP
    ['batchnorm']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tfdist.check.compare import compare, first_differing_step
from tfdist.check.runner import Run, excerpt
from tfdist.check.topology import Topology
from tfdist.check.verdict import Verdict, judge

__all__ = ["Cause", "find"]


@dataclass(frozen=True)
class Cause:
    """A likely cause: a short name, what the check saw, and what to do."""

    cause: str
    evidence: str
    fix: str


# The topology again, as a variant (runner.VARIANTS): "sync_batchnorm", "inert_random".
Rerun = Callable[[Topology, str], Run]


def find(verdicts: list[Verdict], reference: Run, rerun: Rerun, tolerance: float) -> list[Cause]:
    """The causes the evidence supports, most certain first."""
    causes = [_not_distributed(v) for v in verdicts if v.status == "not-distributed"]
    causes += [_hang(v) for v in verdicts if v.status == "timeout"]
    causes += [_failed(v) for v in verdicts if v.status == "failed"]
    causes += _short(verdicts, reference)
    # Other initial weights first: then every other comparison (at another global batch
    # too) differs for that reason alone.
    first = _unseeded(verdicts, reference, tolerance) or _global_batch(verdicts, reference)
    if first:  # every step differs from the start: the causes below would be guesses
        return [*causes, first]
    causes += _loss_per_replica(verdicts, reference, tolerance)
    causes += _batch_sum(verdicts, reference)
    causes += _batchnorm(verdicts, reference, rerun, tolerance)
    causes += _random_layers(verdicts, reference, rerun, tolerance)
    causes += _partial_batch(verdicts, reference, tolerance)
    causes += _unsharded(verdicts)
    if not any(c.cause == "unsharded_data" for c in causes):
        causes += _workers(verdicts, reference, tolerance)
    return causes


def _not_distributed(verdict: Verdict) -> Cause:
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


def _global_batch(verdicts: list[Verdict], reference: Run) -> Cause | None:
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


def _hang(verdict: Verdict) -> Cause:
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


def _failed(verdict: Verdict) -> Cause:
    return Cause(
        "failed",
        f"{verdict.name} exited with code {verdict.run.returncode} before its result; its "
        "output ends: " + " | ".join(excerpt(verdict.run.output)),
        "run it alone to see the whole error (tfdist check --keep DIR keeps each run's output.log)",
    )


def _several_replicas_differing(verdicts: list[Verdict]) -> list[Verdict]:
    """Differing topologies whose model trained on several replicas (what each replica
    computes apart can only differ there): the replicas it trained on, else its count."""
    return [v for v in verdicts if v.status == "differs" and _replicas_of(v) > 1]


def _replicas_of(verdict: Verdict) -> int:
    return verdict.replicas or verdict.run.topology.count


def _rerun_shown(
    differing: list[Verdict], reference: Run, rerun: Rerun, tolerance: float, variant: str, how: str
) -> str:
    """Each differing topology re-run as ``variant`` and judged against ``reference`` (a
    run of the same variant when the variant changes one device's model too): "2 devices
    with them HOW: equal (...)"."""
    shown = []
    for verdict in differing:
        again = judge(reference, rerun(verdict.run.topology, variant), tolerance)
        before = verdict.weights.value if verdict.weights else float("nan")
        after = (
            f"equal (worst {_worst(again)}, was {before:.1e})"
            if again.status == "equal"
            else f"still {again.status} ({_worst(again)}; was {before:.1e})"
        )
        shown.append(f"{verdict.name} with them {how}: {after}")
    return "; ".join(shown)


# A first update this close to R times one device's (relative to R), along one device's
# (relative residual), is named: rounding gives ~1e-6; other causes change its direction.
_SCALE_CLOSE = 1e-2


def _loss_per_replica(verdicts: list[Verdict], reference: Run, tolerance: float) -> list[Cause]:
    """Differing topologies whose first update is R times one device's (R replicas)."""
    shown = []
    for verdict in _several_replicas_differing(verdicts):
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


def _batch_sum(verdicts: list[Verdict], reference: Run) -> list[Cause]:
    """Differing TensorFlow topologies of R replicas where the reference's model or loss
    on its first batch changes when that batch is split in R parts (``batch_split``)."""
    if reference.topology.backend != "tensorflow":
        return []  # on JAX the model and its loss see the global batch as one array
    split = reference.ranks[0].facts.get("batch_split") or {}
    names: dict[int, list[str]] = {}
    for verdict in _several_replicas_differing(verdicts):
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


def _batchnorm(verdicts, reference: Run, rerun: Rerun, tolerance: float) -> list[Cause]:
    unsynced = reference.ranks[0].facts.get("unsynchronized", [])
    differing = _several_replicas_differing(verdicts)
    if not unsynced or not differing or reference.topology.backend != "tensorflow":
        return []
    shown = _rerun_shown(differing, reference, rerun, tolerance, "sync_batchnorm", "synchronized")
    return [
        Cause(
            "batchnorm",
            f"unsynchronized BatchNormalization layers {unsynced}: each replica normalises "
            "with its own part of the batch; " + shown,
            "build the model inside tfdist.scope(sync_batchnorm=True), or pass "
            "synchronized=True to each BatchNormalization",
        )
    ]


def _random_layers(verdicts, reference: Run, rerun: Rerun, tolerance: float) -> list[Cause]:
    """Random layers that draw on every replica apart, shown by a re-run with them inert."""
    random = reference.ranks[0].facts.get("random", [])
    differing = _several_replicas_differing(verdicts)
    if not random or not differing:
        return []
    # Inert layers change one device's training too: the re-runs are compared with one
    # device's re-run, not with the script's reference.
    inert_reference = rerun(reference.topology, "inert_random")
    if inert_reference.status != "done":
        shown = f"1 device with them inert: {inert_reference.status} (no comparison)"
    else:
        shown = "1 device re-run with them inert as the reference; " + _rerun_shown(
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


def _differing_steps(verdict: Verdict, reference: Run, tolerance: float) -> list[int]:
    """The steps (1-based) at which any logged value differs from the reference's."""
    ref = reference.ranks[0].facts["history"]
    got = verdict.run.ranks[verdict.rank].facts["history"]
    steps = set()
    for key in ref.keys() & got.keys():
        for step, (a, b) in enumerate(zip(ref[key], got[key], strict=False), 1):
            if first_differing_step([a], [b], tolerance):
                steps.add(step)
    return sorted(steps)


def _partial_batch(verdicts: list[Verdict], reference: Run, tolerance: float) -> list[Cause]:
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
        for v in _several_replicas_differing(verdicts)
        if not batch or (last or 0) % _replicas_of(v)
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
        steps = _differing_steps(verdict, reference, tolerance)
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


def _unsharded(verdicts: list[Verdict]) -> list[Cause]:
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
