"""A custom loop on JAX in the style of Keras's "Distributed training with JAX" guide
(docs/custom_loops.md's recipe): ``model.stateless_call`` and ``optimizer.stateless_apply``
in a ``jax.jit`` step, the state ``(trainable, non_trainable, optimizer variables)`` held
by the loop, replicated over ``tfdist.loops.mesh()``, each global batch placed by
``tfdist.loops.shard_batch``.

``--data per-process`` is the defect: each process keeps its own half of the examples
(sliced by ``jax.process_index()``, a TensorFlow worker's habit) before ``shard_batch``,
which expects the same global batch in every process and keeps each process's rows of
it; so 2 processes train on other examples than one device. ``--data global`` (the
default) is the twin, equal on every topology. After the loop the trained state is
written back into the model, which is saved.
"""

import argparse

import jax
import keras
import numpy as np

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--data", choices=("global", "per-process"), default="global")
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

GLOBAL_BATCH = 16
rng = np.random.RandomState(0)
features = rng.rand(160, 8).astype("float32")
labels = (features.sum(axis=1) * 4 / 8).astype("int64") % 4
if args.data == "per-process":  # the mistake: shard_batch wants the global batch
    features = features[jax.process_index() :: jax.process_count()]
    labels = labels[jax.process_index() :: jax.process_count()]

mesh = tfdist.loops.mesh()
train_data = tfdist.data.pipeline((features, labels), global_batch=GLOBAL_BATCH, seed=0)
keras.utils.set_random_seed(1)
model = keras.Sequential(
    [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)]
)
optimizer = keras.optimizers.Adam(learning_rate=0.01)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer.build(model.trainable_variables)


def compute_loss_and_updates(trainable_variables, non_trainable_variables, x, y):
    y_pred, non_trainable_variables = model.stateless_call(
        trainable_variables, non_trainable_variables, x, training=True
    )
    return loss_fn(y, y_pred), non_trainable_variables


grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)


@jax.jit
def train_step(state, data):
    trainable_variables, non_trainable_variables, optimizer_variables = state
    x, y = data
    (loss, non_trainable_variables), grads = grad_fn(
        trainable_variables, non_trainable_variables, x, y
    )
    trainable_variables, optimizer_variables = optimizer.stateless_apply(
        optimizer_variables, grads, trainable_variables
    )
    return loss, (trainable_variables, non_trainable_variables, optimizer_variables)


state = tfdist.loops.replicate(
    (model.trainable_variables, model.non_trainable_variables, optimizer.variables), on=mesh
)
for _epoch in range(args.epochs):
    for batch in train_data.as_numpy_iterator():
        loss, state = train_step(state, tfdist.loops.shard_batch(batch, on=mesh))
    print("loss", float(tfdist.loops.to_host(loss)), flush=True)

trainable_variables, non_trainable_variables, _ = state
for variable, value in zip(model.trainable_variables, trainable_variables, strict=True):
    variable.assign(tfdist.loops.to_host(value))
if jax.process_index() == 0:
    model.save("trained.keras")
