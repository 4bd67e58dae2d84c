"""A scalar distributed variable read as one device reads it: ``int()`` and ``float()`` of a Keras
variable (``keras_tf_scalar_of_a_mirrored_variable``), ``np.asarray`` of its value in a
strategy's scope (``tf_numpy_of_a_distributed_scalar``).

Every private Keras/TensorFlow name used comes from ``tfdist.core.upstream``.

Example:
    >>> [fix.name for fix in FIXES]
    ['keras_tf_scalar_of_a_mirrored_variable', 'tf_numpy_of_a_distributed_scalar']
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets, wrap

__all__ = [
    "TF_NUMPY_OF_A_DISTRIBUTED_SCALAR",
    "tf_numpy_of_a_distributed_scalar",
    "KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE",
    "FIXES",
    "keras_tf_scalar_of_a_mirrored_variable",
]

# The fixes' names, declared once (other layers import them).
KERAS_TF_SCALAR_OF_A_MIRRORED_VARIABLE = "keras_tf_scalar_of_a_mirrored_variable"
TF_NUMPY_OF_A_DISTRIBUTED_SCALAR = "tf_numpy_of_a_distributed_scalar"


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


# ------------------------------------------------- fix: NumPy of a distributed scalar


def tf_numpy_of_a_distributed_scalar() -> None:
    """Makes ``np.asarray`` of a scalar mirrored variable's value work in a strategy's scope.

    A ``MirroredVariable`` has no ``__array__``: NumPy gets it through the variable's
    ``__getattr__``, from the value on this device. Inside a strategy's scope (and under
    a process-default strategy, as unscoped models set up) that value is a tensor read
    for the cross-replica context, whose ``__array__`` gives a NumPy scalar for a 0-d
    tensor. NumPy 2 refuses that ("object __array__ method not producing an array"), so
    ``np.asarray(layer.count.value)`` or ``keras.ops.convert_to_numpy(v.value)`` of a
    Normalization layer's count raises, where one device gives a 0-d array. The fix wraps
    only that result: an ``__array__`` that returned an array is returned as it is, and a
    NumPy scalar becomes the 0-d array it holds.
    """

    owner = upstream.tf_distributed_delegate_class()
    wrap(owner, "__getattr__", TF_NUMPY_OF_A_DISTRIBUTED_SCALAR, _array_as_an_array)


def _array_as_an_array(original, self, name):
    """Upstream's attribute; ``__array__`` made to return an array where it gave a scalar."""
    found = original(self, name)
    if name != "__array__":
        return found

    def __array__(dtype=None, copy=None):  # NumPy 2 passes copy; the tensor's takes none
        import numpy as np

        result = found() if dtype is None else found(dtype)
        return result if isinstance(result, np.ndarray) else np.asarray(result)

    return __array__


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
    Fix(
        TF_NUMPY_OF_A_DISTRIBUTED_SCALAR,
        "TensorFlow with NumPy 2, in a strategy's scope: np.asarray of a scalar mirrored "
        "variable's value raises 'object __array__ method not producing an array'",
        on_keras_backend("tensorflow"),
        tf_numpy_of_a_distributed_scalar,
        targets=targets(
            "tensorflow.python.distribute.values:DistributedDelegate.__getattr__",
            "tensorflow.python.framework.ops:_EagerTensorBase.__array__",
        ),
        acts_where=(
            "np.asarray / __array__ of a distributed value whose value on this device gives "
            "a NumPy scalar (0-d, in a strategy's scope); arrays and every other attribute: "
            "upstream's"
        ),
        no_harm=(
            "tests/compat/test_scalar_variables.py::test_numpy_of_a_distributed_value_is_unchanged_where_upstream_reads_it",
        ),
        package="tensorflow",
    ),
]
