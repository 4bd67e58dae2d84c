"""The job tools/bench/launcher.py, comm.py and python -m tools.bench --scaling time.

    python mw_bench_job.py --steps 60 --warmup 10 --global-batch 128 [--first-step-only]
        [--model mlp|convnet] [--implementation auto|ring|nccl] [--bytes-per-pack N]
        [--steps-per-execution K] [--jit-compile] [--weights]

An MLP (784-256-256-10, 269k parameters; default) or the MNIST ``fast`` convnet on
synthetic MNIST-sized data, trained with plain SGD from a fixed seed. Uses
``tfdist.strategy()`` (so it runs the same under ``tfdist launch``, with a hand-written
TF_CONFIG, or with TFDIST_CPU_DEVICES). Worker 0 prints one JSON line: ``first_step``
(wall-clock time at the end of the first training step), ``ms_per_step`` (mean over the
steps after ``--warmup``; absent with ``--first-step-only``, which stops after one step),
``images_per_s``, and with ``--weights`` the final weights (for equivalence tests).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import tfdist
from tfdist.core.config import Communication

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--warmup", type=int, default=10)
parser.add_argument("--global-batch", type=int, default=128)
parser.add_argument("--first-step-only", action="store_true")
parser.add_argument("--model", choices=("mlp", "convnet"), default="mlp")
parser.add_argument("--implementation", default=None)
parser.add_argument("--bytes-per-pack", type=int, default=None)
parser.add_argument("--steps-per-execution", type=int, default=1)
parser.add_argument("--jit-compile", action="store_true")
parser.add_argument("--weights", action="store_true")
args = parser.parse_args()

comm = None
if args.implementation is not None or args.bytes_per_pack is not None:
    comm = Communication(args.implementation or "auto", args.bytes_per_pack or 0)
strategy = tfdist.strategy(communication=comm)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import builders  # noqa: E402


def build():
    return builders.bench_model(
        args.model,
        steps_per_execution=args.steps_per_execution,
        jit_compile=args.jit_compile,
    )


shape = (28, 28, 1) if args.model == "convnet" else (784,)
rng = np.random.default_rng(0)
x = rng.random((args.global_batch * 8, *shape), dtype=np.float32)
y = rng.integers(0, 10, size=(args.global_batch * 8,))
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
data = (
    tf.data.Dataset.from_tensor_slices((x, y))
    .repeat()
    .batch(args.global_batch)
    .with_options(options)
    .prefetch(2)
)

with strategy.scope():
    model = build()

marks = {}
spe = args.steps_per_execution


class Clock(keras.callbacks.Callback):
    """Marks the end of the first step, of the warm-up and of the last step.

    With steps_per_execution K, Keras calls it once per K steps (``batch`` is the last
    step of the execution), so the marks fall on execution boundaries.
    """

    def on_train_batch_end(self, batch, logs=None):
        if "first_step" not in marks:
            marks["first_step"] = time.time()
            if args.first_step_only:
                self.model.stop_training = True
        if "warm" not in marks and batch + 1 >= args.warmup:
            marks["warm"], marks["warm_step"] = time.perf_counter(), batch
        if batch == args.steps - 1:
            marks["end"] = time.perf_counter()


model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0, callbacks=[Clock()])
report = {"first_step": marks["first_step"], "replicas": strategy.num_replicas_in_sync}
if "end" in marks:
    timed_steps = args.steps - 1 - marks["warm_step"]
    report["ms_per_step"] = 1000 * (marks["end"] - marks["warm"]) / timed_steps
    report["images_per_s"] = args.global_batch * 1000 / report["ms_per_step"]
if args.weights:
    from tfdist.backends import tensorflow as tf_backend

    plan = tf_backend.current_plan()
    report["weights"] = [w.tolist() for w in model.get_weights()]
    report["communication"] = [plan.communication.implementation, plan.communication.bytes_per_pack]
if tfdist.is_chief():
    print(json.dumps(report), flush=True)
