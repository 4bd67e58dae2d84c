"""Models with their own train_step and no call(), as the Keras examples write them.

``python own_train_step_job.py OUT``: an autoencoder in the VAE example's shape (its
loss a plain ``ops.mean`` of per-example sums, an optimizer from ``compile``) and a GAN
in the DCGAN example's shape (two optimizers and a Keras loss object of its own
``compile``), fit on numpy arrays with a partial last batch. No tfdist, no strategy:
run it unchanged under ``tfdist launch`` or ``python -m tfdist.bootstrap``. OUT-<pid>.npz
gets each model's weights, its replicas and its logged losses.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

rng = np.random.default_rng(0)
data = rng.random((200, 8), dtype=np.float32)


class AutoEncoder(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encoder = keras.Sequential([keras.Input((8,)), layers.Dense(4, activation="relu")])
        self.decoder = keras.Sequential([keras.Input((4,)), layers.Dense(8)])
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, batch):
        with tf.GradientTape() as tape:
            reconstruction = self.decoder(self.encoder(batch))
            loss = ops.mean(ops.sum(ops.square(batch - reconstruction), axis=1))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights, strict=True))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


class GAN(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.discriminator = keras.Sequential([keras.Input((8,)), layers.Dense(1)])
        self.generator = keras.Sequential([keras.Input((3,)), layers.Dense(8)])

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    def train_step(self, real):
        noise = ops.ones((ops.shape(real)[0], 3)) * ops.mean(real, axis=1, keepdims=True)
        fake = self.generator(noise)
        images = ops.concatenate([fake, real], axis=0)
        labels = ops.concatenate(
            [ops.ones((ops.shape(real)[0], 1)), ops.zeros_like(real[:, :1])], 0
        )
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(images))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights, strict=True)
        )
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(
                ops.zeros_like(labels[: ops.shape(real)[0]]),
                self.discriminator(self.generator(noise)),
            )
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights, strict=True))
        return {"d_loss": d_loss, "g_loss": g_loss}


def replicas(model) -> int:
    return model.distribute_strategy.num_replicas_in_sync


found = {}
keras.utils.set_random_seed(1)
ae = AutoEncoder()
ae.compile(optimizer=keras.optimizers.SGD(0.05))
history = ae.fit(data, epochs=2, batch_size=64, verbose=0, shuffle=False)
found["ae"] = np.concatenate([w.numpy().ravel() for w in ae.weights])
found["ae_replicas"] = replicas(ae)
found["ae_loss"] = np.array(history.history["loss"])

keras.utils.set_random_seed(1)
gan = GAN()
gan.compile(
    keras.optimizers.SGD(0.05),
    keras.optimizers.SGD(0.05),
    keras.losses.BinaryCrossentropy(from_logits=True),
)
gan.fit(data, epochs=2, batch_size=64, verbose=0, shuffle=False)
found["gan"] = np.concatenate([w.numpy().ravel() for w in gan.weights])
found["gan_replicas"] = replicas(gan)
np.savez(f"{sys.argv[1]}-{os.getpid()}.npz", **found)
