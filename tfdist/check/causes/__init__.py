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
- ``random_steps``: a model that holds a ``keras.random.SeedGenerator`` draws in its own
  ``train_step`` (a GAN's latent vectors), for each replica's part of the batch apart.
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

from tfdist.check.causes import data, model, outcome
from tfdist.check.causes.evidence import Cause, Rerun
from tfdist.check.runner import Run
from tfdist.check.verdict import Verdict

__all__ = ["Cause", "Rerun", "find"]


def find(verdicts: list[Verdict], reference: Run, rerun: Rerun, tolerance: float) -> list[Cause]:
    """The causes the evidence supports, most certain first."""
    causes = [outcome.not_distributed(v) for v in verdicts if v.status == "not-distributed"]
    causes += [outcome.hang(v) for v in verdicts if v.status == "timeout"]
    causes += [outcome.failed(v) for v in verdicts if v.status == "failed"]
    causes += outcome.short(verdicts, reference)
    # Other initial weights first: then every other comparison (at another global batch
    # too) differs for that reason alone.
    first = outcome.unseeded(verdicts, reference, tolerance) or outcome.global_batch(
        verdicts, reference
    )
    if first:  # every step differs from the start: the causes below would be guesses
        return [*causes, first]
    causes += model.loss_per_replica(verdicts, reference, tolerance)
    causes += model.batch_sum(verdicts, reference)
    causes += model.batchnorm(verdicts, reference, rerun, tolerance)
    causes += model.random_layers(verdicts, reference, rerun, tolerance)
    causes += model.random_steps(verdicts)
    causes += data.partial_batch(verdicts, reference, tolerance)
    causes += data.unsharded(verdicts)
    if not any(c.cause == "unsharded_data" for c in causes):
        causes += data.workers(verdicts, reference, tolerance)
    return causes
