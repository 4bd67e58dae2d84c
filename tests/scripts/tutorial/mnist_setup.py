# The official TensorFlow tutorial "Multi-worker training with Keras"
# (https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras), mnist_setup.py.
# One change: MNIST comes from tensorflow_datasets (TFDS_DATA_DIR, never downloaded)
# instead of tf.keras.datasets.mnist.load_data(), so the test runs offline.
import os

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds


def mnist_dataset(batch_size):
    # Changed from the tutorial: tfds instead of the Keras download.
    x_train, y_train = tfds.as_numpy(
        tfds.load(
            "mnist",
            split="train",
            batch_size=-1,
            as_supervised=True,
            download=False,
            data_dir=os.environ.get("TFDS_DATA_DIR"),
        )
    )
    x_train = x_train[..., 0]  # (60000, 28, 28, 1) -> (60000, 28, 28), as load_data() gives
    # Unchanged from here on.
    # The `x` arrays are in uint8 and have values in the [0, 255] range.
    # You need to convert them to float32 with values in the [0, 1] range.
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    train_dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(60000)
        .repeat()
        .batch(batch_size)
    )
    return train_dataset


def build_and_compile_cnn_model():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=(28, 28)),
            tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
        metrics=["accuracy"],
    )
    return model
