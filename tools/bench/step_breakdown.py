"""Where a training step's time goes: 2 workers against 2 logical devices in one process.

The job (this file with ``--child``; ``--model mlp``: the MLP of tests/scripts/mw_bench_job.py,
269k parameters in 6 tensors; ``convnet``: the MNIST job's convnet; ``resnet``: a deeper
ResNet-style convnet, 700k parameters in 42 tensors, whose backward pass is long enough to
hide communication behind; global batch 128, SGD) times, under ``tfdist.strategy()``, each
part of a step as its own ``tf.function`` called in a loop (median of rounds, each round
timing every part once, so load drift hits all parts alike):

* ``input``: ``next()`` on the distributed dataset iterator, nothing else;
* ``compute``: input + forward + backward in each replica, no all-reduce, no update;
* ``allreduce``: one all-reduce of tensors shaped like the gradients, nothing else;
* ``step``: input + forward + backward + all-reduce + SGD update (a hand-written step);
* ``fit``: ``model.fit``'s step (Keras's train function, its callbacks and Python loop).
* ``fit_accuracy``: the same with ``metrics=["accuracy"]``, as the tutorials compile:
  the step's loss and accuracy are averaged across workers (in one all-reduce).

``steps_per_execution > 1`` and ``jit_compile=True`` are not columns.
steps_per_execution fails upstream under Mirrored and MultiWorkerMirrored (Keras 3.15.1,
TF 2.21: "You must feed a value for placeholder tensor", keras#19246) and runs with
tfdist's fix ``keras_tf_steps_per_execution_under_strategy``, which still reduces the loss
after every step (docs/scaling.md). jit_compile fails on CPUs under MirroredStrategy on
logical CPUs ("Trying to access resource ... located in device CPU:1 from device CPU:0")
and under MultiWorkerMirroredStrategy ("Collectives are not yet implemented for CPU
devices when compiling with XLA"); tfdist refuses it before the first step.

From them: exposed communication = step - compute (the all-reduce time the step waits
for, i.e. not hidden behind the backward pass), Python/callback overhead = fit - step.
The parent runs the job as ``tfdist launch -n 2`` and with ``TFDIST_CPU_DEVICES=2``,
alternating, and prints both columns side by side, the exposed communication per step, and
(with ``--json``) the figures with the machine: CPU, cores, load average, versions, date.
tools/bench/overlap.py is the experiment that tries to hide it.

    python -m tools.bench.step_breakdown               # 3 alternated pairs, the MLP
    python -m tools.bench.step_breakdown --model resnet --pairs 3 --json breakdown.json
    python -m tools.bench.step_breakdown --quick       # 1 short pair: checks the figures exist
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from tools.bench import harness

REPO = harness.REPO
TIMEOUT_S = 900
PARTS = ("input", "compute", "allreduce", "step", "fit", "fit_accuracy")


MODELS = ("mlp", "convnet", "resnet")


def resnet(keras):
    """A ResNet-style convnet on 28x28x1: 8 residual blocks, 0.70M parameters (2.8 MB).

    Most parameters sit in the last, low-resolution stage (cheap to compute, heavy to
    all-reduce), and the backward pass is long, so the all-reduce of the last layers'
    gradients could run behind the backward of the first ones. No batch normalisation:
    its per-replica statistics would make N replicas differ from one device.
    """
    layers = keras.layers
    x = inputs = keras.Input((28, 28, 1))
    x = layers.Conv2D(16, 3, padding="same", activation="relu")(x)
    for filters, stride in (
        (16, 1),
        (16, 1),
        (32, 2),
        (32, 1),
        (64, 2),
        (64, 1),
        (128, 2),
        (128, 1),
    ):
        skip = x
        x = layers.Conv2D(filters, 3, strides=stride, padding="same", activation="relu")(x)
        x = layers.Conv2D(filters, 3, padding="same")(x)
        if stride != 1 or skip.shape[-1] != filters:
            skip = layers.Conv2D(filters, 1, strides=stride)(skip)
        x = layers.Activation("relu")(layers.Add()([x, skip]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x), name="resnet")


def build_model(keras, name: str = "mlp", learning_rate: float = 0.01, **compile_args):
    """One of ``MODELS`` from seed 0, compiled with plain SGD and logits cross-entropy.

    Example:
        >>> build_model(keras, "resnet").count_params()  # doctest: +SKIP
        699978
    """
    if name not in MODELS:
        raise ValueError(f"step_breakdown: unknown model. Received: name={name!r}; use {MODELS}")
    keras.utils.set_random_seed(0)
    if name == "resnet":
        model = resnet(keras)
    elif name == "convnet":
        from tfdist_examples.recipes import fast_model

        model = fast_model()  # the MNIST job's own convnet
    else:
        model = keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_args,
    )
    return model


def dataset(tf, global_batch: int, model: str = "mlp"):
    """Synthetic MNIST-shaped batches (8 of them, repeated), sharded by DATA across workers."""
    import numpy as np

    shape = (784,) if model == "mlp" else (28, 28, 1)
    rng = np.random.default_rng(0)
    x = rng.random((global_batch * 8, *shape), dtype=np.float32)
    y = rng.integers(0, 10, size=(global_batch * 8,))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .repeat()
        .batch(global_batch)
        .with_options(options)
        .prefetch(2)
    )


def _step_functions(tf, keras, strategy, model, iterator):
    """The hand-written parts, each a tf.function over strategy.run."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum_over_batch_size"
    )
    shapes = [v.shape for v in model.trainable_variables]

    def grads_of(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) / strategy.num_replicas_in_sync
        return tape.gradient(loss, model.trainable_variables)

    def compute(batch):
        return tf.add_n([tf.reduce_sum(g) for g in grads_of(*batch)])

    def step(batch):  # the optimizer all-reduces (sum) and updates, as in fit
        grads = grads_of(*batch)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    def allreduce():
        tensors = [tf.ones(s) for s in shapes]
        out = tf.distribute.get_replica_context().all_reduce("sum", tensors)
        return out[-1][0]

    return {
        "input": tf.function(
            lambda: strategy.run(lambda b: tf.reduce_sum(b[0]), (next(iterator),))
        ),
        "compute": tf.function(lambda: strategy.run(compute, (next(iterator),))),
        "allreduce": tf.function(lambda: strategy.run(allreduce)),
        "step": tf.function(lambda: strategy.run(step, (next(iterator),))),
    }


