"""Image classification from scratch: augmentation layers in a ``tf.data`` map, BatchNorm.

The shape of Keras's "Image classification from scratch" example: a batched ``tf.data``
of images whose ``map`` applies a list of RandomFlip and RandomRotation layers (a list, not a
Sequential: on JAX only the preprocessing layers themselves run inside ``tf.data``), then a convnet
with Rescaling, Conv2D + BatchNormalization blocks (no bias before a BatchNormalization: its
gradient is zero but for rounding, which Adam scales up to steps of the learning rate's size),
global pooling and a sigmoid output.
Random 32x32x3 images with two classes stand in for the cats and dogs.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

keras.utils.set_random_seed(11)
image_size = (32, 32)
rng = np.random.default_rng(11)
images = rng.integers(0, 256, (250, *image_size, 3)).astype(np.float32)
labels = rng.integers(0, 2, 250).astype(np.float32)

data_augmentation_layers = [layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)]


def data_augmentation(images):
    for layer in data_augmentation_layers:
        images = layer(images)
    return images


train_ds = tf.data.Dataset.from_tensor_slices((images, labels)).batch(32)
# One call at a time: the layers' random state then advances in batch order, as a
# reproducible run needs (num_parallel_calls=AUTOTUNE gives batches its draws in any order).
train_ds = train_ds.map(lambda img, label: (data_augmentation(img), label))
train_ds = train_ds.prefetch(tf.data.AUTOTUNE)

inputs = keras.Input(shape=(*image_size, 3))
x = layers.Rescaling(1.0 / 255)(inputs)
x = layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(x)
x = layers.BatchNormalization()(x)
x = layers.Activation("relu")(x)
x = layers.Conv2D(16, 3, padding="same", use_bias=False)(x)
x = layers.BatchNormalization()(x)
x = layers.Activation("relu")(x)
x = layers.GlobalAveragePooling2D()(x)
outputs = layers.Dense(1, activation="sigmoid")(x)
model = keras.Model(inputs, outputs)

model.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    loss="binary_crossentropy",
    metrics=[keras.metrics.BinaryAccuracy(name="acc")],
)
history = model.fit(train_ds, epochs=2, verbose=2)

if __name__ == "__main__":
    import record

    record.save(__file__, model, history)
