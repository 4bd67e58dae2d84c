"""A small 2-process JAX training job for fault-injection tests (``KERAS_BACKEND=jax``).

    tfdist launch -n 2 jax_fault_job.py --steps 400 --stall-rank 1 --stall-at 5

Trains a tiny model under ``tfdist.scope()`` on a repeated ``tf.data`` pipeline. Prints
``PID <pid> RANK <rank>`` first, then ``STEP <n>`` after every training batch (n from 1),
``FAULT <time.time()>`` when it injects a fault, and ``DONE`` at the end.

Fault injection (``--fault-rank R`` picks the process):

* ``--stall-at N``: process R sleeps an hour in a callback after batch N: alive, but it
  never joins the next collective (the other processes wait in it);
* ``--die-at N``: process R SIGKILLs itself after batch N.

``--step-sleep S`` sleeps S seconds after every batch so an external signal lands
mid-training; ``--evaluate`` also evaluates (and validates) so those phases are covered.
"""

import argparse
import os
import signal
import time

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=400)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--fault-rank", type=int, default=-1)
parser.add_argument("--stall-at", type=int, default=-1)
parser.add_argument("--die-at", type=int, default=-1)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--evaluate", action="store_true")
args = parser.parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402

rank = tfdist.cluster_from_env().rank
print("PID", os.getpid(), "RANK", rank, flush=True)

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = (x @ rng.normal(size=(4, 1))).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()

with tfdist.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")

done = 0


def on_batch_end(batch, logs):
    global done
    done += 1
    print("STEP", done, flush=True)
    if rank == args.fault_rank and done in (args.stall_at, args.die_at):
        print("FAULT", time.time(), flush=True)  # the test measures from here
        if done == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)
    if args.step_sleep:
        time.sleep(args.step_sleep)


callbacks = [keras.callbacks.LambdaCallback(on_train_batch_end=on_batch_end)]
model.fit(
    data,
    epochs=args.epochs,
    steps_per_epoch=args.steps,
    verbose=0,
    callbacks=callbacks,
    validation_data=data if args.evaluate else None,
    validation_steps=4 if args.evaluate else None,
)
if args.evaluate:
    model.evaluate(data, steps=4, verbose=0)
    model.predict(data.map(lambda a, b: a), steps=4, verbose=0)
print("DONE", flush=True)