def time_calls(fn, calls: int) -> float:
    """Milliseconds per call, ``calls`` calls, synchronised at the end."""
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    if out is not None:
        import tensorflow as tf

        tf.nest.map_structure(lambda t: getattr(t, "numpy", lambda: t)(), out)
    return 1000 * (time.perf_counter() - start) / calls


def _fit_ms(keras, model, data, steps: int) -> float:
    """Milliseconds per step of ``model.fit`` (first step excluded)."""
    marks = {}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if "warm" not in marks:
                marks["warm"], marks["first"] = time.perf_counter(), batch
            marks["end"], marks["last"] = time.perf_counter(), batch

    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[Clock()])
    return 1000 * (marks["end"] - marks["warm"]) / (marks["last"] - marks["first"])


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def child(rounds: int, calls: int, global_batch: int, model_name: str = "mlp") -> dict:
    """Runs in each worker (or the one process): every part, ``rounds`` times each."""
    import tfdist

    strategy = tfdist.strategy()
    import keras
    import tensorflow as tf

    data = dataset(tf, global_batch, model_name)
    with strategy.scope():
        model = build_model(keras, model_name)
        with_accuracy = build_model(keras, model_name, metrics=["accuracy"])
    fits = {"fit": model, "fit_accuracy": with_accuracy}
    for m in fits.values():  # warm up; builds the optimizers before the parts use one
        _fit_ms(keras, m, data, min(16, calls + 4))
    iterator = iter(strategy.experimental_distribute_dataset(data))
    parts = _step_functions(tf, keras, strategy, model, iterator)
    for fn in parts.values():  # trace and warm up
        time_calls(fn, 5)
    times = {name: [] for name in PARTS}
    for _ in range(rounds):
        for name, fn in parts.items():
            times[name].append(time_calls(fn, calls))
        for name, m in fits.items():
            times[name].append(_fit_ms(keras, m, data, calls + 8))
    return {
        "replicas": strategy.num_replicas_in_sync,
        "ms": {name: _median(v) for name, v in times.items()},
        "chief": tfdist.is_chief(),
    }


