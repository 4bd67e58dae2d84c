"""The job tools/bench_launcher.py times: an MLP on synthetic MNIST-sized data.

    python mw_bench_job.py --steps 60 --warmup 10 --global-batch 128 [--first-step-only]

Uses ``tfdist.strategy()`` (so it runs the same under ``tfdist launch``, with a
hand-written TF_CONFIG, or with TFDIST_CPU_DEVICES). Worker 0 prints one JSON line:
``first_step`` (wall-clock time at the end of the first training step), and
``ms_per_step`` (mean over the steps after ``--warmup``; absent with
``--first-step-only``, which stops after one step).
"""

import argparse
import json
import time

import numpy as np

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--warmup", type=int, default=10)
parser.add_argument("--global-batch", type=int, default=128)
parser.add_argument("--first-step-only", action="store_true")
args = parser.parse_args()

strategy = tfdist.strategy()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

rng = np.random.default_rng(0)
x = rng.random((args.global_batch * 8, 784), dtype=np.float32)
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
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

marks = {}


class Clock(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            marks["first_step"] = time.time()
            if args.first_step_only:
                self.model.stop_training = True
        if batch == args.warmup:
            marks["warm"] = time.perf_counter()
        if batch == args.steps - 1:
            marks["end"] = time.perf_counter()


model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0, callbacks=[Clock()])
report = {"first_step": marks["first_step"], "replicas": strategy.num_replicas_in_sync}
if "end" in marks:
    report["ms_per_step"] = 1000 * (marks["end"] - marks["warm"]) / (args.steps - 1 - args.warmup)
if tfdist.is_chief():
    print(json.dumps(report), flush=True)
