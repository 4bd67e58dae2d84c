"""An elastic job's script: as a user writes it, with make_or_restore and a checkpoint dir.

A fixed GLOBAL batch of 12 over 250 examples (20 full batches and one of 10 an epoch), a
model with the layers the tutorials use (Dense, BatchNormalization synchronized across
replicas), a learning-rate schedule by optimizer step, checkpoints every 4 steps. Each
start appends ``{"workers", "resumed_step", "pid"}`` to ``DIR/starts.jsonl`` (the chief
only) and the chief prints ``STEP n WORKERS w`` after every step, so a test can follow the
job and act mid-epoch. ``--step-seconds S`` sleeps S after each step (time for a test to
act). The last stdout line is JSON: the final weights, the replicas, the step it resumed
from.

    python elastic_job.py --dir /tmp/ckpt          # the uninterrupted reference
    tfdist launch --nnodes 2:3 --rdzv-endpoint 127.0.0.1:29400 --rdzv-id j -n 1 \\
        elastic_job.py --dir /tmp/ckpt --step-seconds 0.3
"""

import argparse
import json
import os
import time

import keras
import numpy as np

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--step-seconds", type=float, default=0.0)
args = parser.parse_args()

EPOCHS, GLOBAL_BATCH, EXAMPLES = 3, 12, 250  # 21 steps an epoch, the last of 10 examples
rng = np.random.default_rng(0)
x = rng.normal(size=(EXAMPLES, 6)).astype("float32")
y = rng.integers(0, 3, EXAMPLES)
train = tfdist.data.pipeline((x, y), global_batch=GLOBAL_BATCH, seed=0)


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            # synchronized: one statistic over the global batch (JAX computes it so anyway)
            keras.layers.BatchNormalization(synchronized=keras.backend.backend() == "tensorflow"),
            keras.layers.Dense(3),
        ]
    )
    steps = EPOCHS * -(-EXAMPLES // GLOBAL_BATCH)
    schedule = keras.optimizers.schedules.CosineDecay(0.05, steps)
    model.compile(
        optimizer=keras.optimizers.Adam(schedule),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class Follow(keras.callbacks.Callback):
    """The chief says each step; every worker sleeps ``--step-seconds`` after it."""

    def on_train_batch_end(self, batch, logs=None):
        if tfdist.worker_index() == 0:
            step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            print(f"STEP {step} WORKERS {tfdist.num_workers()}", flush=True)
        time.sleep(args.step_seconds)


model, initial_epoch = tfdist.make_or_restore(build, args.dir)
resumed = tfdist.resume_state(model)
start = {
    "workers": tfdist.num_workers(),
    "replicas": tfdist.num_replicas(),
    "resumed_step": None if resumed is None else resumed.step,
    "pid": os.getpid(),
    "rendezvous": os.environ.get("TFDIST_RENDEZVOUS"),  # what tfdist info shows
}
if tfdist.worker_index() == 0:
    with open(os.path.join(args.dir, "starts.jsonl"), "a") as starts:
        starts.write(json.dumps(start) + "\n")
callbacks = [tfdist.callbacks.checkpoint(args.dir, save_freq=4), Follow()]
model.fit(train, epochs=EPOCHS, initial_epoch=initial_epoch, callbacks=callbacks, verbose=0)
result = {
    **start,
    "worker": tfdist.worker_index(),
    "steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
    "weights": [w.tolist() for w in model.get_weights()],
}
print(json.dumps(result), flush=True)
