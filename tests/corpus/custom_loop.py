"""A training loop written from scratch: ``tf.GradientTape`` over a ``tf.data`` in a ``tf.function``.

The shape of Keras's "Writing a training loop from scratch in TensorFlow" guide: a
functional model, an optimizer, a loss and an accuracy metric used by hand; a
``@tf.function`` step computes the loss under a ``GradientTape`` and calls
``optimizer.apply``; two epochs over a batched ``tf.data``, logging the mean loss and
the accuracy of each. Random MNIST-shaped vectors stand in for MNIST.
"""

import keras
import numpy as np
import tensorflow as tf

keras.utils.set_random_seed(43)
rng = np.random.default_rng(43)
x_train = rng.random((250, 784)).astype("float32")
y_train = rng.integers(0, 10, 250)

inputs = keras.Input(shape=(784,), name="digits")
x = keras.layers.Dense(32, activation="relu")(inputs)
x = keras.layers.Dense(32, activation="relu")(x)
outputs = keras.layers.Dense(10, name="predictions")(x)
model = keras.Model(inputs=inputs, outputs=outputs)

optimizer = keras.optimizers.SGD(learning_rate=1e-2)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
train_acc_metric = keras.metrics.SparseCategoricalAccuracy()
train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(32)


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss_value = loss_fn(y, logits)
    grads = tape.gradient(loss_value, model.trainable_weights)
    optimizer.apply(grads, model.trainable_weights)
    train_acc_metric.update_state(y, logits)
    return loss_value


history = {"loss": [], "accuracy": []}
for epoch in range(2):
    losses = [float(train_step(x, y)) for x, y in train_dataset]
    history["loss"].append(np.mean(losses))
    history["accuracy"].append(float(train_acc_metric.result()))
    train_acc_metric.reset_state()
    print(f"epoch {epoch}: loss {history['loss'][-1]:.4f}, accuracy {history['accuracy'][-1]:.4f}")

if __name__ == "__main__":
    import record

    record.save(__file__, model, history)
