"""A script in the TensorFlow tutorials' order: data first, then the pipeline and the scope.

``tfds.load`` (a TensorFlow op) runs before anything creates a strategy; tfdist must still
give it TFDIST_CPU_DEVICES replicas, or a multi-worker strategy under ``tfdist launch``.
Prints one JSON line: replicas, workers, the loss per epoch and the final weights.
"""

# ruff: noqa: I001 - the tutorials import tfdist first, then their libraries
import json

import tfdist

import tensorflow_datasets as tfds

train_ds = tfds.load("mnist", split="train[:2048]", as_supervised=True)  # TF starts here
per_replica = 64 // tfdist.num_replicas()  # the same global batch on any replica count
train = tfdist.data.pipeline(train_ds, per_replica, map_fn=tfdist.data.scale, seed=0)

import keras  # noqa: E402

with tfdist.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        keras.optimizers.SGD(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
history = model.fit(train, epochs=2, verbose=0)
print(
    json.dumps(
        {
            "replicas": tfdist.num_replicas(),
            "workers": tfdist.num_workers(),
            "loss": history.history["loss"],
            "weights": [w.tolist() for w in model.get_weights()],
        }
    )
)
