"""(in progress)"""

from __future__ import annotations

from tfdist.compat.registry import Fix

FIXES: list[Fix] = []
