"""Workers agree on the checkpoint before any of them restores it.

Workers that restore different checkpoints (or some none at all: a checkpoint directory
on local disks instead of shared storage) would train diverging replicas or wait forever
in a collective. One small all-gather of positions tells, and every worker fails at once
with the reason.

Example:
    >>> check_workers_agree(strategy, ("ckpt/ckpt-2.keras", info), "ckpt/")  # doctest: +SKIP
"""

from __future__ import annotations

import os

from tfdist import backends
from tfdist.checkpoint.names import parse_checkpoint_name

__all__ = ["archive_position", "check_workers_agree"]

NO_CHECKPOINT = (-1, -1, -1)


def archive_position(path: str, info: dict) -> tuple[int, int, int]:
    """(epoch, batch, step) of an inspected archive, from its metadata or its name.

    Example:
        >>> archive_position("ckpt/ckpt-3-50.keras", {"resume": None})
        (2, 50, 0)
    """
    meta = info["resume"]
    if meta is not None:
        return meta["epoch"], meta["batch"], int(meta.get("step") or 0)
    position = parse_checkpoint_name(os.path.basename(path))
    assert position is not None  # a restore candidate's path: a checkpoint name
    return position.epoch, position.batch, 0


def check_workers_agree(strategy, chosen: tuple[str, dict] | None, directory: str) -> None:
    """Under multi-worker training, fails unless every worker chose the same checkpoint.

    Args:
        chosen: ``(path, info)`` of the checkpoint this worker would restore (``info``
            from ``inspect_archive``), or None when it found none.

    Raises:
        RuntimeError: the workers' choices differ (on every worker at once).
    """
    mine = NO_CHECKPOINT if chosen is None else archive_position(*chosen)
    # Every worker's position (one row each, or one per replica); None on one worker.
    positions = backends.get().gather_rows(mine, strategy)
    if positions is None:
        return
    seen = sorted({tuple(row) for row in positions.tolist()})
    if len(seen) > 1:
        raise RuntimeError(
            "make_or_restore: the workers found different checkpoints (epoch, batch, step): "
            f"{seen}; {NO_CHECKPOINT} means no checkpoint. Received: checkpoint_dir="
            f"{directory!r}. Put checkpoint_dir on storage every worker shares (all workers "
            "read the chief's checkpoints)."
        )
