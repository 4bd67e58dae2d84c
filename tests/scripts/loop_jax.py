"""A custom training loop in the style of Keras's "Writing a training loop from scratch in
JAX" and "Distributed training with JAX" guides, with tfdist's helpers (run with
KERAS_BACKEND=jax; docs/custom_loops.md shows it).

``python loop_jax.py --dir D``: (D a folder or a URL, e.g. ``s3://bucket/run``) trains on a mesh over every device of every process
(``tfdist.loops.mesh()``); ``--one-device-too`` first trains the same loop on a mesh of
one device in the same process (the reference). Checkpoints every ``--every`` steps;
``--kill-at-step K`` SIGKILLs the first attempt after step K;
``--sigterm-at-step S`` sends SIGTERM to worker 1 of the second attempt after step S; ``--dropout`` adds a
Dropout layer (its RNG state is part of the checkpoint); ``--sharded`` writes sharded,
asynchronous checkpoints, ``--kill-in-write K`` SIGKILLs the first attempt right after
step K's save call, its write under way, and ``--plant-damaged NAME`` has worker 0 first
leave a damaged copy of the newest checkpoint under NAME. Prints one JSON line per process;
each variant's ``state_devices`` counts the devices its trained state was on.
``TFDIST_TEST_FAULT`` (tests/scripts/faults.py: ``nan``, ``one_device``,
``outside_distribution``) injects a fault tests/e2e/test_checks_catch_faults.py must see
caught.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import faults  # noqa: E402

if faults.active("one_device"):  # before JAX reads the devices asked for
    os.environ.pop("TFDIST_CPU_DEVICES", None)

import builders  # noqa: E402
import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tfdist.checkpoint.sharded import sharded_name  # noqa: E402
from tfdist.core import storage  # noqa: E402

args = builders.loop_arguments(dropout=True, sharded=True)

GLOBAL_BATCH_SIZE = 16
rng = np.random.RandomState(0)
features = rng.rand(160, 8).astype("float32")
labels = (features.sum(axis=1) * 4 / 8).astype("int64") % 4
attempt = builders.attempt()


def get_model():
    keras.utils.set_random_seed(1)
    layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu")]
    if args.dropout:
        layers.append(keras.layers.Dropout(0.2))
    return keras.Sequential([*layers, keras.layers.Dense(4)])


def train(mesh, directory):
    # The same GLOBAL batches in every process; shard_batch keeps each process's rows.
    train_data = tfdist.data.pipeline((features, labels), global_batch=GLOBAL_BATCH_SIZE, seed=0)
    model = get_model()
    optimizer = keras.optimizers.Adam(learning_rate=0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer.build(model.trainable_variables)

    ckpt = tfdist.loops.Checkpointer(
        directory, model=model, optimizer=optimizer, pipeline=train_data, sharded=args.sharded
    )
    step = ckpt.restore()  # before the state is read from the model
    restored_from = ckpt.restored_from
    where = restored_from and os.path.basename(restored_from)
    print(json.dumps({"attempt": attempt, "restored": where, "at_step": step}), flush=True)

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

    # The fault: state and batches on one device, not on the mesh the loop was given.
    on = one_device_mesh() if faults.active("outside_distribution") else mesh
    # Replicated train state on the global mesh (every device of every process).
    state = tfdist.loops.replicate(
        (model.trainable_variables, model.non_trainable_variables, optimizer.variables), on=on
    )
    losses = []
    for _epoch in range(step // ckpt.steps_per_epoch, args.epochs):
        for batch in train_data.as_numpy_iterator():
            loss, state = train_step(state, tfdist.loops.shard_batch(batch, on=on))
            losses.append(float(tfdist.loops.to_host(loss)))
            step += 1
            builders.inject_fault(args, step)
            if ckpt.maybe_save(step, every=args.every, state=state) and args.sharded:
                name = sharded_name(*divmod(step, ckpt.steps_per_epoch))
                builders.kill_in_write(args, step, storage.join(directory, name))
    ckpt.write_state(state)  # the trained values back into the model
    ckpt.wait()  # sharded: the last write finished (close() at exit would wait too)
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "step": step,
        "losses": losses,
        "devices": int(mesh.devices.size),
        "state_devices": len(jax.tree_util.tree_leaves(state)[0].sharding.device_set),
        "restored_from": where,
        "checkpoints": sorted(n for n in storage.listdir(directory) if n.startswith("ckpt")),
    }


def one_device_mesh():
    """A mesh of this process's first device."""
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))


result = {"processes": jax.process_count(), "devices": jax.device_count()}
if args.one_device_too:
    result["one_device"] = train(one_device_mesh(), storage.join(args.dir, "one"))
result["distributed"] = train(tfdist.loops.mesh(), storage.join(args.dir, "dist"))
if faults.active("nan"):  # in the run compared with the reference
    result["distributed"]["weights"][0][0][0] = float("nan")
print(json.dumps(result), flush=True)
