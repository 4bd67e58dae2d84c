"""Which thread destroys each data iterator Keras's TensorFlow ``fit`` makes, and the model
it trains (tests/compat/test_epoch_start.py).

Trains a small convnet (Conv2D, MaxPooling2D) for 3 epochs on a seeded
``tfdist.data.pipeline`` of 100 examples in global batches of 16 (a last batch of 4), in
``tfdist.scope()``; every iterator a ``DistributedDataset`` (or, on one device, a
``tf.data.Dataset``) makes during ``fit`` gets a finalizer that records the thread it died
on. Prints one ``EPOCH_START {json}`` line: the topology, the threads, the history and
the weights.
"""

import json
import threading
import time
import weakref

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import input_lib

import tfdist

deaths: list[str] = []
made: list[int] = []


depth = [0]


def watched(original):  # the iterators Keras asks for, not those they make inside
    def __iter__(self):
        depth[0] += 1
        try:
            iterator = original(self)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            made.append(1)
            weakref.finalize(iterator, lambda: deaths.append(threading.current_thread().name))
        return iterator

    return __iter__


for owner in (input_lib.DistributedDataset, tf.data.Dataset):
    owner.__iter__ = watched(owner.__iter__)

rng = np.random.RandomState(0)
x = rng.rand(100, 8, 8, 1).astype("float32")
y = rng.randint(0, 3, size=100).astype("int64")
train = tfdist.data.pipeline((x, y), global_batch=16, seed=0)

with tfdist.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

main_deaths = []


class DeathsPerEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        main_deaths.append(deaths.count("MainThread"))


history = model.fit(train, epochs=3, verbose=0, callbacks=[DeathsPerEpoch()])
during_fit = list(deaths)
deadline = time.monotonic() + 60  # the release thread polls every 0.25 s
while len(deaths) < len(made) - 2 and time.monotonic() < deadline:  # Keras keeps 2 at most
    time.sleep(0.1)

print(
    "EPOCH_START "
    + json.dumps(
        {
            "topology": {"replicas": tfdist.num_replicas()},
            "made": len(made),
            "died_during_fit": during_fit,
            "died_after_fit": deaths[len(during_fit) :],
            "main_thread_deaths_by_epoch_end": main_deaths,
            "values": {
                "loss": history.history["loss"],
                **{f"w{i}": w.tolist() for i, w in enumerate(model.get_weights())},
            },
        }
    ),
    flush=True,
)

# Exit right after an evaluate whose iterator the release thread is dropping (tf.data's
# destructor may still be waiting then): the process must end cleanly, exit code 0.
model.evaluate(train, verbose=0)
