"""Knowledge distillation: a Distiller model with its own ``compile``, ``train_step`` and
``test_step``, no ``call``.

The shape of Keras's "Knowledge Distillation" example (its TensorFlow version): a teacher
convnet trained with ``fit``; a smaller student learns from the labels and from the
teacher's softened predictions (KL divergence at a temperature) in the Distiller's
``train_step`` under a ``tf.GradientTape``; ``evaluate`` scores the student through
``test_step``. Random MNIST-shaped digits stand in for MNIST.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(
        self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3
    ):
        super().compile(optimizer=optimizer)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature
        self.accuracy = metrics[0]
        self.student_loss_tracker = keras.metrics.Mean(name="student_loss")
        self.distillation_loss_tracker = keras.metrics.Mean(name="distillation_loss")

    @property
    def metrics(self):
        return [self.accuracy, self.student_loss_tracker, self.distillation_loss_tracker]

    def train_step(self, data):
        x, y = data
        teacher_predictions = self.teacher(x, training=False)
        with tf.GradientTape() as tape:
            student_predictions = self.student(x, training=True)
            student_loss = self.student_loss_fn(y, student_predictions)
            distillation_loss = self.distillation_loss_fn(
                ops.softmax(teacher_predictions / self.temperature, axis=1),
                ops.softmax(student_predictions / self.temperature, axis=1),
            ) * (self.temperature**2)
            loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        gradients = tape.gradient(loss, self.student.trainable_variables)
        self.optimizer.apply_gradients(
            zip(gradients, self.student.trainable_variables, strict=True)
        )
        self.accuracy.update_state(y, student_predictions)
        self.student_loss_tracker.update_state(student_loss)
        self.distillation_loss_tracker.update_state(distillation_loss)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_prediction = self.student(x, training=False)
        self.accuracy.update_state(y, y_prediction)
        self.student_loss_tracker.update_state(self.student_loss_fn(y, y_prediction))
        return {m.name: m.result() for m in self.metrics}


keras.utils.set_random_seed(41)
teacher = keras.Sequential(
    [
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
        layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),
        layers.Flatten(),
        layers.Dense(10),
    ],
    name="teacher",
)
student = keras.Sequential(
    [
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
        layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
        layers.Flatten(),
        layers.Dense(10),
    ],
    name="student",
)

rng = np.random.default_rng(41)
x_train = rng.random((250, 28, 28, 1)).astype("float32")
y_train = rng.integers(0, 10, 250)
x_test = rng.random((66, 28, 28, 1)).astype("float32")
y_test = rng.integers(0, 10, 66)

teacher.compile(
    optimizer=keras.optimizers.Adam(),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=[keras.metrics.SparseCategoricalAccuracy()],
)
teacher.fit(x_train, y_train, epochs=1, batch_size=32, shuffle=False, verbose=2)

distiller = Distiller(student=student, teacher=teacher)
distiller.compile(
    optimizer=keras.optimizers.Adam(),
    metrics=[keras.metrics.SparseCategoricalAccuracy()],
    student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    distillation_loss_fn=keras.losses.KLDivergence(),
    alpha=0.1,
    temperature=10,
)
history = distiller.fit(x_train, y_train, epochs=2, batch_size=32, shuffle=False, verbose=2)
score = distiller.evaluate(x_test, y_test, batch_size=32, verbose=0)

if __name__ == "__main__":
    import record

    record.save(__file__, [teacher, student], history, outputs=[score])
