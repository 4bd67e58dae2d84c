"""A custom training loop in the style of TensorFlow's "Custom training with
tf.distribute.Strategy" guide, with tfdist's helpers (docs/custom_loops.md shows it).

``python loop_tf.py --dir D``: (D a folder or a URL, e.g. ``s3://bucket/run``) trains with ``tfdist.strategy()`` (1 device, N logical
devices, or N workers under ``tfdist launch``); ``--one-device-too`` first trains the
same loop on ``OneDeviceStrategy`` in the same process (the reference). Checkpoints every
``--every`` steps; ``--kill-at-step K`` SIGKILLs the first attempt after step K;
``--sigterm-at-step S`` sends SIGTERM to worker 1 of the second attempt after step S.
Prints one JSON line per process. ``TFDIST_TEST_FAULT`` (tests/scripts/faults.py:
``nan``, ``one_device``) injects a fault tests/e2e/test_checks_catch_faults.py must see
caught.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import faults  # noqa: E402

if faults.active("one_device"):  # before TensorFlow reads the devices asked for
    os.environ.pop("TFDIST_CPU_DEVICES", None)

import builders  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.core import storage  # noqa: E402

args = builders.loop_arguments(dropout=False)

GLOBAL_BATCH_SIZE = 16
rng = np.random.RandomState(0)
features = rng.rand(160, 8).astype("float32")
labels = (features.sum(axis=1) * 4 / 8).astype("int64") % 4
attempt = builders.attempt()


def train(strategy, directory):
    # Every epoch reshuffled from (seed, epoch); GLOBAL batches, split between replicas.
    train_data = tfdist.data.pipeline(
        (features, labels), global_batch=GLOBAL_BATCH_SIZE, seed=0, strategy=strategy
    )
    dist_dataset = tfdist.loops.distribute(train_data, strategy=strategy)

    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(4),
            ]
        )
        optimizer = keras.optimizers.Adam(learning_rate=0.01)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def train_step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            predictions = model(x, training=True)
            loss = tfdist.loops.average_loss(loss_object(y, predictions))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    ckpt = tfdist.loops.Checkpointer(
        directory, model=model, optimizer=optimizer, pipeline=train_data, strategy=strategy
    )
    step = ckpt.restore()
    restored_from = ckpt.restored_from
    where = restored_from and os.path.basename(restored_from)
    print(json.dumps({"attempt": attempt, "restored": where, "at_step": step}), flush=True)
    losses = []
    for _epoch in range(step // ckpt.steps_per_epoch, args.epochs):
        for batch in dist_dataset:
            losses.append(float(distributed_train_step(batch)))
            step += 1
            builders.inject_fault(args, step)
            ckpt.maybe_save(step, every=args.every)
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "optimizer": [np.asarray(v).tolist() for v in optimizer.variables[:1]],
        "step": step,
        "losses": losses,
        "replicas": strategy.num_replicas_in_sync,
        "restored_from": where,
        "checkpoints": sorted(n for n in storage.listdir(directory) if n.startswith("ckpt")),
    }


result = {"workers": tfdist.num_workers()}
if args.one_device_too:
    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    result["one_device"] = train(one, storage.join(args.dir, "one"))
result["distributed"] = train(tfdist.strategy(), storage.join(args.dir, "dist"))
if faults.active("nan"):  # in the run compared with the reference
    result["distributed"]["weights"][0][0][0] = float("nan")
print(json.dumps(result), flush=True)
