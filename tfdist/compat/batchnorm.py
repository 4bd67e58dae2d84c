"""The Fix record of ``tfdist.batchnorm``'s hook on ``BatchNormalization.build``.

The hook and its record (``tfdist.batchnorm.FIX``) live with the feature it serves
(``tfdist.scope(sync_batchnorm=True)`` and the warning about per-replica statistics):
``tfdist.batchnorm``. Listed here so that ``apply_all`` applies it with the others.
"""

from __future__ import annotations

from tfdist import batchnorm

FIXES = [batchnorm.FIX]
