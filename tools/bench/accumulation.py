"""What gradient accumulation costs across workers: ms per micro-step, 2 workers vs 2 devices.

The ``multi-worker-accumulation`` row of tools/bench/suite.py. The job (this file with
``--job``) trains tools/bench/launcher.py's MLP (784-256-256-10, 269k parameters) on
MNIST-sized synthetic data with ``SGD(gradient_accumulation_steps=4)``, global batch 128
per micro-step, under ``tfdist.strategy()``. A: 2 workers (``tfdist launch -n 2``, gRPC
all-reduce between processes); B: 2 logical CPU devices in one process. Since
``keras_tf_gradient_accumulation`` all-reduces once per window of 4 micro-steps, A pays the
gRPC all-reduce once every 4 micro-steps (goal: A/B <= 1.2; ``multi-worker-step`` is the
same comparison without accumulation). Runs alternate A B B A ... after a warm-up pair;
each times whole windows after warm-up windows.

    python -m tools.bench.accumulation --pairs 3
    python -m tfdist launch -n 2 tools/bench/accumulation.py --job --steps 200
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from tools.bench import harness

K = 4  # micro-steps per window
GOAL = 1.2


def window_steps(steps: int, warmup: int, steps_per_execution: int = 1) -> tuple[int, int]:
    """(steps, warmup) rounded up to whole windows of ``K`` micro-steps and whole
    executions of ``steps_per_execution`` steps, at least one each.

    Example:
        >>> window_steps(30, 5)
        (32, 8)
        >>> window_steps(30, 5, steps_per_execution=8)
        (32, 8)
    """
    if steps < 1 or warmup < 0 or steps_per_execution < 1:
        raise ValueError(
            f"bench_accumulation: steps and steps_per_execution must be >= 1 and warmup "
            f">= 0. Received: steps={steps}, warmup={warmup}, steps_per_execution="
            f"{steps_per_execution}. Pass e.g. steps=200, warmup=20."
        )
    unit = math.lcm(K, steps_per_execution)
    warmup = max(unit, -(-warmup // unit) * unit)
    timed = max(unit, -(-(steps - warmup) // unit) * unit) if steps > warmup else unit
    return warmup + timed, warmup


def per_micro_step(
    *, pairs: int = 3, steps: int = 200, warmup: int = 20, steps_per_execution: int = 1
) -> dict:
    """Milliseconds per micro-step: 2 workers (A) vs 2 logical devices in one process (B),
    both compiled with ``steps_per_execution``.

    Example:
        >>> per_micro_step(pairs=1, steps=40)["ratio_median"]  # doctest: +SKIP
        1.1
    """
    from tools.bench import launcher as bench_launcher

    steps, warmup = window_steps(steps, warmup, steps_per_execution)
    args = ["--job", "--steps", str(steps), "--warmup", str(warmup)]
    args += ["--steps-per-execution", str(steps_per_execution)]

    def measure(run):
        def once() -> float:
            _, report = run(args)
            if report["replicas"] != 2 or report["accumulation_steps"] != K:
                raise RuntimeError(f"bench_accumulation: expected 2 replicas, k={K}: {report}")
            return report["ms_per_micro_step"]

        return once

    def launched(job_args):
        return _run_self(bench_launcher, job_args, launch=True)

    def one_process(job_args):
        return _run_self(bench_launcher, job_args, launch=False)

    a, b = harness.alternate(measure(launched), measure(one_process), pairs)
    result = harness.summary(a, b)
    result.update(
        unit="ms/micro-step",
        steps=steps,
        warmup=warmup,
        accumulation_steps=K,
        steps_per_execution=steps_per_execution,
        goal=f"<= {GOAL}",
        goal_ratio=GOAL,
        met=result["ratio_median"] <= GOAL,
    )
    return result


def _run_self(bench_launcher, job_args: list[str], *, launch: bool) -> tuple[float, dict]:
    """This file as the job: under ``tfdist launch -n 2``, or alone on 2 logical CPUs."""
    import subprocess

    me = ["-m", __spec__.name]
    if launch:
        cmd = [sys.executable, "-m", "tfdist", "launch", "-n", "2", *me, *job_args]
        env = harness.child_env()
    else:
        cmd = [sys.executable, *me, *job_args]
        env = harness.child_env(TFDIST_CPU_DEVICES="2")
    started = time.time()
    proc = subprocess.run(
        cmd,
        cwd=bench_launcher.REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=bench_launcher.TIMEOUT,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench_accumulation: {cmd[1:5]} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    return started, harness.worker0_json(proc.stdout, "bench_accumulation")


def job(steps: int, warmup: int, global_batch: int = 128, steps_per_execution: int = 1) -> None:
    """Trains the MLP with accumulation; worker 0 prints ms per micro-step as JSON.

    Example:
        >>> job(*window_steps(200, 20))  # doctest: +SKIP
        {"replicas": 2, "accumulation_steps": 4, "ms_per_micro_step": 9.8, "updates": 50}
    """
    import numpy as np

    import tfdist

    strategy = tfdist.strategy()
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
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
            optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=K),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
    rng = np.random.default_rng(0)
    x = rng.random((global_batch * 8, 784), dtype=np.float32)
    y = rng.integers(0, 10, size=(global_batch * 8,))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .repeat()
        .batch(global_batch)
        .with_options(options)
        .prefetch(2)
    )
    marks = {}

    class Clock(keras.callbacks.Callback):
        """Marks the end of the warm-up windows and of the last micro-step (with
        steps_per_execution, Keras calls it at the last step of each execution, and
        ``steps`` and ``warmup`` are whole executions)."""

        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 == warmup:
                marks["warm"] = time.perf_counter()
            if batch + 1 == steps:
                marks["end"] = time.perf_counter()

    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[Clock()])
    ms = 1000 * (marks["end"] - marks["warm"]) / (steps - warmup)
    report = {
        "replicas": strategy.num_replicas_in_sync,
        "accumulation_steps": K,
        "steps_per_execution": steps_per_execution,
        "ms_per_micro_step": ms,
        "updates": int(model.optimizer.iterations.numpy()),
    }
    if tfdist.is_chief():
        print(json.dumps(report), flush=True)


# --- the table's rows (python -m tools.bench, tools/bench/suite.py) --------------------


def _figures_multi_worker_accumulation(
    quick: bool, pairs: int, steps_per_execution: int = 1
) -> dict:
    return per_micro_step(
        pairs=pairs,
        steps=24 if quick else 420,
        warmup=4 if quick else 20,
        steps_per_execution=steps_per_execution,
    )


def _result_multi_worker_accumulation(f: dict, quick: bool) -> harness.Result:
    return harness.Result(
        f["ratios"],
        met=None if quick else f["ratio_median"] <= f["goal_ratio"],
        a_values=f["a"],
        b_values=f["b"],
        value_unit="ms/micro-step",
        notes=f"{f['a_median']:.1f} ms vs {f['b_median']:.1f} ms per micro-step with "
        f"gradient_accumulation_steps={f['accumulation_steps']} (one all-reduce per window), "
        f"steps_per_execution={f.get('steps_per_execution', 1)}, "
        f"{f['steps'] - f['warmup']} timed micro-steps per run",
    )


TABLE_ROWS = [
    harness.Row(
        "multi-worker-accumulation",
        "2 workers, gradient_accumulation_steps=4, ms/micro-step",
        "2 logical devices in one process, the same",
        "<= 1.2",
        _figures_multi_worker_accumulation,
        _result_multi_worker_accumulation,
    ),
    harness.Row(
        "multi-worker-accumulation-k8",
        "2 workers, gradient_accumulation_steps=4, steps_per_execution=8, ms/micro-step",
        "2 logical devices in one process, the same",
        "<= 1.2",
        harness.executions(_figures_multi_worker_accumulation),
        _result_multi_worker_accumulation,
    ),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", action="store_true", help="be the measured job")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    args = parser.parse_args(argv)
    spe = args.steps_per_execution
    if args.job:
        job(*window_steps(args.steps, args.warmup, spe), steps_per_execution=spe)
        return 0
    if args.pairs < 1:
        parser.error(f"--pairs must be >= 1. Received: --pairs={args.pairs}")
    figures = per_micro_step(
        pairs=args.pairs, steps=args.steps, warmup=args.warmup, steps_per_execution=spe
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
