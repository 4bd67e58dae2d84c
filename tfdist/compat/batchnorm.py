"""The Fix record of ``tfdist.batchnorm``'s hook on ``BatchNormalization.build``.

The hook itself lives with the feature it serves (``tfdist.scope(sync_batchnorm=True)``
and the warning about per-replica statistics): ``tfdist.batchnorm``.
"""

from __future__ import annotations

from tfdist import batchnorm
from tfdist.core.fix_registry import Fix, on_keras_backend, targets

FIXES = [
    Fix(
        batchnorm.FIX_NAME,
        batchnorm.SUMMARY,
        on_keras_backend("tensorflow"),
        batchnorm.install,
        targets=targets(*batchnorm.TARGETS),
        acts_where=(
            "BatchNormalization(synchronized=False).build under a strategy with >1 replica "
            "(synchronized in sync_batchnorm scope, else warned once); otherwise upstream's"
        ),
        no_harm=(),  # none yet
    )
]
