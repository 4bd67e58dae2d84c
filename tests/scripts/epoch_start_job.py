"""What tf.distribute's multi-device data iterators autotune during Keras's ``fit``, and the
model it trains (tests/compat/test_epoch_start.py).

Trains the tutorials' layers (Conv2D, BatchNormalization, MaxPooling2D) for 3 epochs on a
seeded pipeline of 100 examples in global batches of 16 (a last batch of 4), with
``map(num_parallel_calls=AUTOTUNE)`` and ``prefetch(AUTOTUNE)``, in ``tfdist.scope()``,
then evaluates and predicts; then fits one epoch on the same pipeline with
``options.autotune.enabled = True`` set by the user. Records, for every host pipeline an
``OwnedMultiDeviceIterator`` iterates and every per-device dataset it builds, the
``autotune.enabled`` option (None: tf.data's default, on). Prints one ``EPOCH_START {json}``
line. ``TFDIST_TEST_FAULT`` (tests/scripts/faults.py: ``nan``, ``one_device``) injects a
fault tests/e2e/test_checks_catch_faults.py must see caught.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import faults  # noqa: E402

if faults.active("one_device"):
    os.environ.pop("TFDIST_CPU_DEVICES", None)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.data.ops import dataset_ops, multi_device_iterator_ops  # noqa: E402

import tfdist  # noqa: E402
import tfdist.compat  # noqa: E402

tfdist.compat.apply_all()  # the fixes first: the spies below wrap them

seen = {"host": [], "device": []}


def spy_host(original):  # OwnedMultiDeviceIterator calls it on the pipeline it iterates
    def _apply_debug_options(self):
        caller = sys._getframe(1).f_locals.get("self")  # others call it too
        if isinstance(caller, multi_device_iterator_ops.OwnedMultiDeviceIterator):
            seen["host"].append(self.options().autotune.enabled)
        return original(self)

    return _apply_debug_options


def spy_device(original):
    def _create_device_dataset(*args, **kwargs):
        dataset = original(*args, **kwargs)
        seen["device"].append(dataset.options().autotune.enabled)
        return dataset

    return _create_device_dataset


dataset_ops.DatasetV2._apply_debug_options = spy_host(dataset_ops.DatasetV2._apply_debug_options)
multi_device_iterator_ops._create_device_dataset = spy_device(
    multi_device_iterator_ops._create_device_dataset
)

rng = np.random.RandomState(0)
x = rng.rand(100, 8, 8, 1).astype("float32")
y = rng.randint(0, 3, size=100).astype("int64")
train = (
    tf.data.Dataset.from_tensor_slices((x, y))
    .map(lambda a, b: (a * 2.0 - 1.0, b), num_parallel_calls=tf.data.AUTOTUNE)
    .batch(16)
    .prefetch(tf.data.AUTOTUNE)
)

with tfdist.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

history = model.fit(train, epochs=3, verbose=0, validation_data=train)
evaluated = model.evaluate(train, verbose=0, return_dict=True)
predicted = model.predict(train, verbose=0)
fit_default = {key: list(values) for key, values in seen.items()}

for values in seen.values():
    values.clear()
chosen = tf.data.Options()
chosen.autotune.enabled = True
model.fit(train.with_options(chosen), epochs=1, verbose=0)
weights = model.get_weights()
if faults.active("nan"):
    weights[0].flat[0] = np.nan

print(
    "EPOCH_START "
    + json.dumps(
        {
            "topology": {"replicas": tfdist.num_replicas()},
            "autotune": fit_default,
            "autotune_user_chose_on": seen,
            "values": {
                **{key: list(values) for key, values in history.history.items()},
                **{f"evaluate {key}": value for key, value in evaluated.items()},
                "predict": predicted.tolist(),
                **{f"w{i}": w.tolist() for i, w in enumerate(weights)},
            },
        }
    ),
    flush=True,
)
