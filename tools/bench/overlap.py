"""The overlap experiment: all-reduce gradient packs during the backward pass, or after it.

Two workers (``tfdist launch -n 2``, MultiWorkerMirroredStrategy, TF's gRPC ring) train
the same model from the same seed on the same batches in one process per worker, one
copy per variant, each step a ``tf.function`` over ``strategy.run``:

* ``compute``: forward + backward, no all-reduce, no update (the floor);
* ``keras``: the gradients, then ``optimizer.apply_gradients`` (Keras's own path: one
  packed all-reduce of every gradient once the whole backward pass is done);
* ``after``: the same by hand (one ``all_reduce`` of every gradient, then SGD), the
  control for the hand-written update;
* ``inback-<size>``: one tape, then one ``all_reduce`` per pack of about ``size`` bytes,
  packs formed from the LAST layers first, so each collective depends only on its own
  pack's gradients and TF's executor may start it while earlier layers' backward runs;
* ``firstfirst-<size>``: the same packs issued first layers first: TF chains a replica's
  collectives in program order (an ordering token), so the first waits for the whole
  backward pass and the rest follow it: the control for the order.

Each launch times every variant in rounds (the order reversed every other round), so load
drift hits all alike, and reports per variant the median ms/step, the exposed
communication (variant - compute) and the largest weight difference from ``keras`` after
the same steps. The parent repeats the launch ``--pairs`` times and prints per variant
the ratio variant/keras (median and range over launches).

    python -m tools.bench.overlap                       # resnet, 3 launches
    python -m tools.bench.overlap --pairs 1 --rounds 2 --json overlap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from tools.bench import harness
from tools.bench import step_breakdown as sb

REPO = harness.REPO
TIMEOUT_S = 900
LEARNING_RATE = 0.01


def reverse_packs(sizes: list[int], pack_bytes: int) -> list[list[int]]:
    """Indices of gradients of ``sizes`` bytes in packs of >= ``pack_bytes``, last first.

    Example:
        >>> reverse_packs([40, 1200, 20], 1000)
        [[2, 1], [0]]
    """
    if pack_bytes < 1:
        raise ValueError(
            f"bench_overlap: pack_bytes must be >= 1. Received: pack_bytes={pack_bytes}"
        )
    packs, size = [], pack_bytes
    for i in reversed(range(len(sizes))):
        if size >= pack_bytes:  # the previous pack is full: start the next
            packs.append([])
            size = 0
        packs[-1].append(i)
        size += sizes[i]
    return packs


def _sgd(tf, grads, variables):
    """Plain SGD on mirrored variables from already-reduced gradients (no second all-reduce)."""

    def merge(strategy, pairs):
        for g, v in pairs:
            strategy.extended.update(
                v, lambda var, grad: var.assign_sub(LEARNING_RATE * grad), args=(g,), group=False
            )

    tf.distribute.get_replica_context().merge_call(
        merge, args=(list(zip(grads, variables, strict=True)),)
    )


def _variants(tf, keras, strategy, model_name: str, pack_sizes: list[int]) -> dict:
    """name -> (model, replica step function)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    replicas = strategy.num_replicas_in_sync

    def grads_of(model, x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) / replicas
        return tape.gradient(loss, model.trainable_variables)

    def compute(model, batch):
        return tf.add_n([tf.reduce_sum(g) for g in grads_of(model, *batch)])

    def keras_step(model, batch):
        grads = grads_of(model, *batch)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    def after(model, batch):
        grads = grads_of(model, *batch)
        reduced = tf.distribute.get_replica_context().all_reduce("sum", grads)
        _sgd(tf, reduced, [v.value for v in model.trainable_variables])

    def in_backward(pack_bytes, last_first=True):
        def step(model, batch):
            grads = list(grads_of(model, *batch))
            reduced = [None] * len(grads)
            context = tf.distribute.get_replica_context()
            sizes = [g.shape.num_elements() * g.dtype.size for g in grads]
            packs = reverse_packs(sizes, pack_bytes)
            for pack in packs if last_first else reversed(packs):
                for i, r in zip(
                    pack, context.all_reduce("sum", [grads[i] for i in pack]), strict=True
                ):
                    reduced[i] = r
            _sgd(tf, reduced, [v.value for v in model.trainable_variables])

        return step

    fns = {"compute": compute, "keras": keras_step, "after": after}
    for size in pack_sizes:
        fns[f"inback-{size // 1024}k"] = in_backward(size)
    if pack_sizes:  # the control: the same packs issued first layers first, which the
        # collectives' ordering token makes wait for the whole backward pass
        fns[f"firstfirst-{pack_sizes[0] // 1024}k"] = in_backward(pack_sizes[0], False)
    with strategy.scope():
        models = {name: sb.build_model(keras, model_name, LEARNING_RATE) for name in fns}
    return {name: (models[name], fns[name]) for name in fns}


