"""The JAX job tools/bench/suite.py --scaling times (run with KERAS_BACKEND=jax).

    python jax_bench_job.py --mode tfdist|keras|none [--model mlp|convnet]
        [--steps 60] [--warmup 10] [--global-batch 128]

``tfdist``: ``with tfdist.scope():`` (DataParallel over every device of the job);
``keras``: the hand-written equivalent, ``keras.distribution.set_distribution(
DataParallel(devices=list_devices()))``; ``none``: no distribution (one device). Data is
numpy (no TensorFlow: the job also runs where only jax is installed); each process feeds
its own share of every global batch. Process 0 prints one JSON line with ``ms_per_step``
and ``images_per_s`` (steps after ``--warmup``).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import keras
import numpy as np
from keras import distribution as kd

import tfdist  # after keras works too: tfdist's start-up hook ran before any of them

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import builders  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=("tfdist", "keras", "none"), default="tfdist")
parser.add_argument("--model", choices=("mlp", "convnet"), default="mlp")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--warmup", type=int, default=10)
parser.add_argument("--global-batch", type=int, default=128)
args = parser.parse_args()


def build():
    return builders.bench_model(args.model)


procs, rank = jax.process_count(), jax.process_index()
if args.mode == "tfdist":
    with tfdist.scope() as dist:
        dist.auto_shard_dataset = False  # numpy data: each process feeds its own share
        model = build()
elif args.mode == "keras":
    dist = kd.DataParallel(devices=kd.list_devices(), auto_shard_dataset=False)
    kd.set_distribution(dist)
    model = build()
else:
    model = build()

local_batch = args.global_batch // procs
shape = (28, 28, 1) if args.model == "convnet" else (784,)
rng = np.random.default_rng(rank)
x = rng.random((local_batch * args.steps, *shape), dtype=np.float32)
y = rng.integers(0, 10, size=(local_batch * args.steps,))
marks = {}


class Clock(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == args.warmup:
            marks["warm"] = time.perf_counter()
        if batch == args.steps - 1:
            marks["end"] = time.perf_counter()


model.fit(x, y, batch_size=local_batch, epochs=1, shuffle=False, verbose=0, callbacks=[Clock()])
ms = 1000 * (marks["end"] - marks["warm"]) / (args.steps - 1 - args.warmup)
if rank == 0:
    report = {
        "mode": args.mode,
        "devices": len(jax.devices()),
        "platform": jax.default_backend(),
        "processes": procs,
        "ms_per_step": ms,
        "images_per_s": args.global_batch * 1000 / ms,
    }
    print(json.dumps(report), flush=True)
