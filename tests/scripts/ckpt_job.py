"""A restartable training job for the checkpoint fault-injection tests and the restart benchmark.

It trains a small model with a Dropout layer on a seeded, shuffled pipeline with
``make_or_restore`` + ``tfdist.callbacks.checkpoint``, exactly as a user script would,
and can hurt itself on purpose:

    --sigkill-at-step N   SIGKILL itself right after global step N (after that step's save);
                          with --sigkill-rank R only worker R does
    --sigkill-in-save K   SIGKILL itself in the middle of its K-th checkpoint write, with
                          the staging file half written
    --sigkill-in-upload K a URL directory (s3:// on an endpoint from AWS_ENDPOINT_URL):
                          SIGKILL itself in the middle of its K-th checkpoint upload, half
                          the staging object's bytes sent in a PUT whose connection then
                          dies with the process
    --sigterm-at-step N   send itself SIGTERM at global step N (a preemption notice);
                          with --sigterm-rank R only worker R does
    --sigterm-in-step N   TensorFlow: send itself SIGTERM from inside training step N (a
                          ``tf.py_function`` in the model's graph), so that with
                          ``--steps-per-execution K`` it arrives while an execution runs;
                          prints ``{"sigterm_in_step": N}``; --sigterm-rank applies
    --sharded             sharded, asynchronous Orbax checkpoints (JAX) instead of archives
    --model-parallel B    JAX: a 2x2 ModelParallel (first kernel sharded), global batch B

Under ``tfdist launch --max-restarts``, faults fire only in the first attempt
(``TFDIST_RESTART=0``), so the restarted group runs to the end; ``--sigkill-attempt N``
moves ``--sigkill-at-step`` to attempt N (a SIGTERM, then a SIGKILL in one job).

The job runs unchanged on both Keras backends (``KERAS_BACKEND=jax`` too).

The last stdout line is JSON: final weights, the epoch/batch/step it resumed from and
the (epoch, batch) of every batch it trained, so tests can check that no batch was
trained twice or skipped.

    python ckpt_job.py --dir /tmp/ckpt --epochs 3 --save-freq 3
"""

import argparse
import json
import os
import signal
import sys
import time

T0 = time.perf_counter()

import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tfdist.core import storage  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--save-freq", default="epoch")
parser.add_argument("--examples", type=int, default=64)
parser.add_argument("--per-replica-batch", type=int, default=4)
parser.add_argument("--max-to-keep", type=int, default=3)
parser.add_argument("--sigkill-at-step", type=int, default=None)
parser.add_argument("--sigkill-rank", type=int, default=None, help="only this worker (default all)")
parser.add_argument(
    "--sigkill-attempt", type=int, default=0, help="--sigkill-at-step fires in this attempt"
)
parser.add_argument("--sigkill-in-save", type=int, default=None)
parser.add_argument("--sigkill-in-upload", type=int, default=None)
parser.add_argument("--sigterm-at-step", type=int, default=None)
parser.add_argument("--sigterm-in-step", type=int, default=None)
parser.add_argument("--sigterm-rank", type=int, default=None, help="only this worker (default all)")
parser.add_argument(
    "--dir-per-rank", action="store_true", help="misconfiguration: worker R uses DIR-rankR"
)
parser.add_argument("--width", type=int, default=16)
parser.add_argument(
    "--steps-per-execution", type=int, default=1, help="compile(steps_per_execution=K)"
)
parser.add_argument("--hidden2", type=int, default=0, help="a second hidden layer (bigger model)")
parser.add_argument("--report-first-step", action="store_true")
parser.add_argument("--sharded", action="store_true", help="sharded Orbax checkpoints (JAX)")
parser.add_argument(
    "--model-parallel",
    type=int,
    default=None,
    metavar="GLOBAL_BATCH",
    help="JAX: a 2x2 ModelParallel (first kernel sharded) with this global batch",
)
parser.add_argument(
    "--keras-backup",
    action="store_true",
    help="baseline: Keras's own BackupAndRestore instead of tfdist (for the benchmark)",
)
args = parser.parse_args()
save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)

# The same job on both Keras backends (KERAS_BACKEND=tensorflow or jax).
ON_TF = tfdist.backends.name() == "tensorflow"
if ON_TF:
    strategy = tfdist.strategy()  # before any tensor: TFDIST_CPU_DEVICES must apply

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

keras.utils.set_random_seed(0)
if ON_TF:
    tf.config.experimental.enable_op_determinism()

rng = np.random.default_rng(0)
x = rng.normal(size=(args.examples, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(args.examples, 1))).astype("float32")
# A ninth column the model drops (it holds the example index) keeps the pipeline's
# elements distinct, as real examples are.
xi = np.concatenate([x, np.arange(args.examples, dtype="float32")[:, None]], axis=1)
global_batch = tfdist.global_batch_size(args.per_replica_batch)


