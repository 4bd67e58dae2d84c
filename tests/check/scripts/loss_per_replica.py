"""A custom loop in the style of TensorFlow's "Custom training with tf.distribute.Strategy"
guide whose loss is averaged over each replica's own batch (``tf.reduce_mean`` inside
``strategy.run``): the replicas' gradients are summed, so on 2 replicas every update is
twice one device's. ``--loss global`` is the twin: the loss averaged over the GLOBAL
batch (``tfdist.loops.average_loss``), equal on every topology. ``--raise-after N``
fails after N steps (a script that crashes mid-loop). After each epoch of 16
steps the loop evaluates on a test set (a second distributed dataset, whose batches are
not training steps); it prints its losses and saves the model after the loop.
"""

import argparse

import keras
import numpy as np
import tensorflow as tf

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--loss", choices=("mean", "global"), default="mean")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--raise-after", type=int, default=0, help="fail after N steps")
args = parser.parse_args()

GLOBAL_BATCH = 32
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")

strategy = tfdist.strategy()
train = tfdist.data.pipeline((x, y), global_batch=GLOBAL_BATCH, seed=0, strategy=strategy)
dist_train = tfdist.loops.distribute(train, strategy=strategy)
test = tf.data.Dataset.from_tensor_slices((x[:64], y[:64])).batch(GLOBAL_BATCH)
dist_test = strategy.experimental_distribute_dataset(test)

with strategy.scope():
    keras.utils.set_random_seed(0)  # the same initial weights on every worker
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    optimizer = keras.optimizers.SGD(0.05)
    loss_object = keras.losses.MeanSquaredError(reduction=None)


def train_step(inputs):
    features, targets = inputs
    with tf.GradientTape() as tape:
        per_example = loss_object(targets, model(features, training=True))
        if args.loss == "mean":
            loss = tf.reduce_mean(per_example)  # the mistake: this replica's batch only
        else:
            loss = tfdist.loops.average_loss(per_example)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
    return loss


@tf.function
def distributed_train_step(batch):
    losses = strategy.run(train_step, args=(batch,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


@tf.function
def distributed_test_step(batch):
    def test_step(inputs):
        return tfdist.loops.average_loss(loss_object(inputs[1], model(inputs[0])))

    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(test_step, (batch,)), None)


for epoch in range(args.epochs):
    losses = []
    for batch in dist_train:
        if args.raise_after and len(losses) == args.raise_after:
            raise RuntimeError(f"the script fails after {args.raise_after} steps")
        losses.append(float(distributed_train_step(batch)))
    tested = [float(distributed_test_step(batch)) for batch in dist_test]
    print(f"epoch {epoch}: loss {np.mean(losses):.4f}, test loss {np.mean(tested):.4f}")
model.save("never-written.keras")  # the check ends the process after its steps
