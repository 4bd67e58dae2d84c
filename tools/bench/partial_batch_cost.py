"""What the partial-batch fixes cost on full batches: ms per training step, fixes on and off.

tfdist's fix ``keras_tf_partial_batch_loss_weights`` all-reduces one scalar per loss per
training step (each replica's share of the global batch), though only an epoch's last
batch can be partial; ``tf_distribute_partial_batch_evenly`` cuts every batch into slices
whose sizes differ by at most one and ``keras_tf_fit_refuses_empty_replicas`` reads the
batch sizes before ``fit``. This tool times ``fit`` on FULL batches only (a dataset whose size divides the
global batch) with the fixes on (A, the default) and off (B, ``TFDIST_COMPAT_EXCLUDE`` of
the three: upstream), each run a fresh process (the fixes are process-wide), A and B
alternated (A B, then B A, ...) after one unrecorded warm-up pair, in each configuration:

* ``2 devices``: 2 logical CPU devices in one process (``TFDIST_CPU_DEVICES=2``);
* ``2 workers``: ``python -m tfdist launch -n 2`` (one CPU device each, gRPC all-reduce);

each with a model of one output and one of two outputs (each output's loss adds one
scalar all-reduce). The model is the benchmarks' MLP (784-256-256, then one or two
Dense(10) heads; SGD(0.01), seed 0; tests/scripts/mw_bench_job.py's) or ``--model
convnet`` (the MNIST job's convnet), on synthetic MNIST-shaped data, global batch 128, no
shuffle. A run trains ``--epochs`` epochs in one ``fit`` call; its figure is the median
step (``on_train_batch_end`` to ``on_train_batch_end``) of every epoch after the first
(compile and the first epoch left out), each epoch's first step left out too (the
iterator's creation: docs/benchmarks.md, "The first step of an epoch"). The median, since
on a shared machine other jobs' bursts move a run's mean far more (the JSON holds the
means too). Each run also counts the replica all-reduces its training step traced.

It also checks both sides trained the same model: on full batches the fix's share is
exactly 1.0, so A's and B's final weights must be equal (reported: the largest
``|A - B|`` of any weight in any pair; above ``WEIGHTS_ATOL`` that is a bug, said loudly).
Each run reports which fixes its process applied, and a run with the wrong ones fails.

    python -m tools.bench.partial_batch_cost --pairs 5 --json tools/results/partial_batch_cost_measured.json
    python -m tools.bench.partial_batch_cost --quick   # one short pair, 2 workers, 1 output
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench import harness
from tools.bench.harness import REPO, child_env, in_turn, machine, write_json

TIMEOUT_S = 900  # one run
GLOBAL_BATCH = 128
WEIGHTS_ATOL = 1e-6
FIXES = (
    "keras_tf_partial_batch_loss_weights",
    "tf_distribute_partial_batch_evenly",
    "keras_tf_fit_refuses_empty_replicas",
)
EXCLUDE = ",".join(FIXES)
SIDES = {"fixes": {}, "upstream": {"TFDIST_COMPAT_EXCLUDE": EXCLUDE}}  # A, B
# name -> (where, outputs)
CONFIGS = {
    "2 devices, 1 output": ("devices", 1),
    "2 devices, 2 outputs": ("devices", 2),
    "2 workers, 1 output": ("workers", 1),
    "2 workers, 2 outputs": ("workers", 2),
}
MODELS = ("mlp", "convnet")
RESULT = "PARTIAL_BATCH_COST "


# --- the measured job: this file with --job, in a fresh process (or two, under launch) ---


def job(model: str, outputs: int, examples: int, epochs: int, weights: str | None) -> dict:
    """Trains ``epochs`` epochs of full batches under ``tfdist.strategy()``; the mean
    step in ms of the epochs after the first (each epoch's first step left out)."""
    import tfdist

    strategy = tfdist.strategy()

    import keras
    import numpy as np
    import tensorflow as tf

    shape = (28, 28, 1) if model == "convnet" else (784,)
    rng = np.random.default_rng(0)
    x = rng.random((examples, *shape), dtype=np.float32)
    labels = [rng.integers(0, 10, size=(examples,)) for _ in range(outputs)]
    y = labels[0] if outputs == 1 else tuple(labels)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(GLOBAL_BATCH)
        .with_options(options)
        .prefetch(2)
    )
    with strategy.scope():
        net = build(keras, model, outputs)

    # Counts the replica all-reduces traced (Python, at trace time: nothing at run time);
    # the loss-weights fix issues one per loss per replica, Keras's own reductions none.
    traced: list[int] = []
    all_reduce = tf.distribute.ReplicaContext.all_reduce

    def counted(self, reduce_op, value, options=None):
        traced.append(1)
        return all_reduce(self, reduce_op, value, options)

    tf.distribute.ReplicaContext.all_reduce = counted
    ends: list[list[float]] = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            ends.append([])

        def on_train_batch_end(self, batch, logs=None):
            ends[-1].append(time.perf_counter())

    net.fit(data, epochs=epochs, verbose=0, callbacks=[Clock()])
    # The first epoch (tracing, compiling) and each epoch's first step are left out.
    steps = [b - a for epoch in ends[1:] for a, b in zip(epoch[:-1], epoch[1:], strict=True)]
    if weights and tfdist.is_chief():
        np.savez(weights, *net.get_weights())
    return {
        "replicas": strategy.num_replicas_in_sync,
        "steps_per_epoch": len(ends[0]),
        "timed_steps": len(steps),
        "ms_per_step": 1000 * statistics.median(steps),
        "mean_ms_per_step": 1000 * statistics.mean(steps),
        "applied": [name for name in FIXES if name in tfdist.compat.applied()],
        "replica_all_reduces_traced": len(traced) / len(strategy.extended.worker_devices),
        "chief": tfdist.is_chief(),
    }


