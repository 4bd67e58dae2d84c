"""A small restartable job that keeps its own progress file; for fault-injection tests.

    tfdist launch -n 2 --max-restarts 1 mw_steps.py --progress DIR --epochs 4 \\
        --die-at-epoch 2 --die-rank 1

Trains a linear model one epoch at a time with ``tfdist.strategy()``. After each epoch
the chief writes ``DIR/progress.json`` atomically (epochs done and weights; plain SGD
has no other state), and every worker resumes from it when it starts. Prints
``PID <pid>`` first and ``EPOCH <e> start`` before each epoch.

Fault injection: ``--die-at-epoch E --die-rank R`` makes worker R SIGKILL itself when
epoch E begins, on the first attempt only (``TFDIST_RESTART=0``). ``--step-sleep S``
sleeps S seconds after every batch, so an external kill lands mid-training.
``--hold FILE``: every worker, at the start of epoch 1, waits until FILE exists (300 s at
most), so a test can look at the running job (after one trained epoch) for as long as
it needs, then let it train on.

Finally prints one JSON line: worker, restart, first_epoch (where this attempt
started), epochs, and diff: the largest difference from the same model trained
uninterrupted in this process without a strategy.
"""

import argparse
import json
import os
import signal
import time

import equivalence
import numpy as np

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--progress", required=True)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--die-at-epoch", type=int, default=-1)
parser.add_argument("--die-rank", type=int, default=-1)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--hold", default="")
args = parser.parse_args()
print("PID", os.getpid(), flush=True)

strategy = tfdist.strategy()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.experimental.enable_op_determinism()
info = tfdist.cluster_from_env()
restart = int(os.environ.get("TFDIST_RESTART", "0"))
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = (x @ rng.normal(size=(4, 1))).astype("float32")
path = os.path.join(args.progress, "progress.json")


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


with strategy.scope():
    model = build()
first_epoch = 0
if os.path.exists(path):
    with open(path) as f:
        saved = json.load(f)
    first_epoch = saved["epochs_done"]
    model.set_weights([np.asarray(w, dtype="float32") for w in saved["weights"]])

callbacks = []
if args.step_sleep:
    callbacks.append(
        keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: time.sleep(args.step_sleep)
        )
    )
for epoch in range(first_epoch, args.epochs):
    print("EPOCH", epoch, "start", flush=True)
    if args.hold and epoch == 1:
        deadline = time.monotonic() + 300
        while not os.path.exists(args.hold) and time.monotonic() < deadline:
            time.sleep(0.05)
    if restart == 0 and epoch == args.die_at_epoch and info.rank == args.die_rank:
        # The chief writes the progress of the epoch just ended after its fit returns;
        # die only once it is there, so the restart point does not depend on timing.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.path.exists(path):
                with open(path) as f:
                    if json.load(f)["epochs_done"] >= epoch:
                        break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    if info.is_chief:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(
                {"epochs_done": epoch + 1, "weights": [w.tolist() for w in model.get_weights()]}, f
            )
        os.replace(tmp, path)

reference = build()  # no strategy scope: one device, trained without interruption
for _ in range(args.epochs):
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
diff = equivalence.max_difference(reference.get_weights(), model.get_weights())
print(
    json.dumps(
        {
            "worker": info.rank,
            "restart": restart,
            "first_epoch": first_epoch,
            "epochs": args.epochs,
            "replicas": strategy.num_replicas_in_sync,
            "diff": diff,
        }
    ),
    flush=True,
)
