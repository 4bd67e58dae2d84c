"""Keras 3 on TensorFlow converts a scalar distributed variable with ``int()`` and ``float()`` (``keras_tf_scalar_of_a_mirrored_variable``).

Every private Keras/TensorFlow name used comes from ``tfdist.core.upstream``.

Example:
    >>> [fix.name for fix in FIXES]
    ['keras_tf_scalar_of_a_mirrored_variable']
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE",
    "FIXES",
    "keras_tf_scalar_of_a_mirrored_variable",
]

# The fix's name, declared once (other layers import it).
KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE = "keras_tf_scalar_of_a_mirrored_variable"


# ------------------------------------------------- fix: int() of a mirrored variable


def keras_tf_scalar_of_a_mirrored_variable() -> None:
    """Makes ``int()`` and ``float()`` of a scalar Keras variable work under a strategy.

    A callback that reads ``int(self.model.optimizer.iterations)`` (Keras's own
    callback tests do; learning-rate warm-ups do) fails under Mirrored and
    MultiWorkerMirroredStrategy: Keras's ``Variable.__int__`` calls ``int(self.value)``,
    and the value there is a ``MirroredVariable``, which has no ``__int__`` ("int()
    argument must be ... not 'MirroredVariable'"). ``np.asarray`` of the same variable
    works and reads its value. The fix converts such a distributed value through NumPy,
    as one device's ``tf.Variable`` converts; a variable that is not distributed, or
    not a scalar (upstream's TypeError), takes upstream's path.
    """

    def make(original, kind):
        def convert(self):
            import numpy as np
            import tensorflow as tf

            if self.ndim > 0 or not isinstance(self.value, tf.distribute.DistributedValues):
                return original(self)
            return kind(np.asarray(self))

        return convert

    variable = upstream.keras_backend_variable_class()
    patch(variable, "__int__", KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE, lambda o: make(o, int))
    patch(variable, "__float__", KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE, lambda o: make(o, float))


FIXES: list[Fix] = [
    Fix(
        KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE,
        "Keras 3 under Mirrored/MultiWorkerMirroredStrategy: int() or float() of a scalar "
        "variable (int(model.optimizer.iterations) in a callback) raises 'int() argument "
        "must be ... not MirroredVariable'",
        on_keras_backend("tensorflow"),
        keras_tf_scalar_of_a_mirrored_variable,
        targets=targets(
            "keras.src.backend.common.variables:Variable.__int__",
            "keras.src.backend.common.variables:Variable.__float__",
            "keras.src.backend:Variable",
        ),
        acts_where=(
            "int() and float() of a scalar Keras variable whose value is distributed (built "
            "under a strategy); other variables and shapes: upstream's"
        ),
        no_harm=(
            "tests/compat/test_upstream_keras.py::test_keras_tests_under_tfdist_scope_fail_with_the_fixes_only_where_they_fail_without",
        ),
    ),
]
