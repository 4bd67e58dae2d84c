"""What 2 logical CPU devices cost against 1 device on the same cores: the MNIST job's step.

``tfdist train mnist --devices 2`` on a machine without GPUs runs two replicas on two
*logical* devices of the same CPU cores: the same work as one device, split in half-batches.
This tool times the training step of the MNIST job's convnet (``fast_model``, Adam,
``metrics=["accuracy"]``, synthetic MNIST-shaped data in memory) in fresh processes,
alternated in rounds, per ``--batch`` images (the global batch of the 2-device job):

* ``1 device``: one device, global batch B: the reference;
* ``1 device, B/2, twice``: one device at half the batch, its step counted twice: what the
  two replicas' work costs when each half-batch runs at one device's speed for that size;
* ``2 devices``: 2 logical devices, global batch B (TensorFlow's in-process all-reduce);
* ``2 devices, 1 intra-op thread``: the same with ``TF_NUM_INTRAOP_THREADS=1``, and
  ``1 device, 1 intra-op thread`` to compare it with;
* ``2 devices, reduce_to_one``: the same with ``TFDIST_ALLREDUCE=reduce_to_one``;
* ``2 devices, upstream``: the same with every tfdist fix off (``TFDIST_COMPAT_EXCLUDE=all``);
* ``1 device, own loop`` and ``2 devices, own loop``: the same model, loss and optimizer in a
  hand-written step (``strategy.run`` of a ``GradientTape`` step over the distributed
  iterator, in a ``tf.function``, its loss read back every step) instead of ``fit``.

Each figure is the median step (``on_train_batch_begin`` to ``on_train_batch_end``) after a
warm-up, in ms per B images, and its ratio to ``1 device`` in the same round.

    python -m tools.bench.logical_devices --rounds 3 --json tools/results/logical_devices_measured.json
    python -m tools.bench.logical_devices --quick   # one short round
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from tools.bench.harness import REPO, in_turn, machine, write_json

RESULT = "LOGICAL "
TIMEOUT_S = 900
# name -> (devices, share of the global batch per step, times the step is counted, env, loop)
CONFIGS = {
    "1 device": (1, 1, 1, {}, "fit"),
    "1 device, B/2, twice": (1, 2, 2, {}, "fit"),
    "2 devices": (2, 1, 1, {}, "fit"),
    "2 devices, 1 intra-op thread": (2, 1, 1, {"TF_NUM_INTRAOP_THREADS": "1"}, "fit"),
    "1 device, 1 intra-op thread": (1, 1, 1, {"TF_NUM_INTRAOP_THREADS": "1"}, "fit"),
    "2 devices, reduce_to_one": (2, 1, 1, {"TFDIST_ALLREDUCE": "reduce_to_one"}, "fit"),
    "2 devices, upstream": (2, 1, 1, {"TFDIST_COMPAT_EXCLUDE": "all"}, "fit"),
    "1 device, own loop": (1, 1, 1, {}, "own"),
    "2 devices, own loop": (2, 1, 1, {}, "own"),
}
REFERENCE = "1 device"
# What the configurations vary: a configuration's process has none it does not set.
SETTINGS = ("TF_NUM_INTRAOP_THREADS", "TFDIST_ALLREDUCE", "TFDIST_COMPAT_EXCLUDE")


def job(batch: int, steps: int, warmup: int, loop: str = "fit") -> dict:
    """Runs in the measured process (``TFDIST_CPU_DEVICES`` set): the median step in ms of
    ``fit`` (``loop="fit"``) or of a hand-written step (``"own"``)."""

    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist_examples.recipes import fast_model

    strategy = tfdist.strategy()
    rng = np.random.default_rng(0)
    x = rng.random((batch * 8, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, size=batch * 8)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch).prefetch(2)
    with strategy.scope():
        model = fast_model()
        model.compile(
            keras.optimizers.Adam(1e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    run = _own_loop if loop == "own" else _fit_loop
    times = run(tf, keras, strategy, model, data, batch, steps)
    return {
        "replicas": strategy.num_replicas_in_sync,
        "batch": batch,
        "median_ms": 1000 * statistics.median(times[warmup:]),
    }


def _fit_loop(tf, keras, strategy, model, data, global_batch: int, steps: int) -> list[float]:
    """Seconds per ``fit`` step, ``on_train_batch_begin`` to ``on_train_batch_end``."""
    import time

    times: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.started)

    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[Clock()])
    return times


def _own_loop(tf, keras, strategy, model, data, global_batch: int, steps: int) -> list[float]:
    """Seconds per hand-written step: forward, backward, all-reduce and update per replica,
    the loss summed over the replicas and read back (as ``fit`` reads its logs)."""
    import time

    iterator = iter(strategy.experimental_distribute_dataset(data))
    with strategy.scope():  # its slots before the first step, as Keras's guides do
        model.optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(y, model(x, training=True))) / global_batch
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def step():
        losses = strategy.run(replica_step, next(iterator))
        return strategy.reduce("SUM", losses, axis=None)

    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - started)
    return times


def config_env(name: str, base) -> dict:
    """The environment of ``CONFIGS[name]``'s process: ``base`` with its devices and
    settings, and none of the settings another configuration makes."""
    devices, _, _, extra, _ = CONFIGS[name]
    env = {k: v for k, v in base.items() if k not in ("TF_CONFIG", *SETTINGS)}
    env.update(TFDIST_CPU_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2", **extra)
    return env


def run_config(name: str, batch: int, steps: int, warmup: int) -> float:
    """One fresh process of ``CONFIGS[name]``: its median step, in ms per ``batch`` images."""
    devices, share, count, _, loop = CONFIGS[name]
    env = config_env(name, os.environ)
    code = (
        "import json, sys; from tools.bench import logical_devices as b; "
        f"print({RESULT!r} + json.dumps(b.job({batch // share}, {steps}, {warmup}, {loop!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=REPO,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
    if line is None:
        raise RuntimeError(f"bench_logical_devices: {name!r} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(line[len(RESULT) :])
    if result["replicas"] != devices:
        raise RuntimeError(f"bench_logical_devices: {name!r} ran {result['replicas']} replicas")
    return result["median_ms"] * count


def measure(batch: int = 256, rounds: int = 3, steps: int = 60, warmup: int = 10) -> dict:
    """Every configuration once per round, the order reversed in every other round."""
    values: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for index in range(rounds):
        order = in_turn(list(CONFIGS), index)
        for name in order:
            values[name].append(run_config(name, batch, steps, warmup))
    return {
        "machine": machine(),
        "loadavg_1min": os.getloadavg()[0],
        "batch": batch,
        "rounds": rounds,
        "steps": steps,
        "warmup": warmup,
        "ms": values,
    }


def report(payload: dict) -> str:
    """The lines docs/benchmarks.md shows (tools/docs/figures.py renders them)."""
    reference = payload["ms"][REFERENCE]
    lines = [
        f"The MNIST job's convnet, ms per step of {payload['batch']} images (median of "
        f"{payload['steps'] - payload['warmup']} steps per process; {payload['rounds']} "
        f"alternated round(s); 1-minute load at the end: {payload['loadavg_1min']:.1f} on "
        f"{payload['machine']['cores']} cores), and its ratio to one device in the same round:"
    ]
    for name, ms in payload["ms"].items():
        ratios = [value / ref for value, ref in zip(ms, reference, strict=True)]
        lines.append(
            f"{name}: {statistics.median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f}), "
            f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}, "
            f"n={len(ratios)})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="global batch (even)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one short round")
    parser.add_argument("--json", help="write the figures (with machine and date) here")
    args = parser.parse_args(argv)
    if args.batch < 2 or args.batch % 2:
        parser.error(f"--batch must be an even number of 2 or more; received {args.batch}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; received {args.rounds}")
    if args.quick:
        payload = measure(args.batch, rounds=1, steps=12, warmup=4)
    else:
        payload = measure(args.batch, args.rounds)
    print(report(payload))
    if args.json:
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
