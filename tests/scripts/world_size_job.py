"""A restartable job with a fixed GLOBAL batch, for resuming on another world size.

It trains with ``make_or_restore`` + ``tfdist.callbacks.checkpoint`` on a seeded
``tfdist.data.pipeline(global_batch=32)`` and a learning-rate schedule driven by the
optimizer step, so the same global batches and rates follow whatever the number of
replicas (devices or workers). ``--die-after-step N`` ends the process abruptly right
after global step N (``os._exit``: no save, like kill -9); the next run resumes.

The last stdout line is JSON: the final weights, the replicas (and workers) and the step
it resumed from; a run that dies prints the same line (without weights) as it dies.
``TFDIST_TEST_FAULT=late_resume`` (tests/scripts/faults.py) resumes one step late: one
more batch skipped and the optimizer one step ahead of the checkpoint it restored.

    TFDIST_CPU_DEVICES=2 python world_size_job.py --dir /tmp/ckpt
"""

import argparse
import dataclasses
import json
import os

import faults
import keras
import numpy as np

import tfdist
from tfdist.core import process

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--die-after-step", type=int, default=None)
args = parser.parse_args()

EPOCHS, GLOBAL_BATCH, EXAMPLES = 3, 32, 256  # 8 steps an epoch
rng = np.random.default_rng(0)
x = rng.normal(size=(EXAMPLES, 6)).astype("float32")
y = rng.integers(0, 3, EXAMPLES)
train = tfdist.data.pipeline((x, y), global_batch=GLOBAL_BATCH, seed=0)


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    )
    schedule = keras.optimizers.schedules.CosineDecay(0.05, EPOCHS * EXAMPLES // GLOBAL_BATCH)
    model.compile(
        optimizer=keras.optimizers.Adam(schedule),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def report(model, **extra) -> None:
    result = {
        "replicas": tfdist.num_replicas(),
        "workers": tfdist.num_workers(),
        "worker": tfdist.worker_index(),
        "resumed_step": None if resumed is None else resumed.step,
        "steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
    }
    print(json.dumps({**result, **extra}), flush=True)


class DieAfter(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        if step == args.die_after_step:
            report(self.model, died=True)
            os._exit(0)


model, initial_epoch = tfdist.make_or_restore(build, args.dir)
resumed = tfdist.resume_state(model)
if resumed is not None and faults.active("late_resume"):
    process.state().resumed[model] = dataclasses.replace(resumed, batch=resumed.batch + 1)
    model.optimizer.iterations.assign_add(1)
callbacks = [tfdist.callbacks.checkpoint(args.dir, save_freq=5)]
if args.die_after_step is not None:
    callbacks.append(DieAfter())
model.fit(train, epochs=EPOCHS, initial_epoch=initial_epoch, callbacks=callbacks, verbose=0)
report(model, weights=[w.tolist() for w in model.get_weights()])
