"""The first step of each epoch against the median step, on 1 and 2 logical CPU devices.

Each topology trains the guides' small convnet on MNIST with ``tfdist.data.pipeline`` in a
fresh process, one ``fit`` call of several epochs (as users write it), and records per
epoch: the first step's time (from ``on_epoch_begin`` to the first ``on_train_batch_end``),
the median step, how many distributed iterators Keras created and how long creating them
took, and the time Python's full garbage collections took. ``--load N`` runs N busy loops
beside the job (a machine that is also doing other work).

    python -m tools.bench.epoch_start --epochs 6 --load 2 --json tools/results/epoch_start_measured.json

Each topology runs with tfdist's fix ``tf_multi_device_iterators_end_promptly`` and
without it (``upstream``), alternated in the same run.

What it showed (docs/benchmarks.md renders the file): Keras creates two iterators per epoch
when ``steps_per_epoch`` is not given (``EpochIterator._enumerate_iterator`` makes one at the
end of each epoch and discards it at the next epoch's start), and under ``MirroredStrategy``
each one is a ``MultiDeviceIterator`` whose construction traces a dozen ``tf.function``s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

from tools.bench.harness import in_turn, machine, write_json

RESULT = "EPOCH_START "


def job(epochs: int) -> dict:
    """Runs in the measured process (``TFDIST_CPU_DEVICES`` set): per-epoch figures."""
    import gc

    import keras
    import tensorflow as tf
    from tensorflow.python.distribute import input_lib

    import tfdist
    from tfdist_examples.recipes import tutorial_model

    iterators: list[float] = []
    depth = [0]

    def timed(original):  # counts and times the iterators Keras creates (not nested ones)
        def __iter__(self):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return original(self)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    iterators.append(time.perf_counter() - start)

        return __iter__

    for owner in (input_lib.DistributedDataset, tf.data.Dataset):
        owner.__iter__ = timed(owner.__iter__)
    collections: list[float] = []
    started = [0.0]

    def on_gc(phase, info):
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                collections.append(time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)
    train = tfdist.data.pipeline(
        tfdist.data.mnist("train[:25%]"), 64, map_fn=tfdist.data.scale, seed=0
    )
    with tfdist.scope():
        model = tutorial_model()
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    epochs_out: list[dict] = []

    class Steps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.steps, self.last = [], time.perf_counter()
            self.iterators, self.collections = len(iterators), len(collections)

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            self.steps.append(now - self.last)
            self.last = now

        def on_epoch_end(self, epoch, logs=None):
            made = iterators[self.iterators :]
            epochs_out.append(
                {
                    "first_s": self.steps[0],
                    "median_s": statistics.median(self.steps[1:]),
                    "steps": len(self.steps),
                    "iterators": len(made),
                    "iterator_s": sum(made),
                    "gc_s": sum(collections[self.collections :]),
                }
            )

    model.fit(train, epochs=epochs, verbose=0, callbacks=[Steps()])
    replicas = tfdist.strategy().num_replicas_in_sync
    return {"replicas": replicas, "epochs": epochs_out}


def _busy(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


# The fix this tool measures (tfdist.compat.epoch_start); "upstream" runs exclude it.
FIX = "tf_multi_device_iterators_end_promptly"
VARIANTS = {"tfdist": "", "upstream": FIX}


def run_topology(
    devices: int, epochs: int, load: int, timeout: float = 900, exclude: str = ""
) -> dict:
    """One measured process on ``devices`` logical devices, ``load`` busy loops beside it;
    ``exclude``: tfdist fixes switched off (``TFDIST_COMPAT_EXCLUDE``)."""
    env = dict(os.environ, TFDIST_CPU_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2")
    env["TFDIST_COMPAT_EXCLUDE"] = exclude
    code = (
        "import json, sys; from tools.bench import epoch_start as b; "
        f"print({RESULT!r} + json.dumps(b.job({epochs})))"
    )
    busy = [
        multiprocessing.Process(target=_busy, args=(time.time() + timeout,), daemon=True)
        for _ in range(load)
    ]
    for process in busy:
        process.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
    finally:
        for process in busy:
            process.kill()
            process.join(timeout=10)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
    if line is None:
        raise RuntimeError(f"epoch-start job on {devices} device(s) failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len(RESULT) :])


def measure(epochs: int = 6, load: int = 0, rounds: int = 1) -> dict:
    """Both topologies, with tfdist's fix and without it (upstream), alternated in one run
    (``rounds`` times each); epoch 0 (tracing) is reported apart."""
    rows: dict[str, dict] = {}
    for round_index in range(rounds):
        for devices in (1, 2):
            order = in_turn(list(VARIANTS.items()), round_index)  # neither side always second
            for variant, exclude in order:
                result = run_topology(devices, epochs, load, exclude=exclude)
                later = result["epochs"][1:]
                row = rows.setdefault(
                    f"{devices} {variant}",
                    {
                        "devices": devices,
                        "variant": variant,
                        "replicas": result["replicas"],
                        "epochs": [],
                        "first_over_median": [],
                        "first_s": [],
                        "iterators_per_epoch": [],
                        "iterator_s": [],
                    },
                )
                row["epochs"] += result["epochs"]
                row["first_over_median"] += [e["first_s"] / e["median_s"] for e in later]
                row["first_s"] += [e["first_s"] for e in later]
                row["iterators_per_epoch"] += [e["iterators"] for e in later]
                row["iterator_s"] += [e["iterator_s"] for e in later]
    return {
        "machine": machine(),
        "load": load,
        "loadavg_1min": os.getloadavg()[0],  # what else the machine was doing
        "epochs": epochs,
        "rounds": rounds,
        "topologies": rows,
    }


def report(payload: dict) -> str:
    """The lines docs/benchmarks.md shows (tools/docs/figures.py renders them)."""
    lines = [
        f"{payload['epochs']} epochs of the guides' convnet on MNIST train[:25%], one fit "
        f"call per process, {payload.get('rounds', 1)} process(es) per line, alternated; "
        f"{payload['load']} busy loop(s) beside it (1-minute mean of runnable processes at the end: "
        f"{payload['loadavg_1min']:.1f} on {payload['machine']['cores']} cores); epochs after "
        f"the first; `tfdist` with the fix `{FIX}`, `upstream` without it:"
    ]
    for row in payload["topologies"].values():
        ratios, made, cost = row["first_over_median"], row["iterators_per_epoch"], row["iterator_s"]
        firsts = row["first_s"]
        lines.append(
            f"{row['devices']} device(s), {row['variant']}: first step / median step "
            f"{statistics.median(ratios):.3g} ({min(ratios):.3g}-{max(ratios):.3g}, "
            f"n={len(ratios)}), longest first step {max(firsts):.2f} s; "
            f"{min(made)}-{max(made)} iterators created per epoch, "
            f"{min(cost):.2f}-{max(cost):.2f} s creating them"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--load", type=int, default=0, help="busy loops beside the job")
    parser.add_argument("--rounds", type=int, default=1, help="processes per line")
    parser.add_argument("--json", help="write the figures (with machine and date) here")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error(f"--epochs must be at least 2 (epoch 0 traces); received {args.epochs}")
    if args.load < 0:
        parser.error(f"--load must be 0 or more busy loops; received {args.load}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; received {args.rounds}")
    payload = measure(args.epochs, args.load, args.rounds)
    print(report(payload))
    if args.json:
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
