"""Several MirroredStrategy objects in one process: each its own collective keys.

TensorFlow numbers a MirroredStrategy's collective all-reduces by a group key and an
instance key, and every MirroredStrategy starts both at the same numbers (group 1,
instance 100) for the same devices. The collective runtime remembers each instance's
shape: a second strategy in the process (a notebook or a benchmark that compares
``tfdist.scope()`` with a hand-written ``MirroredStrategy``, two models of another size)
reuses instance 100 for another shape and the step aborts: "Shape mismatch in the
collective instance 100 ... expected shape [347146] but another member in the group
expected shape [1]". Each strategy alone works. Upstream meets it whenever the two
strategies' first all-reduces differ in shape (two models of different sizes).

``tf_mirrored_collective_keys_apart`` starts the group keys of every MirroredStrategy
after the first of the process (and after a MultiWorkerMirroredStrategy) 10,000 apart,
unless the strategy's ``_collective_key_base`` was set already. The process's first
strategy keeps upstream's keys; the replicas of one strategy share its keys, as upstream.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import itertools

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "FIXES",
    "TF_MIRRORED_COLLECTIVE_KEYS_APART",
    "KEY_SPAN",
    "tf_mirrored_collective_keys_apart",
]

TF_MIRRORED_COLLECTIVE_KEYS_APART = "tf_mirrored_collective_keys_apart"
# Group keys a strategy may use before the next one's start: one per device set it
# all-reduces over (a handful), so 10,000 never overlaps.
KEY_SPAN = 10_000
# MirroredStrategy objects that made their collective keys in this process, counted for
# the interpreter's life: a strategy's keys live as long as the runtime's memory of them.
_MADE = itertools.count()


def tf_mirrored_collective_keys_apart() -> None:
    """Gives each MirroredStrategy after the process's first group keys of its own.

    Upstream's ``MirroredExtended._make_collective_ops_with_fallbacks`` builds
    ``CollectiveKeys(group_key_start=1 + _collective_key_base)``, with a base of 0 for
    every strategy. The fix sets the base to ``n * KEY_SPAN`` for the n-th strategy (n
    from 1, counting a MultiWorkerMirroredStrategy that configured the process's
    collectives as one) before that call; a base already set is kept.
    """

    def make(original):
        def _make_collective_ops_with_fallbacks(self):
            earlier = next(_MADE) + int(upstream.tf_collectives_configured())
            if earlier and upstream.tf_collective_key_base(self) == 0:
                upstream.tf_set_collective_key_base(self, earlier * KEY_SPAN)
            return original(self)

        return _make_collective_ops_with_fallbacks

    patch(
        upstream.tf_mirrored_extended_class(),
        "_make_collective_ops_with_fallbacks",
        TF_MIRRORED_COLLECTIVE_KEYS_APART,
        make,
    )


FIXES = [
    Fix(
        TF_MIRRORED_COLLECTIVE_KEYS_APART,
        "several tf.distribute.MirroredStrategy objects in one process share collective "
        "keys: a second strategy whose first all-reduce has another shape aborts ('Shape "
        "mismatch in the collective instance 100')",
        on_keras_backend("tensorflow"),
        tf_mirrored_collective_keys_apart,
        package="tensorflow",
        targets=targets(
            "tensorflow.python.distribute.mirrored_strategy:"
            "MirroredExtended._make_collective_ops_with_fallbacks",
            "tensorflow.python.distribute.mirrored_strategy:"
            "MirroredExtended._collective_key_base (instance)",
        ),
        acts_where=(
            "a MirroredStrategy created after another (or after a multi-worker strategy) in "
            "one process: its group keys start elsewhere; the process's first: upstream's"
        ),
        no_harm=(
            "tests/compat/test_collective_keys.py::test_two_strategies_in_one_process_each_equal_one_device",
            "tests/compat/test_collective_keys.py::test_models_of_one_size_train_as_upstream_with_the_fixes_and_without",
        ),
    ),
]
