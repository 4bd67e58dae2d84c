"""The job tests/e2e/test_slurm.py runs under a real SLURM scheduler, on either Keras backend.

A user's script as docs/slurm.md describes it: nothing in it
knows about SLURM. ``tfdist.make_or_restore`` + ``tfdist.callbacks.standard(dir)`` over a
seeded ``tfdist.data.pipeline`` with a fixed GLOBAL batch, so one process, an
``srun -n 2`` step and a preempted-then-requeued job must all end with the same weights.

    python slurm_train.py             # one process: the reference (checkpoints in ckpt/)
    srun -n 2 python slurm_train.py   # 2 workers (TF) or 2 processes (KERAS_BACKEND=jax)

``--step-sleep S`` slows every step of a first attempt (a preemption can then land
mid-training; a requeued job runs at full speed);
``--report-first-step`` prints ``{"first_step": {...}}`` with this task's rank, pid, and
the wall-clock times at which Python started the script and trained its first step. The last stdout line is JSON: rank,
replicas, weights, iterations, where it resumed from, and the exit code (75 after a
SIGTERM: saved, restart me); ``--results DIR`` also writes it to
``DIR/ATTEMPT-RANK.json`` (ATTEMPT: ``SLURM_RESTART_COUNT``, 0 at first; without it, the
number of results this rank wrote before). ``trained_on`` in the result is what the
model's own ``fit`` ran on (tests/scripts/trained_on.py), so a test sees every worker's
topology, not only the process's.

``TFDIST_TEST_FAULT`` (tests/scripts/faults.py) injects a fault the tests must see caught:
``nan`` (a NaN in the reported weights) or ``outside_distribution`` (the model built
outside ``make_or_restore``'s scope: each worker trains its own model on its own shard).
Not ``one_device``: every task runs on one device already. Next to a copy of this file
(the docs' batch script runs ``train.py``), copy faults.py and trained_on.py too.
"""

import argparse
import json
import os
import sys
import time

STARTED = time.time()  # for --report-first-step: how long Python took to its first step

import tfdist  # noqa: E402 - first: under KERAS_BACKEND=jax it joins the job at `import jax`

parser = argparse.ArgumentParser()
parser.add_argument("--dir", default="ckpt")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--examples", type=int, default=256)
parser.add_argument("--global-batch", type=int, default=16)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--report-first-step", action="store_true")
parser.add_argument(
    "--results", default=None, help="also write the result to DIR/ATTEMPT-RANK.json"
)
args = parser.parse_args()

import faults  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import trained_on  # noqa: E402

ON_TF = tfdist.backends.name() == "tensorflow"
if ON_TF:
    import tensorflow as tf

    tfdist.strategy()  # the multi-worker strategy (SLURM step) before any tensor
    tf.config.experimental.enable_op_determinism()
keras.utils.set_random_seed(0)

rng = np.random.default_rng(0)
x = rng.normal(size=(args.examples, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(args.examples, 1))).astype("float32")
replicas = tfdist.num_replicas()
if args.global_batch % replicas:
    sys.exit(f"--global-batch {args.global_batch} does not split over {replicas} replicas")
train = tfdist.data.pipeline((x, y), args.global_batch // replicas, shuffle=256, seed=7)


def build_and_compile():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


class Report(keras.callbacks.Callback):
    """Prints the first step's time (and this task's pid); sleeps after every step."""

    def __init__(self):
        super().__init__()
        self.reported = False

    def on_train_batch_end(self, batch, logs=None):
        if args.report_first_step and not self.reported:
            self.reported = True
            first = {"rank": rank, "pid": os.getpid(), "started": STARTED, "unix": time.time()}
            print(json.dumps({"first_step": first}), flush=True)
        if step_sleep:
            time.sleep(step_sleep)


rank = tfdist.cluster_from_env().rank
# Only the first attempt needs slow steps (for a preemption to land mid-training); a
# requeued job (SLURM_RESTART_COUNT > 0) runs at full speed.
step_sleep = args.step_sleep if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0.0
if faults.active("outside_distribution"):  # as a script that built its model first
    model, initial_epoch = build_and_compile(), 0
else:
    model, initial_epoch = tfdist.make_or_restore(build_and_compile, args.dir)
restored = tfdist.resume_state(model)
callbacks = [
    *tfdist.callbacks.standard(args.dir, decay={0: 0.01, 2: 0.005}, print_lr=False),
    Report(),
]
trained_on.install()
exit_code = 0
try:
    model.fit(
        train, epochs=args.epochs, initial_epoch=initial_epoch, callbacks=callbacks, verbose=0
    )
except SystemExit as exc:  # the checkpoint callback's "saved after SIGTERM, restart me"
    exit_code = exc.code
result = {
    "rank": rank,
    "workers": tfdist.cluster_from_env().num_workers,
    "replicas": replicas,
    "backend": tfdist.backends.name(),
    "restored_step": None if restored is None else restored.step,
    "iterations": int(model.optimizer.iterations.numpy()),
    "weights": [w.tolist() for w in model.get_weights()],
    "trained_on": list(trained_on.NOTED),  # empty when fit ended early (SIGTERM)
    "exit_code": exit_code,
}
if faults.active("nan"):
    result["weights"][0][0][0] = float("nan")
print(json.dumps(result), flush=True)
if args.results:
    # srun forwards a task's output in chunks of a few KiB, so two tasks' long result
    # lines can interleave in one output file: a file per task and attempt cannot.
    os.makedirs(args.results, exist_ok=True)
    # Elsewhere (a Kubernetes pod restarted with the same environment) the attempt is
    # how many results this rank already wrote.
    attempt = os.environ.get("SLURM_RESTART_COUNT") or sum(
        name.endswith(f"-{rank}.json") for name in os.listdir(args.results)
    )
    path = os.path.join(args.results, f"{attempt}-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
sys.exit(exit_code)
