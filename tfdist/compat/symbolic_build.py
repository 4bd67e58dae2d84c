"""Keras 3 on TensorFlow builds a model's step symbolically from one replica's batch spec under a strategy (``keras_tf_symbolic_build_from_spec``).

Every private Keras/TensorFlow name used comes from ``tfdist.core.upstream``.

Example:
    >>> [fix.name for fix in FIXES]
    ['keras_tf_symbolic_build_from_spec']
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["KERAS_TF_SYMBOLIC_BUILD_FROM_SPEC", "FIXES", "keras_tf_symbolic_build_from_spec"]

# The fix's name, declared once (other layers import it).
KERAS_TF_SYMBOLIC_BUILD_FROM_SPEC = "keras_tf_symbolic_build_from_spec"


# ------------------------------------------------- fix: symbolic build from the spec


def _symbolic_batch(iterator):
    """KerasTensors shaped like one replica's batch, from the dataset's element_spec.

    Returns None when a spec has an unknown rank (a ``py_function`` without
    ``set_shape``): then only a real batch tells the shapes.
    """
    import keras
    import tensorflow as tf

    per_replica_spec = upstream.tf_per_replica_spec_class()
    dataset = upstream.tf_distributed_dataset(iterator)
    if dataset is None:
        return None

    class _UnknownRank(Exception):
        pass

    def to_symbolic(spec):
        if isinstance(spec, per_replica_spec):  # one spec per local replica, all alike
            spec = upstream.tf_per_replica_component_spec(spec)
        if isinstance(spec, tf.OptionalSpec) or type(spec).__name__ == "NoneTensorSpec":
            return None  # the trainer turns optionals and Nones into None too
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None:
            raise _UnknownRank
        return keras.KerasTensor(
            tuple(shape.as_list()), dtype=keras.backend.standardize_dtype(spec.dtype)
        )

    try:
        return tf.nest.map_structure(to_symbolic, dataset.element_spec)
    except _UnknownRank:
        return None


def _local_batch(strategy, iterator):
    """One real batch as this worker's first replica sees it: no cross-worker reduce."""
    import tensorflow as tf

    for _, _, it in iterator:
        batch = next(it)
        break
    else:  # pragma: no cover - an empty dataset fails later, in the trainer, with its message
        return None

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return tf.nest.map_structure(local, batch)


def keras_tf_symbolic_build_from_spec() -> None:
    """Builds the model for ``fit``/``evaluate`` from the dataset's spec, not a real batch.

    Upstream ``TensorFlowTrainer._maybe_symbolic_build`` pulls one batch from the
    distributed iterator and averages it across replicas with
    ``strategy.reduce("MEAN", batch, axis=None)``, only to read its shapes and dtypes.
    Under MultiWorkerMirroredStrategy that reduce is a cross-worker collective on a
    nested batch and fails ("Attempt to convert a value (PerReplica...)"). It also
    costs every ``fit``/``evaluate`` one extra pass over a batch, which a pipeline that
    counts its iterations sees.

    The fix passes KerasTensors made from the distributed dataset's ``element_spec``
    (the spec of one replica's batch) to the same ``_symbolic_build``. That is exactly
    the information the averaged batch carried (shape and dtype; the batch dimension
    may be None, as for any ``keras.Input``), so the model, metrics and loss are built
    identically, and no data is read. When a spec has an unknown rank, it falls back
    to one real batch and takes this worker's first replica's part of it (shapes are
    equal on all replicas), which needs no cross-worker reduce either.
    """
    tf_trainer = upstream.keras_tf_trainer_module()

    def make(original):
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            explicit = upstream.keras_model_strategy_or_none(self)
            if explicit is None or iterator is None or data_batch is not None:
                return original(self, iterator=iterator, data_batch=data_batch)
            batch = _symbolic_batch(iterator)
            if batch is None:
                batch = _local_batch(self.distribute_strategy, iterator)
            with self.distribute_strategy.scope():
                upstream.keras_symbolic_build(self, batch)

        return _maybe_symbolic_build

    patch(
        tf_trainer.TensorFlowTrainer,
        "_maybe_symbolic_build",
        KERAS_TF_SYMBOLIC_BUILD_FROM_SPEC,
        make,
    )


_KT = "keras.src.backend.tensorflow.trainer:"

FIXES: list[Fix] = [
    Fix(
        KERAS_TF_SYMBOLIC_BUILD_FROM_SPEC,
        "Keras 3 fit/evaluate under MultiWorkerMirroredStrategy: 'Attempt to convert a "
        "value (PerReplica...)' in TensorFlowTrainer._maybe_symbolic_build",
        on_keras_backend("tensorflow"),
        keras_tf_symbolic_build_from_spec,
        targets=targets(
            _KT + "TensorFlowTrainer._maybe_symbolic_build",
            _KT + "TensorFlowTrainer._symbolic_build",
            _KT + "TensorFlowTrainer._distribute_strategy (instance)",
            _KT + "TFEpochIterator._distributed_dataset (instance)",
            "tensorflow.python.distribute.values:PerReplicaSpec._component_specs",
        ),
        acts_where=(
            "fit/evaluate of a model built in a tf.distribute strategy's scope (any replica "
            "count); no model strategy, `*_on_batch`: upstream's path"
        ),
        no_harm=(
            "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes",
            "tests/compat/test_upstream_keras.py::test_keras_tests_fail_with_the_fixes_only_where_they_fail_without[tensorflow]",
        ),
    ),
]
