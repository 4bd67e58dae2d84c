"""The record of a restartable ``tfdist train mnist`` job: ``CKPT_DIR/job.json``.

It lives with the checkpoints it describes, also when ``CKPT_DIR`` is a URL (written
through ``tfdist.core.storage``, atomically): a VM that replaces a preempted one finds
both in the bucket. It holds what the checkpoints were made with (recipe, replicas, batch, split, backend),
so that a folder made by another job is refused instead of silently resumed with a
different batch, the total training time over every run (a rerun adds to it), and the
epochs whose training was split across runs (``partial_epochs``: Keras's history row of
such an epoch only covers the batches trained after the resume).

Example:
    >>> record = open_record("runs/mnist/ckpt", {"recipe": "fast", "replicas": 2})  # doctest: +SKIP
    >>> record.data["wall_time_s"]                                     # doctest: +SKIP
    0.0
"""

from __future__ import annotations

import json
import time

from tfdist.checkpoint.names import list_checkpoints
from tfdist.core import atomic, storage
from tfdist.core.config import ConfigError

__all__ = ["JobRecord", "open_record"]

RECORD = "job.json"
# What a checkpoint folder must agree on: another value changes the steps, the learning
# rate schedule or the model, so resuming would train a different job.
# The replica count and per-replica batch may change between runs: a checkpoint resumes
# exactly on another world size with the same global batch (the data position counts
# global batches, the learning rate follows the optimizer step).
MUST_MATCH = ("recipe", "global_batch", "train_split")
# Write the running time at most this often from the batch callback (kill -9 loses less).
_WRITE_EVERY_S = 5.0


def _has_checkpoints(ckpt_dir: str) -> bool:
    return bool(list_checkpoints(ckpt_dir))


def _read(path: str) -> dict:
    """The record at ``path`` (a local path or URL); FileNotFoundError without one."""
    with storage.local_copy(path) as local, open(local) as f:
        return json.load(f)


def _refusal(ckpt_dir: str, old: dict, new: dict) -> str:
    diffs = ", ".join(
        f"{key}={old.get(key)!r} there, {new[key]!r} now"
        for key in MUST_MATCH
        if old.get(key) != new[key]
    )
    hint = ""
    if old.get("global_batch") != new["global_batch"] and new.get("replicas"):
        per_replica, rest = divmod(int(old["global_batch"]), int(new["replicas"]))
        if not rest:
            hint = (
                f" To resume it on {new['replicas']} replica(s), keep its global batch: "
                f"--per-replica-batch {per_replica}."
            )
    return (
        f"train mnist: the checkpoints in {ckpt_dir} belong to another job ({diffs}). "
        "Resuming would train with another batch or model." + hint + " Otherwise pass "
        "--output (or --checkpoint-dir) elsewhere, delete that folder to start again, or "
        "rerun with the settings it was made with."
    )


def open_record(ckpt_dir: str, identity: dict) -> JobRecord:
    """The job's record: the one in ``ckpt_dir`` when its checkpoints match ``identity``,
    a new one when there are no checkpoints yet; a ``ConfigError`` naming the difference
    when they were made by another job.

    Example:
        >>> open_record("/tmp/none", {"recipe": "fast"}).data["runs"]  # doctest: +SKIP
        []
    """
    path = storage.join(ckpt_dir, RECORD)
    fresh = {"identity": identity, "wall_time_s": 0.0, "runs": [], "partial_epochs": []}
    if not _has_checkpoints(ckpt_dir):
        return JobRecord(path, fresh)
    try:
        data = _read(path)
    except FileNotFoundError:
        # Checkpoints from before job records (or another program): nothing to check.
        return JobRecord(path, fresh)
    old = data.get("identity", {})
    if any(old.get(key) != identity[key] for key in MUST_MATCH if key in old):
        raise ConfigError(_refusal(ckpt_dir, old, identity))
    data["identity"] = identity
    return JobRecord(path, data)


class JobRecord:
    """``job.json`` in memory; ``save`` writes it (on the chief only, atomically)."""

    def __init__(self, path: str, data: dict):
        self.path = path
        self.data = data
        self._before = float(data["wall_time_s"])
        self._start = time.perf_counter()

    def start_run(self, resumed, steps_per_epoch: int, start: float) -> None:
        """Opens this run's entry; ``start`` is when it began (``time.perf_counter``)."""
        self._start = start
        origin = None
        if resumed is not None:
            origin = {"checkpoint": resumed.path, "epoch": resumed.epoch, "batch": resumed.batch}
            if resumed.batch > 0:
                self.data["partial_epochs"].append(
                    {"epoch": resumed.epoch, "resumed_at_batch": resumed.batch,
                     "steps_per_epoch": steps_per_epoch}
                )  # fmt: skip
        self.data["runs"].append({"resumed_from": origin, "wall_time_s": 0.0})
        self.save()

    def save(self) -> None:
        """Updates the times and writes the record (chief only; others keep it in memory)."""
        import tfdist

        elapsed = time.perf_counter() - self._start
        if self.data["runs"]:
            self.data["runs"][-1]["wall_time_s"] = elapsed
        self.data["wall_time_s"] = self._before + elapsed
        if not tfdist.distribute.is_chief():
            return
        storage.makedirs(storage.dirname(self.path))
        # A kill never leaves half a record: renamed (local) or moved (URL) into place.
        with atomic.atomic_output(self.path, role=atomic.WriteRole(is_chief=True)) as staging:
            with open(staging, "w") as f:
                json.dump(self.data, f, indent=2)

    def callback(self):
        """A Keras callback that saves the record every few seconds and at epoch ends."""
        import keras

        record = self

        class _Clock(keras.callbacks.Callback):
            last = time.monotonic()

            def on_train_batch_end(self, batch, logs=None):
                if time.monotonic() - self.last >= _WRITE_EVERY_S:
                    self.last = time.monotonic()
                    record.save()

            def on_epoch_end(self, epoch, logs=None):
                record.save()

        return _Clock()
