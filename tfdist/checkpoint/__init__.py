"""Restartable training: ``make_or_restore``, the checkpoint callback, exact resume, preemption.

A restartable script is a plain Keras script::

    model, initial_epoch = tfdist.make_or_restore(build_and_compile, "ckpt/")
    model.fit(train, epochs=12, initial_epoch=initial_epoch,
              callbacks=[tfdist.callbacks.checkpoint("ckpt/", save_freq=100)])

Checkpoints are ``ckpt-{epoch}.keras`` after an epoch (the Keras guides' naming; they
load with ``keras.models.load_model``) and ``ckpt-{epoch}-{batch}.keras`` after
``batch`` batches of epoch ``epoch`` (1-based, like Keras's ``{epoch}``/``{batch}``).
Each archive also carries ``tfdist/resume.json``: the position (epoch, batches done),
the global step and the dropout RNG state (Keras's ``SeedGenerator`` variables, which
``.keras``/``.weights.h5`` files leave out). Restoring puts weights, optimizer state
(iterations, slots, learning rate) and RNG state back, and tells the data pipeline
(``tfdist.data.set_position``) to skip the batches already trained in the resumed
epoch, so the resumed job neither replays nor skips a batch (Keras's
``BackupAndRestore`` restarts an interrupted epoch at batch 0).

Writes are atomic (staging file in the same directory, fsync, rename) and only the
chief's files land in the checkpoint directory. The directory may be a URL (``gs://``,
``s3://``, any fsspec filesystem): files are staged locally, uploaded under a staging
name and moved onto the final one; ``tfdist.core.storage`` says what each store guarantees. On SIGTERM the callback saves at the
next step boundary (all workers agree on which) and exits with
``tfdist.config.RESTART_EXIT_CODE`` (75), which ``tfdist launch`` treats as "restart me".

The modules, each one idea; imports flow down this list only:

- ``names``: the checkpoint directory, its file names and their positions.
- ``archive``: an archive's resume metadata member and its end-to-end check.
- ``sharded``: sharded, asynchronous Orbax checkpoints (JAX): names, writer, reader.
- ``rng``: the training state Keras does not save (dropout RNG, phantom steps).
- ``agreement``: workers agree on the checkpoint before restoring it.
- ``restore``: ``make_or_restore`` and what a model was restored from.
- ``preemption``: the SIGTERM protocol (save at an agreed step, exit 75).
- ``writer``: ``ArchiveWriter``, the one archive write (``fit``'s callback and the
  custom-loop ``Checkpointer``): stage, save, metadata, sync, prune; the exit for restart.
- ``callback``: ``ResumableCheckpoint``, the callback that writes checkpoints.

Example:
    >>> checkpoint_name(2, 50), parse_checkpoint_name("ckpt-3-50.keras")
    ('ckpt-3-50.keras', Position(epoch=2, batch=50))
    >>> model, initial_epoch = make_or_restore(build_and_compile, "ckpt/")  # doctest: +SKIP
"""

from __future__ import annotations

from tfdist.checkpoint.archive import RESUME_MEMBER, read_resume_metadata
from tfdist.checkpoint.callback import ResumableCheckpoint, ShardedCheckpoint
from tfdist.checkpoint.names import (
    CORRUPT_SUFFIX,
    checkpoint_name,
    list_checkpoints,
    parse_checkpoint_name,
)
from tfdist.checkpoint.restore import (
    ResumeState,
    is_resumed_partial_epoch,
    make_or_restore,
    resume_state,
)
from tfdist.core.position import Position

__all__ = [
    "Position",
    "ResumeState",
    "ResumableCheckpoint",
    "ShardedCheckpoint",
    "make_or_restore",
    "list_checkpoints",
    "checkpoint_name",
    "parse_checkpoint_name",
    "resume_state",
    "is_resumed_partial_epoch",
    "read_resume_metadata",
    "RESUME_MEMBER",
    "CORRUPT_SUFFIX",
]
