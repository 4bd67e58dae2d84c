"""Where training stands in its data: the one position concept of checkpoints and pipelines.

Example:
    >>> Position(2, 50)          # 50 global batches done in the third epoch (index 2)
    Position(epoch=2, batch=50)
    >>> Position(3) > Position(2, 50)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Position"]


@dataclass(frozen=True, order=True)
class Position:
    """``batch`` global batches done in 0-based epoch ``epoch``.

    A checkpoint saved there is ``ckpt-3.keras`` for ``Position(3)`` ("3 epochs done")
    and ``ckpt-3-50.keras`` for ``Position(2, 50)``; a seeded pipeline at that position
    draws its next iteration's order from ``(seed, epoch)`` and skips ``batch`` batches.
    """

    epoch: int = 0
    batch: int = 0
