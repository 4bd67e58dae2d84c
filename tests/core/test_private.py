"""Every private TensorFlow/Keras name tfdist uses still exists in the installed versions.

When an upgrade moves one, the failure names the ``tfdist.core.upstream`` entry to update,
instead of training breaking somewhere else.
"""

from __future__ import annotations

import inspect

import pytest

from tfdist.core import upstream

ENTRIES = [entry for entries in upstream.REQUIRED.values() for entry in entries]


@pytest.mark.parametrize("entry", ENTRIES)
def test_private_name_exists(entry):
    upstream.resolve(entry)


def _instances():
    """One live object of each kind listed in INSTANCE_ATTRIBUTES."""
    import keras
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    dataset = tf.data.Dataset.from_tensor_slices((tf.zeros([4, 2]), tf.zeros([4])))
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dropout(0.5, seed=1), keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
    model.fit(dataset.batch(2), epochs=1, verbose=0)
    trainer = upstream.keras_tf_trainer_module()
    iterator = trainer.TFEpochIterator(x=dataset.batch(2), distribute_strategy=strategy)
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0"])
    spec = mirrored.experimental_distribute_dataset(dataset.batch(2)).element_spec
    per_replica = tf.nest.flatten(spec, expand_composites=False)[0]
    extended = tf.distribute.MultiWorkerMirroredStrategy().extended
    return {
        "eager context": upstream.tf_context(),
        "PerReplicaSpec": per_replica
        if isinstance(per_replica, upstream.tf_per_replica_spec_class())
        else upstream.tf_per_replica_spec_class()(tf.TensorSpec([2])),
        "keras TFEpochIterator": iterator,
        "tf.data batch": dataset.batch(3),
        "keras optimizer": model.optimizer,
        "keras model": model,
        "keras layer": model.layers[0],
        "CollectiveAllReduceExtended": extended,
    }


def test_private_instance_attributes_exist():
    instances = _instances()
    assert set(instances) == set(upstream.INSTANCE_ATTRIBUTES)
    missing = [
        f"{kind}.{attribute}"
        for kind, attributes in upstream.INSTANCE_ATTRIBUTES.items()
        for attribute in attributes
        if not hasattr(instances[kind], attribute)
    ]
    assert not missing


def test_every_helper_is_exported_and_documented():
    helpers = [
        name
        for module in (upstream, *upstream.HELPER_MODULES)
        for name, value in vars(module).items()
        if inspect.isfunction(value) and value.__module__ == module.__name__
    ]
    assert sorted(set(helpers) - set(upstream.__all__)) == []
    assert all(getattr(upstream, name).__doc__ for name in helpers)


def test_seed_generators_are_found_through_nested_layers():
    import keras

    inner = keras.Sequential([keras.layers.Dropout(0.5, seed=3)])
    model = keras.Sequential([keras.Input((2,)), inner, keras.layers.Dropout(0.2, seed=4)])
    assert len(upstream.keras_seed_generators(model)) == 2


@pytest.mark.parametrize("entry", upstream.SOURCE_ATTRIBUTES)
def test_private_instance_attribute_is_set_by_its_class(entry):
    from tfdist.core import fix_registry

    fix = fix_registry.Fix(
        "probe",
        "s",
        lambda: True,
        lambda: None,
        targets=fix_registry.targets(entry + " (instance)"),
    )
    assert fix_registry.guard(fix) is None
