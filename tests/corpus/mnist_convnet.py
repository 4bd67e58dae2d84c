"""A small convnet on MNIST-shaped digits, with Dropout before its classifier.

The shape of Keras's "Simple MNIST convnet" example: two Conv2D + MaxPooling2D blocks,
Flatten, Dropout(0.5), a softmax Dense, categorical cross-entropy, Adam, then ``evaluate``
on held-out digits. Random 28x28x1 images stand in for MNIST.
"""

import keras
import numpy as np
from keras import layers

keras.utils.set_random_seed(7)
num_classes = 10
input_shape = (28, 28, 1)

rng = np.random.default_rng(7)
x_train = rng.random((250, *input_shape), dtype=np.float32)
y_train = keras.utils.to_categorical(rng.integers(0, num_classes, 250), num_classes)
x_test = rng.random((66, *input_shape), dtype=np.float32)
y_test = keras.utils.to_categorical(rng.integers(0, num_classes, 66), num_classes)

model = keras.Sequential(
    [
        keras.Input(shape=input_shape),
        layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(num_classes, activation="softmax"),
    ]
)
model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
history = model.fit(x_train, y_train, batch_size=32, epochs=2, shuffle=False, verbose=2)
score = model.evaluate(x_test, y_test, verbose=0)
print("Test loss:", score[0], "Test accuracy:", score[1])

if __name__ == "__main__":
    import record

    record.save(__file__, model, history, outputs=[score])