def build(keras, model: str, outputs: int):
    """The MLP of tests/scripts/mw_bench_job.py (or the MNIST job's convnet) with
    ``outputs`` Dense(10) heads, one loss each, SGD(0.01), seed 0."""
    keras.utils.set_random_seed(0)
    if model == "convnet":
        from tfdist_examples.recipes import fast_model

        inputs = keras.Input((28, 28, 1))
        body = fast_model().layers[:-1]  # all but its Dense(10) head
    else:
        inputs = keras.Input((784,))
        body = [keras.layers.Dense(256, activation="relu") for _ in range(2)]
    features = inputs
    for layer in body:
        features = layer(features)
    heads = [keras.layers.Dense(10, name=f"out{i}")(features) for i in range(outputs)]
    net = keras.Model(inputs, heads[0] if outputs == 1 else heads)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    net.compile(keras.optimizers.SGD(0.01), loss=loss if outputs == 1 else [loss] * outputs)
    return net


# --- the parent: alternated fresh processes ---


def _env(side: str, where: str) -> dict:
    env = child_env()
    env.pop("TFDIST_COMPAT_EXCLUDE", None)
    env.update(SIDES[side])
    if where == "devices":
        env["TFDIST_CPU_DEVICES"] = "2"
    return env


def run_config(name: str, side: str, model: str, examples: int, epochs: int, weights: str) -> dict:
    """One fresh run of ``CONFIGS[name]`` on ``side`` ("fixes" or "upstream"); worker 0's
    (or the process's) report, its final weights written to ``weights`` (.npz)."""
    where, outputs = CONFIGS[name]
    me = ["-m", __spec__.name, "--job", "--model", model, "--outputs", str(outputs)]
    me += ["--examples", str(examples), "--epochs", str(epochs), "--weights", weights]
    launch = [sys.executable, "-m", "tfdist", "launch", "-n", "2"] if where == "workers" else []
    proc = subprocess.run(
        (launch or [sys.executable]) + me,
        cwd=REPO,
        env=_env(side, where),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    report = None
    for line in proc.stdout.splitlines():
        start = line.find(RESULT)
        if start >= 0 and line[:start].strip() in ("", "[w0]"):
            report = json.loads(line[start + len(RESULT) :])
    if proc.returncode != 0 or report is None:
        raise RuntimeError(
            f"bench_partial_batch_cost: {name!r} ({side}) exited {proc.returncode}:\n"
            f"{proc.stderr[-3000:]}"
        )
    expected = list(FIXES) if side == "fixes" else []
    if report["replicas"] != 2 or report["applied"] != expected:
        raise RuntimeError(
            f"bench_partial_batch_cost: {name!r} ({side}) ran {report['replicas']} replicas "
            f"with the fixes {report['applied']}; expected 2 with {expected}"
        )
    return report


def _max_abs_diff(path_a: str, path_b: str) -> float:
    import numpy as np

    with np.load(path_a) as a, np.load(path_b) as b:
        if sorted(a.files) != sorted(b.files):
            return float("inf")
        return max(float(np.max(np.abs(a[k] - b[k]))) if a[k].size else 0.0 for k in a.files)


def measure(
    pairs: int = 3,
    model: str = "mlp",
    examples: int = 120 * GLOBAL_BATCH,
    epochs: int = 5,
    configs: tuple[str, ...] = tuple(CONFIGS),
    warmup: bool = True,
) -> dict:
    """``pairs`` alternated A/B pairs of fresh processes in every configuration, the
    configurations taken in turn within each pair (so load drift hits them all).

    Example:
        >>> f = measure(pairs=1, configs=("2 workers, 1 output",))  # doctest: +SKIP
        >>> f["configs"]["2 workers, 1 output"]["ratios"]  # doctest: +SKIP
        [1.01]
    """
    unknown = sorted(set(configs) - set(CONFIGS))
    if (
        unknown
        or model not in MODELS
        or pairs < 1
        or epochs < 2
        or examples % GLOBAL_BATCH
        or examples < 2 * GLOBAL_BATCH
    ):
        raise ValueError(
            f"bench_partial_batch_cost: configs must be among {list(CONFIGS)}, model one of "
            f"{MODELS}, pairs >= 1, epochs >= 2 and examples a multiple of {GLOBAL_BATCH} "
            f"(2 batches or more: full batches only). Received: configs={list(configs)}, "
            f"model={model!r}, pairs={pairs}, epochs={epochs}, examples={examples}"
        )
    before = machine()
    load_before = os.getloadavg()[0]
    figures = {
        name: {"a_ms": [], "b_ms": [], "ratios": [], "max_abs_weight_diff": 0.0} for name in configs
    }
    with tempfile.TemporaryDirectory(prefix="partial_batch_cost_") as tmp:

        def once(name: str, side: str, index: int) -> tuple[dict, str]:
            weights = str(Path(tmp) / f"{index}-{side}-{name.replace(' ', '_')}.npz")
            return run_config(name, side, model, examples, epochs, weights), weights

        if warmup:  # disk caches, the launcher's first start: not recorded
            for side in SIDES:
                once(configs[0], side, -1)
        for i in range(pairs):
            for name in configs:
                order = in_turn(("fixes", "upstream"), i)
                got = {side: once(name, side, i) for side in order}
                (a, a_weights), (b, b_weights) = got["fixes"], got["upstream"]
                f = figures[name]
                f["a_ms"].append(a["ms_per_step"])
                f["b_ms"].append(b["ms_per_step"])
                f["ratios"].append(a["ms_per_step"] / b["ms_per_step"])
                f.setdefault("a_mean_ms", []).append(a["mean_ms_per_step"])
                f.setdefault("b_mean_ms", []).append(b["mean_ms_per_step"])
                f.update(timed_steps=a["timed_steps"], steps_per_epoch=a["steps_per_epoch"])
                f["a_all_reduces_traced"] = a["replica_all_reduces_traced"]
                f["b_all_reduces_traced"] = b["replica_all_reduces_traced"]
                diff = _max_abs_diff(a_weights, b_weights)
                f["max_abs_weight_diff"] = max(f["max_abs_weight_diff"], diff)
    for f in figures.values():
        f["weights_equal"] = f["max_abs_weight_diff"] <= WEIGHTS_ATOL
    return {
        "machine": before,
        "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "model": model,
        "global_batch": GLOBAL_BATCH,
        "examples": examples,
        "epochs": epochs,
        "pairs": pairs,
        "exclude": EXCLUDE,
        "weights_atol": WEIGHTS_ATOL,
        "configs": figures,
    }


def summary(f: dict) -> dict:
    """One configuration's medians: A and B in ms/step, their difference, the ratio's
    median and range."""
    a, b = statistics.median(f["a_ms"]), statistics.median(f["b_ms"])
    return {
        "a_ms": a,
        "b_ms": b,
        "extra_ms": a - b,
        "ratio": statistics.median(f["ratios"]),
        "ratio_min": min(f["ratios"]),
        "ratio_max": max(f["ratios"]),
    }


def report(payload: dict) -> str:
    """The lines docs/benchmarks.md shows (tools/docs/figures.py renders them): a
    heading line, then one line per configuration.

    Example:
        >>> f = {"a_ms": [20.5, 21.0], "b_ms": [20.0, 20.0], "ratios": [1.025, 1.05],
        ...      "max_abs_weight_diff": 0.0, "weights_equal": True, "timed_steps": 117,
        ...      "steps_per_epoch": 40, "a_all_reduces_traced": 2.0, "b_all_reduces_traced": 1.0}
        >>> p = {"machine": {"cores": 2}, "loadavg_1min": [1.0, 2.0], "model": "mlp",
        ...      "global_batch": 128, "examples": 5120, "epochs": 4, "pairs": 2,
        ...      "weights_atol": 1e-6, "configs": {"2 workers, 1 output": f}}
        >>> print(report(p).splitlines()[1])
        2 workers, 1 output (1 scalar all-reduce(s) more a step): fixes on 20.8 ms, off 20.0 ms: +0.8 ms a step, A/B 1.04 (1.02-1.05, n=2), A slower in 2 of 2 pairs; weights A = B (largest |A - B| 0)
    """
    model = {"mlp": "The benchmarks' MLP", "convnet": "The MNIST job's convnet"}[payload["model"]]
    first = next(iter(payload["configs"].values()))
    lines = [
        f"{model}, ms per training step on full batches only ({payload['examples']} "
        f"examples, global batch {payload['global_batch']}: {first['steps_per_epoch']} full "
        f"steps an epoch; the median of {first['timed_steps']} steps per run, those of "
        f"epochs 2-{payload['epochs']} but each epoch's first); A: the fixes on, B: the three off "
        f"(upstream); {payload['pairs']} alternated pair(s) of fresh processes; 1-minute "
        f"load {payload['loadavg_1min'][0]} -> {payload['loadavg_1min'][1]} on "
        f"{payload['machine']['cores']} cores:"
    ]
    for name, f in payload["configs"].items():
        s = summary(f)
        diff = f["max_abs_weight_diff"]
        same = (
            f"weights A = B (largest |A - B| {diff:.3g})"
            if f["weights_equal"]
            else f"**weights A != B: largest |A - B| {diff:.3g} > {payload['weights_atol']:g}, "
            "a bug**"
        )
        more = f.get("a_all_reduces_traced", 0) - f.get("b_all_reduces_traced", 0)
        lines.append(
            f"{name} ({more:g} scalar all-reduce(s) more a step): fixes on {s['a_ms']:.1f} "
            f"ms, off {s['b_ms']:.1f} ms: "
            f"{s['extra_ms']:+.1f} ms a step, A/B {s['ratio']:.3g} ({s['ratio_min']:.3g}-"
            f"{s['ratio_max']:.3g}, n={len(f['ratios'])}), A slower in "
            f"{sum(r > 1 for r in f['ratios'])} of {len(f['ratios'])} pairs; {same}"
        )
    return "\n".join(lines)


# --- the table's rows (python -m tools.bench, tools/bench/suite.py) --------------------


# The partial-batch fixes on full batches: 2 workers (the gRPC scalar all-reduce), 1 output.
PARTIAL_BATCH_CONFIG = "2 workers, 1 output"
PARTIAL_BATCH_GOAL = 1.05


def _figures_partial_batch_cost(quick: bool, pairs: int) -> dict:
    if quick:
        return measure(
            pairs=pairs,
            examples=10 * GLOBAL_BATCH,
            epochs=2,
            configs=(PARTIAL_BATCH_CONFIG,),
            warmup=False,
        )
    return measure(pairs=pairs, configs=(PARTIAL_BATCH_CONFIG,))


def _result_partial_batch_cost(f: dict, quick: bool) -> harness.Result:
    row = f["configs"][PARTIAL_BATCH_CONFIG]
    a, b = statistics.median(row["a_ms"]), statistics.median(row["b_ms"])
    same = row["weights_equal"]
    met = None if quick else statistics.median(row["ratios"]) <= PARTIAL_BATCH_GOAL
    return harness.Result(
        row["ratios"],
        met=met if same else False,  # weights that differ on full batches: a bug, quick or not
        a_values=row["a_ms"],
        b_values=row["b_ms"],
        value_unit="ms/step",
        notes=f"{a:.1f} ms vs {b:.1f} ms per step ({a - b:+.1f} ms), "
        f"the median of {row['timed_steps']} full steps per run; largest |A - B| of the final "
        f"weights {row['max_abs_weight_diff']:.3g}"
        + ("" if same else " (**A and B trained differently on full batches: a bug**)"),
    )


TABLE_ROWS = [
    harness.Row(
        "partial-batch-cost",
        "2 workers, the partial-batch fixes on, ms/step on full batches",
        "the same with the three fixes off (upstream)",
        f"<= {PARTIAL_BATCH_GOAL}, weights A = B",
        _figures_partial_batch_cost,
        _result_partial_batch_cost,
    )
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="recorded A/B pairs (default 3)")
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--examples", type=int, default=120 * GLOBAL_BATCH)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--only", action="append", choices=sorted(CONFIGS), help="this configuration only"
    )
    parser.add_argument("--quick", action="store_true", help="one short pair, 2 workers, 1 output")
    parser.add_argument("--json", metavar="FILE", help="write the figures (machine, date) here")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--outputs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        result = job(args.model, args.outputs, args.examples, args.epochs, args.weights)
        if result["chief"]:
            print(RESULT + json.dumps(result), flush=True)
        return 0
    if args.quick:
        payload = measure(
            pairs=1, model=args.model, examples=10 * GLOBAL_BATCH, epochs=2,
            configs=tuple(args.only or ["2 workers, 1 output"]), warmup=False,
        )  # fmt: skip
    else:
        payload = measure(
            pairs=args.pairs, model=args.model, examples=args.examples, epochs=args.epochs,
            configs=tuple(args.only or CONFIGS),
        )  # fmt: skip
    print(report(payload))
    if args.json:
        write_json(args.json, payload)
    if not all(f["weights_equal"] for f in payload["configs"].values()):
        print(
            "bench_partial_batch_cost: A's and B's weights differ on full batches: a bug",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