def _run(where: str, child_args: list[str]) -> dict:
    me = ["-m", __spec__.name, "--child", *child_args]
    if where == "workers":
        cmd, env = [sys.executable, "-m", "tfdist", "launch", "-n", "2", *me], harness.child_env()
    else:
        cmd, env = [sys.executable, *me], harness.child_env(TFDIST_CPU_DEVICES="2")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    for line in reversed(proc.stdout.splitlines()):
        start = line.find("{")
        if start >= 0 and line[:start].strip() in ("", "[w0]"):
            return json.loads(line[start:])
    raise RuntimeError(
        f"step_breakdown: {where} run exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    )


def measure(
    pairs: int = 3,
    rounds: int = 3,
    calls: int = 40,
    global_batch: int = 128,
    model: str = "mlp",
) -> dict:
    """Medians over ``pairs`` alternated runs of each column (workers, devices).

    Example:
        >>> measure(pairs=1, model="resnet")["exposed_comm_ms"]["workers"]  # doctest: +SKIP
        9.8
    """
    if model not in MODELS or min(pairs, rounds, calls) < 1:
        raise ValueError(
            f"step_breakdown: model must be one of {MODELS} and pairs, rounds, calls >= 1. "
            f"Received: model={model!r}, pairs={pairs}, rounds={rounds}, calls={calls}"
        )
    args = ["--rounds", str(rounds), "--calls", str(calls), "--global-batch", str(global_batch)]
    args += ["--model", model]
    before = harness.machine()
    runs = {"workers": [], "devices": []}
    for i in range(pairs):
        for where in harness.in_turn(("workers", "devices"), i):
            runs[where].append(_run(where, args)["ms"])
    out = {}
    for where, results in runs.items():
        out[where] = {p: _median([r[p] for r in results]) for p in PARTS}
        out[where + "_range"] = {
            p: [min(v), max(v)] if (v := [r[p] for r in results if r[p] is not None]) else None
            for p in PARTS
        }
    out.update(pairs=pairs, rounds=rounds, calls=calls, global_batch=global_batch, model=model)
    out.update(machine=before, load_after=harness.machine()["load_avg"])
    # The communication a step waits for: the step minus its forward + backward.
    out["exposed_comm_ms"] = {w: derived(out[w])["exposed_allreduce"] for w in runs}
    return out


def derived(ms: dict) -> dict:
    """The step explained: compute, exposed all-reduce, Python/callback overhead."""
    return {
        "input": ms["input"],
        "compute_without_input": ms["compute"] - ms["input"],
        "exposed_allreduce": ms["step"] - ms["compute"],
        "python_callbacks": ms["fit"] - ms["step"],
        "fit": ms["fit"],
        "metrics": ms["fit_accuracy"] - ms["fit"],
    }


def format_table(f: dict) -> str:
    w, d = f["workers"], f["devices"]
    lines = [
        f"per step, ms (median of {f['pairs']} alternated run(s) x {f['rounds']} rounds of "
        f"{f['calls']} calls; global batch {f['global_batch']})",
        "",
        "| part | 2 workers | 2 devices, 1 process | ratio |",
        "|---|---|---|---|",
    ]
    for name in PARTS:
        if w[name] is None or d[name] is None:
            cells = [f"{v:.2f}" if v is not None else "fails" for v in (w[name], d[name])]
            lines.append(f"| {name} | {cells[0]} | {cells[1]} | - |")
            continue
        lines.append(f"| {name} | {w[name]:.2f} | {d[name]:.2f} | {w[name] / d[name]:.2f} |")
    dw, dd = derived(w), derived(d)
    lines += ["", "| derived | 2 workers | 2 devices | difference |", "|---|---|---|---|"]
    for name in dw:
        lines.append(f"| {name} | {dw[name]:.2f} | {dd[name]:.2f} | {dw[name] - dd[name]:+.2f} |")
    lines.append(
        f"\nexposed communication (step - compute), ms/step: 2 workers "
        f"{dw['exposed_allreduce']:.2f}, 2 devices {dd['exposed_allreduce']:.2f}"
    )
    if "machine" in f:  # measure()'s figures; hand-made ones in tests may leave it out
        m = f["machine"]
        lines.insert(
            0,
            f"machine: {m['cpu']}, {m['cores']} cores, load {m['load_avg']} -> "
            f"{f['load_after']}, TF {m['tensorflow']}, Keras {m['keras']}, {m['date']}; "
            f"model {f['model']}",
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--quick", action="store_true", help="1 pair, 1 round of 4 calls")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.rounds, args.calls, args.global_batch, args.model)
        if result.pop("chief"):
            print(json.dumps(result), flush=True)
        return 0
    if args.quick:  # one short pair: shows the figures are computed, not what they are
        args.pairs, args.rounds, args.calls = 1, 1, 4
    figures = measure(args.pairs, args.rounds, args.calls, args.global_batch, args.model)
    print(format_table(figures))
    if args.json:
        harness.write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
