"""``ArchiveWriter``: the one write of a ``.keras`` checkpoint, for ``fit`` and custom loops.

Both ``tfdist.callbacks.checkpoint`` and ``tfdist.loops.Checkpointer`` write through it:
every worker runs ``model.save`` into a staging path (reading distributed variables may
be collective), adds the extra members it is given and the resume metadata, and only the
chief's file lands, atomically (``tfdist.core.atomic.atomic_output``: rename on local
disk, upload then move for a URL); every worker then waits for it
(``tfdist.saving.sync_workers``) and the chief prunes to ``max_to_keep``. The directory
is a local path or any fsspec URL (``tfdist.core.storage``). ``exit_for_restart`` ends the
SIGTERM protocol (``tfdist.checkpoint.preemption``) once the preemption save is written.

Example:
    >>> writer = ArchiveWriter("ckpt/", max_to_keep=3)                 # doctest: +SKIP
    >>> writer.write(model, Position(1, 4), resume_metadata(...))      # doctest: +SKIP
    '/abs/ckpt/ckpt-2-4.keras'
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import NoReturn

from tfdist import saving
from tfdist.checkpoint.archive import write_resume_metadata
from tfdist.checkpoint.names import checkpoint_name, list_checkpoints
from tfdist.checkpoint.preemption import PreemptionWatch
from tfdist.core import atomic, config, storage
from tfdist.core.position import Position

__all__ = ["ArchiveWriter", "exit_for_restart"]

logger = logging.getLogger(__name__)


class ArchiveWriter:
    """Writes ``ckpt-{epoch}[-{batch}].keras`` archives into one directory (see module).

    Args:
        directory: the checkpoint directory, as ``check_save_target`` returned it (an
            absolute local path or a URL).
        max_to_keep: archives kept after each write (the newest); None keeps all.
        role: who this process is (``atomic.write_role()`` when None).
    """

    def __init__(
        self, directory: str, *, max_to_keep: int | None, role: atomic.WriteRole | None = None
    ):
        self.directory = directory
        self.max_to_keep = max_to_keep
        self.role = atomic.write_role() if role is None else role

    def path(self, position: Position) -> str:
        """Where the archive of ``position`` goes."""
        return storage.join(self.directory, checkpoint_name(position.epoch, position.batch))

    def prepare(self) -> None:
        """Before the first write: the chief creates the directory and removes what a
        killed writer left (staging files); others do nothing."""
        if self.role.is_chief:
            storage.makedirs(self.directory)
            atomic.remove_stale_staging(self.directory)

    def write(
        self,
        model,
        position: Position,
        meta: dict,
        *,
        members: Mapping[str, Callable[[], bytes]] | None = None,
        preemption_timeout: float | None = None,
    ) -> str:
        """Writes ``position``'s archive on every worker; returns its path once the chief's
        file is in place (and older ones pruned).

        ``members``: extra archive members, name -> a function giving their bytes (called
        after ``model.save``, on every worker). ``preemption_timeout``: this is the SIGTERM
        save: wait that long for the other workers, and log rather than raise when one
        does not come (the chief's file is written; exiting for the restart matters more).
        """
        path = self.path(position)
        with atomic.atomic_output(path, role=self.role) as staging:
            model.save(staging)
            for member, data in (members or {}).items():
                atomic.add_archive_member(staging, member, data())
            write_resume_metadata(staging, meta)
        self._wait_for_chief(path, model, preemption_timeout)
        if self.role.is_chief:
            self.prune(keep=path)
        return path

    def _wait_for_chief(self, path: str, model, preemption_timeout: float | None) -> None:
        """Every worker waits until the chief's file is in place (a no-op on one worker)."""
        try:
            name = f"checkpoint {storage.basename(path)}"
            saving.sync_workers(name, timeout=preemption_timeout, model=model)
        except RuntimeError as err:
            if preemption_timeout is None:
                raise
            # The preemption save is written (on the chief); exiting for the restart
            # matters more than waiting for a worker that saved at another step.
            logger.error("tfdist: after the preemption save: %s", err)

    def prune(self, keep: str | None) -> None:
        """Removes the oldest archives beyond ``max_to_keep`` (never ``keep``)."""
        if self.max_to_keep is None:
            return
        found = list_checkpoints(self.directory)
        for _position, path in found[: max(len(found) - self.max_to_keep, 0)]:
            if path != keep:  # both joined from self.directory: the same spelling
                storage.remove(path)


def exit_for_restart(step: int, watch: PreemptionWatch | None) -> NoReturn:
    """Ends the SIGTERM protocol after the preemption save: exits ``RESTART_EXIT_CODE``.

    Example:
        >>> exit_for_restart(120, watch)  # doctest: +SKIP
        SystemExit: 75
    """
    if watch is not None:
        watch.cancel()
    logger.warning(
        "tfdist: preemption checkpoint saved at step %d; exiting with code %d (restart me)",
        step,
        config.RESTART_EXIT_CODE,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(config.RESTART_EXIT_CODE)