def child(model_name: str, rounds: int, calls: int, global_batch: int, packs: list[int]) -> dict:
    """Runs in each worker: every variant ``rounds`` x ``calls`` steps, then the weights."""
    import tfdist

    strategy = tfdist.strategy()
    import keras
    import numpy as np
    import tensorflow as tf

    data = strategy.experimental_distribute_dataset(sb.dataset(tf, global_batch, model_name))
    variants = _variants(tf, keras, strategy, model_name, packs)
    timed = {}
    for name, (model, fn) in variants.items():
        iterator = iter(data)  # every variant sees the same batches from the start
        timed[name] = tf.function(
            lambda m=model, f=fn, it=iterator: strategy.run(lambda b: f(m, b), (next(it),))
        )
        sb.time_calls(timed[name], 5)  # trace and warm up
    times = {name: [] for name in timed}
    for r in range(rounds):
        for name in harness.in_turn(list(timed), r):
            times[name].append(sb.time_calls(timed[name], calls))
    ms = {name: statistics.median(v) for name, v in times.items()}
    reference = variants["keras"][0].get_weights()
    trained = [n for n in ms if n != "compute"]
    return {
        "replicas": strategy.num_replicas_in_sync,
        "steps": 5 + rounds * calls,
        "ms": ms,
        "exposed_ms": {n: ms[n] - ms["compute"] for n in trained},
        "max_weight_diff": {
            n: max(
                float(np.max(np.abs(a - b)))
                for a, b in zip(variants[n][0].get_weights(), reference, strict=True)
            )
            for n in trained
        },
        "chief": tfdist.is_chief(),
    }


def _launch(child_args: list[str]) -> dict:
    me = ["-m", __spec__.name, "--child", *child_args]
    cmd = [sys.executable, "-m", "tfdist", "launch", "-n", "2", *me]
    proc = subprocess.run(
        cmd, cwd=REPO, env=harness.child_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    for line in reversed(proc.stdout.splitlines()):
        start = line.find("{")
        if start >= 0 and line[:start].strip() in ("", "[w0]"):
            return json.loads(line[start:])
    raise RuntimeError(
        f"bench_overlap: the launch exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    )


def _range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(runs: list[dict]) -> dict:
    """Per variant: ms/step, exposed ms and ratio to ``keras``, each median with its range."""
    out = {}
    for name in runs[0]["ms"]:
        row = {"ms": _range([r["ms"][name] for r in runs])}
        if name != "compute":
            row["exposed_ms"] = _range([r["exposed_ms"][name] for r in runs])
            row["ratio_to_keras"] = _range([r["ms"][name] / r["ms"]["keras"] for r in runs])
            row["max_weight_diff"] = max(r["max_weight_diff"][name] for r in runs)
        out[name] = row
    return out


def measure(
    model: str = "resnet",
    pairs: int = 3,
    rounds: int = 4,
    calls: int = 10,
    global_batch: int = 64,
    packs: tuple[int, ...] = (256 * 1024, 1024 * 1024),
) -> dict:
    """``pairs`` launches of the experiment, summarised, with the machine it ran on.

    Example:
        >>> measure(pairs=1)["variants"]["inback-256k"]["ratio_to_keras"]  # doctest: +SKIP
        {'median': 0.97, 'min': 0.97, 'max': 0.97}
    """  # fmt: skip
    if pairs < 1 or rounds < 1 or calls < 1:
        raise ValueError(
            f"bench_overlap: pairs, rounds and calls must be >= 1. Received: pairs={pairs}, "
            f"rounds={rounds}, calls={calls}"
        )
    args = ["--model", model, "--rounds", str(rounds), "--calls", str(calls),
            "--global-batch", str(global_batch), "--packs", ",".join(map(str, packs))]  # fmt: skip
    before = harness.machine()
    runs = [_launch(args) for _ in range(pairs)]
    return {
        "machine": before,
        "load_after": harness.machine()["load_avg"],
        "model": model,
        "pairs": pairs,
        "rounds": rounds,
        "calls": calls,
        "global_batch": global_batch,
        "variants": summarise(runs),
        "runs": runs,
    }


def format_table(f: dict) -> str:
    m = f["machine"]
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, load {m['load_avg']} -> {f['load_after']}, "
        f"TF {m['tensorflow']}, Keras {m['keras']}, {m['date']}",
        f"{f['model']}, 2 workers, global batch {f['global_batch']}; median [min-max] over "
        f"{f['pairs']} launch(es) x {f['rounds']} rounds of {f['calls']} steps",
        "",
        "| variant | ms/step | exposed comm ms/step | ratio to keras | max weight diff |",
        "|---|---|---|---|---|",
    ]

    def cell(r, fmt):
        return f"{r['median']:{fmt}} [{r['min']:{fmt}}-{r['max']:{fmt}}]"

    for name, row in f["variants"].items():
        if name == "compute":
            lines.append(f"| compute | {cell(row['ms'], '.1f')} | - | - | - |")
            continue
        lines.append(
            f"| {name} | {cell(row['ms'], '.1f')} | {cell(row['exposed_ms'], '.1f')} | "
            f"{cell(row['ratio_to_keras'], '.3f')} | {row['max_weight_diff']:.2e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sb.MODELS, default="resnet")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--packs", default=f"{256 * 1024},{1024 * 1024}")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    packs = [int(p) for p in args.packs.split(",") if p]
    if args.child:
        result = child(args.model, args.rounds, args.calls, args.global_batch, packs)
        if result.pop("chief"):
            print(json.dumps(result), flush=True)
        return 0
    figures = measure(args.model, args.pairs, args.rounds, args.calls, args.global_batch, packs)
    print(format_table(figures))
    if args.json:
        harness.write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