# A seeded, shuffled tfdist.data pipeline: epoch k's order comes from (seed, k), and
# the checkpoint callback tells it where to resume.
if args.model_parallel:
    train = tfdist.data.pipeline(
        (xi, y), global_batch=args.model_parallel, shuffle=args.examples, seed=1000, cache=True
    )
else:
    train = tfdist.data.pipeline(
        (xi, y), args.per_replica_batch, shuffle=args.examples, seed=1000, cache=True
    )

# Under `tfdist launch --max-restarts`, faults fire only in the first attempt.
first_attempt = os.environ.get("TFDIST_RESTART", "0") == "0"
kill_attempt = os.environ.get("TFDIST_RESTART", "0") == str(args.sigkill_attempt)
rank = tfdist.cluster_from_env().rank
if args.dir_per_rank and rank:
    args.dir = f"{args.dir}-rank{rank}"


class DropIndex(keras.layers.Layer):
    """Splits the example index off the features (the model trains on the first 8)."""

    def call(self, inputs, training=None):
        if training and signal_in_step is not None:  # in every worker's graph
            tf.py_function(signal_in_step, [], [])  # stateful: runs in every step
        return inputs[:, :8]


def _signal_in_step():
    """Counts this process's training steps (one call per local replica and step) and
    sends SIGTERM from inside step ``--sigterm-in-step``: the graph is still running."""
    steps_seen["n"] += 1
    local_replicas = max(tfdist.num_replicas() // tfdist.num_workers(), 1)
    if (
        args.sigterm_rank in (None, rank)
        and steps_seen["n"] == args.sigterm_in_step * local_replicas
    ):
        print(json.dumps({"sigterm_in_step": args.sigterm_in_step}), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)


steps_seen = {"n": 0}
# TensorFlow only: on 2 JAX processes neither jax.debug.callback nor io_callback ran.
signal_in_step = (
    _signal_in_step if ON_TF and first_attempt and args.sigterm_in_step is not None else None
)


def build_and_compile():
    model = keras.Sequential(
        [
            keras.Input((9,)),
            DropIndex(),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dropout(0.25),
            *([keras.layers.Dense(args.hidden2, activation="relu")] if args.hidden2 else []),
            keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        steps_per_execution=args.steps_per_execution,
    )
    return model


if args.sigkill_in_save is not None and first_attempt:
    from tfdist.core import atomic

    real_add = atomic.add_archive_member
    calls = {"n": 0}

    def add_then_die(archive_path, member, data):
        calls["n"] += 1
        if calls["n"] == args.sigkill_in_save:
            # Die with the staging file half written, before the rename.
            size = os.path.getsize(archive_path)
            with open(archive_path, "r+b") as f:
                f.truncate(size // 2)
            print(json.dumps({"dying_in_save": archive_path}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_add(archive_path, member, data)

    atomic.add_archive_member = add_then_die

if args.sigkill_in_upload is not None and first_attempt:
    import socket
    import urllib.parse

    from tfdist.checkpoint import names

    real_upload = storage.upload
    uploads = {"n": 0}

    def upload_cut_by_a_kill(local, staging, final):
        if names.parse_checkpoint_name(storage.basename(final)) is not None:
            uploads["n"] += 1
        if uploads["n"] != args.sigkill_in_upload:
            return real_upload(local, staging, final)
        # The staging object's PUT cut by the kill (sent raw and unsigned: moto's server
        # checks no signature): the headers announce the whole archive, half of it goes
        # out, then the process dies and the kernel closes its connection.
        endpoint = urllib.parse.urlsplit(os.environ["AWS_ENDPOINT_URL"])
        with open(local, "rb") as f:
            data = f.read()
        sock = socket.create_connection((endpoint.hostname, endpoint.port))
        head = f"PUT /{staging.split('://', 1)[1]} HTTP/1.1\r\nHost: {endpoint.netloc}\r\n"
        sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode())
        sock.sendall(data[: len(data) // 2])
        print(json.dumps({"dying_in_upload": final}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    storage.upload = upload_cut_by_a_kill

t_restore = time.perf_counter()
if args.keras_backup:
    with strategy.scope() if ON_TF else tfdist.scope():
        model = build_and_compile()
    initial_epoch, restored = 0, None  # BackupAndRestore restores inside fit
else:
    if args.model_parallel:
        from keras import distribution as kd

        # 1x4: the "model" axis runs over every device, across the processes (each holds
        # half of the sharded kernel); every process feeds the whole global batch.
        mesh = kd.DeviceMesh((1, 4), ["batch", "model"], devices=kd.list_devices())
        layouts = kd.LayoutMap(mesh)
        layouts[".*dense/kernel"] = (None, "model")  # the first Dense: (8, width)
        with tfdist.scope(layout_map=layouts):
            model, initial_epoch = tfdist.make_or_restore(build_and_compile, args.dir)
    else:
        model, initial_epoch = tfdist.make_or_restore(build_and_compile, args.dir)
    restored = tfdist.resume_state(model)
t_restored = time.perf_counter()


class Record(keras.callbacks.Callback):
    """Records (epoch, batch within the epoch, global step) of every trained step."""

    def __init__(self):
        super().__init__()
        self.steps = []
        self.first_step_time = None
        self._epoch = 0
        self._offset = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        state = restored
        self._offset = state.batch if state and epoch == state.epoch else 0

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if self.first_step_time is None:
            self.first_step_time = time.perf_counter()
            if args.report_first_step:
                first = {
                    "unix": time.time(),
                    "step": step,
                    "at": [self._epoch, self._offset + batch],
                    "times": {
                        "import_and_setup": t_restore - T0,
                        "make_or_restore": t_restored - t_restore,
                        "fit_start_to_first_step": self.first_step_time - t_fit,
                    },
                }
                print(json.dumps({"first_step": first}), flush=True)
        self.steps.append([self._epoch, self._offset + batch, step])
        if (
            kill_attempt
            and args.sigkill_at_step is not None
            and step == args.sigkill_at_step
            and args.sigkill_rank in (None, rank)
        ):
            print(json.dumps({"dying_at_step": step}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class Preempt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if (
            first_attempt
            and args.sigterm_at_step is not None
            and step == args.sigterm_at_step
            and args.sigterm_rank in (None, rank)
        ):
            os.kill(os.getpid(), signal.SIGTERM)


def weights_of(model) -> list:
    """The model's weights as lists; gathered from every process where a variable spans
    them (a JAX mesh axis across processes: Keras's get_weights cannot fetch those)."""
    if ON_TF or all(getattr(v.value, "is_fully_addressable", True) for v in model.weights):
        return [w.tolist() for w in model.get_weights()]
    from jax.experimental import multihost_utils

    return [
        np.asarray(multihost_utils.process_allgather(v.value, tiled=True)).tolist()
        for v in model.weights
    ]


record = Record()
if args.keras_backup:
    saver = keras.callbacks.BackupAndRestore(args.dir, save_freq=save_freq)
else:
    saver = tfdist.callbacks.checkpoint(
        args.dir, save_freq=save_freq, max_to_keep=args.max_to_keep, sharded=args.sharded
    )
callbacks = [
    Preempt(),  # before the checkpoint: it sees the notice at the same step
    saver,
    tfdist.callbacks.decay({0: 0.01, 2: 0.005}),
    record,  # after the checkpoint: a SIGKILL here comes after that step's save
]
t_fit = time.perf_counter()
exit_code = 0
try:
    model.fit(
        train, epochs=args.epochs, initial_epoch=initial_epoch, callbacks=callbacks, verbose=0
    )
except SystemExit as exc:
    exit_code = exc.code
print(
    json.dumps(
        {
            "replicas": tfdist.num_replicas(),
            # how the first kernel lies (JAX): P(None, 'model') under --model-parallel
            "first_kernel": str(
                getattr(getattr(model.layers[1].kernel.value, "sharding", None), "spec", None)
            ),
            # distinct blocks of it this process holds (JAX): 1 of 2 with the model axis
            # across 2 processes
            "kernel_blocks_here": len(
                {
                    repr(s.index)
                    for s in getattr(model.layers[1].kernel.value, "addressable_shards", [])
                }
            ),
            "initial_epoch": initial_epoch,
            "restored": None
            if restored is None
            else {
                "path": os.path.basename(restored.path),
                "epoch": restored.epoch,
                "batch": restored.batch,
                "step": restored.step,
            },
            "trained": record.steps,
            "iterations": int(model.optimizer.iterations.numpy()),
            "weights": weights_of(model),
            "exit_code": exit_code,
            # BackupAndRestore removes its directory when training ends; a URL's listing
            "checkpoints": sorted(storage.listdir(args.dir)),
            "times": {
                "import_and_setup": t_restore - T0,
                "make_or_restore": t_restored - t_restore,
                "to_first_step": (record.first_step_time or time.perf_counter()) - T0,
                "fit_start_to_first_step": (record.first_step_time or time.perf_counter()) - t_fit,
            },
        }
    ),
    flush=True,
)
sys.exit(exit_code)
