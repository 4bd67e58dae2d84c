"""Sharded, asynchronous checkpoints against archives, on JAX (one process, 4 CPU devices).

* ``stall``: time per training step of a ``fit`` checkpointed every ``--every`` steps,
  against the same ``fit`` without checkpoints: sharded (``checkpoint(..., sharded=True)``,
  written in the background) and archive (``.keras``, gathered, staged, fsynced, renamed,
  training waits). The three sides alternate, ``--rounds`` times; medians.
* ``save call``: how long training waits inside each save (the rest of a sharded save runs
  in a background thread, which on a machine with few cores competes with training).
* ``host memory``: the peak resident memory above the steady state of training while
  those fits run (sampled every millisecond), as a fraction of the model's state (weights +
  Adam slots). With one process every shard is this process's, so this says what a save
  costs on top of training, not the per-process split of a multi-process job.
* ``--processes 2``: the same fits in each process of ``tfdist launch -n 2`` (2 devices
  each, the 1x4 mesh across both): every process's peak resident memory above training
  while it saves sharded checkpoints, as a fraction of the whole model's state. Archives
  cannot be written there (the sharded kernels span both processes).
* ``restore``: ``make_or_restore`` of the newest sharded checkpoint against
  ``keras.models.load_model`` of an archive of the same model.
* ``--idle-core``: the stall again in a process whose training is confined to CPU 0
  (``os.sched_setaffinity`` before jax starts, so its threads inherit it) while the
  writer's threads (tensorstore's pool, Orbax's Python threads) are moved to CPU 1 as they
  appear: a machine with a core training leaves idle, emulated on 2 cores. Orbax's threads
  still take the interpreter lock from training's.

The model: an MLP whose first kernels are sharded over the ``model`` axis of a 1x4 mesh,
about ``--mb`` MB of weights and optimizer state. Writes ``tools/results/sharded_measured.json``
(machine, versions, date, figures) with ``--json``.

    python -m tools.bench.sharded --rounds 5 --mb 60 --every 10 --processes 2 \
        --idle-core --json tools/results/sharded_measured.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from tools.bench import harness

REPO = harness.REPO
GLOBAL_BATCH = 64
STEPS = 40  # per measured fit (after one warm-up fit of each kind)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRSS:
    """The highest resident memory seen while it runs (a sampling thread)."""

    def __enter__(self):
        self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _layout_map(width_sharded: bool = True):
    from keras import distribution as kd

    # 1x4: the "model" axis runs over every device, so that with 2 processes each holds
    # half of every sharded kernel (Keras feeds each process the whole global batch).
    mesh = kd.DeviceMesh((1, 4), ["batch", "model"], devices=kd.list_devices())
    layouts = kd.LayoutMap(mesh)
    if width_sharded:
        layouts[".*hidden_.*kernel"] = (None, "model")
    return layouts


def _width_for(megabytes: float) -> int:
    # Three width x width kernels dominate; Adam keeps two slots: 3 x 4 bytes per weight.
    return int((megabytes * 2**20 / (3 * 4 * 3)) ** 0.5) // 4 * 4


def _builder(width: int):
    def build():
        import keras

        keras.utils.set_random_seed(0)
        layers = [keras.Input((width,))]
        layers += [
            keras.layers.Dense(width, activation="relu", name=f"hidden_{i}") for i in range(3)
        ]
        model = keras.Sequential([*layers, keras.layers.Dense(10, name="logits")])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
        return model

    return build


def _state_mb(model) -> float:
    return (
        sum(int(np.prod(v.shape)) * 4 for v in [*model.weights, *model.optimizer.variables]) / 2**20
    )


def _setup(megabytes: float):
    """(model on a 1x4 mesh, its training pipeline, width) for about ``megabytes`` of state."""
    import tfdist

    width = _width_for(megabytes)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, width)).astype("float32")
    y = rng.integers(0, 10, len(x))
    train = tfdist.data.pipeline((x, y), global_batch=GLOBAL_BATCH, seed=0)
    with tfdist.scope(layout_map=_layout_map()):
        model = _builder(width)()
    return model, train, width


class WriterPinner:
    """Moves the checkpoint writer's threads to ``cpu`` every 5 ms while it runs (the
    ``--idle-core`` emulation): tensorstore's pool and every Python thread but this
    process's main one."""

    def __init__(self, cpu: int):
        self.cpu = cpu

    def __enter__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self):
        os.sched_setaffinity(0, {self.cpu})  # this thread too
        while not self._stop.wait(0.005):
            self.pin()

    def pin(self):
        main = threading.main_thread().native_id
        tids = {t.native_id for t in threading.enumerate() if t.native_id not in (main, None)}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == "ts_pool_worker":
                        tids.add(int(tid))
            except OSError:
                continue
        for tid in tids:
            try:
                if os.sched_getaffinity(tid) != {self.cpu}:
                    os.sched_setaffinity(tid, {self.cpu})
            except OSError:  # ended meanwhile
                continue

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _fit_once(model, train, kind: str, directory: str, every: int) -> tuple[float, float, float]:
    """One epoch of ``STEPS`` steps checkpointed as ``kind`` ("none", "sharded", "archive"):
    (seconds per step after the first 5, peak resident MB above the start, median seconds
    training waited in a save call)."""
    import keras

    import tfdist

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:  # after the first steps (and the first save's one-off costs)
                self.start = time.perf_counter()

        def on_train_end(self, logs=None):
            self.end = time.perf_counter()

    callbacks = [Clock()]
    blocked = []
    if kind != "none":
        saver = tfdist.callbacks.checkpoint(
            directory, save_freq=every, max_to_keep=2, sharded=kind == "sharded"
        )
        save = saver._save  # timed: how long training waits in each save call

        def timed(*args, **kwargs):
            started = time.perf_counter()
            save(*args, **kwargs)
            blocked.append(time.perf_counter() - started)

        saver._save = timed
        callbacks.append(saver)
    baseline = _rss_mb()
    with PeakRSS() as rss:
        model.fit(train, epochs=1, verbose=0, callbacks=callbacks)
    clock = callbacks[0]
    waited = statistics.median(blocked) if blocked else 0.0
    return (clock.end - clock.start) / (STEPS - 5), rss.peak - baseline, waited


def measure(rounds: int = 3, megabytes: float = 60.0, every: int = 5) -> dict:
    """Step time, save-call wait, peak memory and restore time in this process."""
    model, train, width = _setup(megabytes)
    root = tempfile.mkdtemp(prefix="bench-sharded-")

    def run(kind: str) -> tuple[float, float, float]:
        return _fit_once(model, train, kind, os.path.join(root, kind), every)

    kinds = ["none", "sharded", "archive"]
    for kind in kinds:  # warm-up: compilation, first saves
        run(kind)
    state_mb = _state_mb(model)  # the optimizer's slots exist now
    times = {k: [] for k in kinds}
    memory = {k: [] for k in kinds}
    waits = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind in kinds:
            seconds, extra, waited = run(kind)
            times[kind].append(seconds)
            memory[kind].append(extra)
            waits[kind].append(waited)
    step = {k: statistics.median(v) for k, v in times.items()}

    restore, load = _restore_vs_load(model, width, root, rounds)
    shutil.rmtree(root)
    return {
        "state_mb": round(state_mb, 1),
        "every_steps": every,
        "rounds": rounds,
        "step_ms": {k: round(v * 1000, 2) for k, v in step.items()},
        "stall_sharded": round(step["sharded"] / step["none"], 3),
        "stall_archive": round(step["archive"] / step["none"], 3),
        "save_call_ms": {k: round(statistics.median(v) * 1000, 1) for k, v in waits.items()},
        "peak_extra_mb": {k: round(max(v), 1) for k, v in memory.items()},
        "peak_extra_fraction": {
            k: round(max(v) / state_mb, 3) for k, v in memory.items() if k != "none"
        },
        "restore_s": round(statistics.median(restore), 3),
        "load_model_s": round(statistics.median(load), 3),
        "restore_vs_load_model": round(statistics.median(restore) / statistics.median(load), 3),
    }


def measure_idle_core(rounds: int, megabytes: float, every: int) -> dict:
    """The stall with training on CPU 0 and the writer on CPU 1 (this process must have
    pinned itself before jax started: ``--idle-core-worker``)."""
    model, train, _width = _setup(megabytes)
    root = tempfile.mkdtemp(prefix="bench-sharded-idle-")
    kinds = ["none", "sharded"]
    times = {k: [] for k in kinds}
    waits = []
    for repeat in range(rounds + 1):  # the first round is a warm-up
        for kind in kinds:
            with WriterPinner(1):  # in both: the memory sampler's thread moves too
                seconds, _, waited = _fit_once(model, train, kind, os.path.join(root, kind), every)
            if repeat:
                times[kind].append(seconds)
                if kind == "sharded":
                    waits.append(waited)
    shutil.rmtree(root)
    step = {k: statistics.median(v) for k, v in times.items()}
    return {
        "step_ms": {k: round(v * 1000, 2) for k, v in step.items()},
        "stall_sharded": round(step["sharded"] / step["none"], 3),
        "save_call_ms": round(statistics.median(waits) * 1000, 1),
    }


def run_idle_core(rounds: int, megabytes: float, every: int) -> dict:
    """``measure_idle_core`` in a fresh process pinned to CPU 0 before jax starts."""
    import subprocess

    if len(os.sched_getaffinity(0)) < 2:
        raise RuntimeError("bench_sharded: --idle-core needs 2 CPUs (training on 0, writer on 1)")
    command = [
        sys.executable, "-m", __spec__.name, "--idle-core-worker",
        "--rounds", str(rounds), "--mb", str(megabytes), "--every", str(every),
    ]  # fmt: skip
    proc = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=900, check=False
    )
    rows = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(
            f"bench_sharded: the --idle-core run failed (exit {proc.returncode}): "
            f"{proc.stderr[-2000:]}"
        )
    return json.loads(rows[-1])


def _restore_vs_load(model, width: int, root: str, rounds: int) -> tuple[list, list]:
    """Seconds of make_or_restore of the sharded checkpoint in ``root``, and of
    keras.models.load_model of an archive of ``model``, ``rounds`` times each."""
    import keras

    import tfdist

    archive = os.path.join(root, "model.keras")
    model.save(archive)
    restore, load = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        with tfdist.scope(layout_map=_layout_map()):
            restored, _epoch = tfdist.make_or_restore(
                _builder(width), os.path.join(root, "sharded")
            )
        restore.append(time.perf_counter() - started)
        assert tfdist.resume_state(restored) is not None
        started = time.perf_counter()
        with tfdist.scope(layout_map=_layout_map()):
            keras.models.load_model(archive)
        load.append(time.perf_counter() - started)
    return restore, load


def _local_mb(model) -> float:
    """MB of distinct state this process holds (its shards; a replicated array once)."""
    total = 0
    for variable in [*model.weights, *model.optimizer.variables]:
        seen = {}
        for shard in variable.value.addressable_shards:
            seen[repr(shard.index)] = shard.data.nbytes
        total += sum(seen.values())
    return total / 2**20


def memory_worker(rounds: int, megabytes: float, every: int, directory: str) -> dict:
    """One process of a launched job: its peak resident memory above training while it
    saves sharded and archive checkpoints, and the state it holds."""
    import jax

    model, train, _width = _setup(megabytes)
    # Archives are refused here: the sharded kernels span both processes, and Keras's save
    # fetches every variable whole (tfdist says so at train begin).
    kinds = ["none", "sharded"]
    peaks = {kind: [] for kind in kinds}
    for repeat in range(rounds + 1):  # the first round is a warm-up
        for kind in kinds:
            _, extra, _ = _fit_once(model, train, kind, os.path.join(directory, kind), every)
            if repeat:
                peaks[kind].append(extra)
    return {
        "rank": jax.process_index(),
        "state_mb": round(_state_mb(model), 1),
        "local_mb": round(_local_mb(model), 1),
        "peak_extra_mb": {kind: round(max(values), 1) for kind, values in peaks.items()},
    }


def measure_processes(processes: int, rounds: int, megabytes: float, every: int) -> dict:
    """``memory_worker`` in each process of ``tfdist launch -n processes`` (2 devices each)."""
    import subprocess

    directory = tempfile.mkdtemp(prefix="bench-sharded-mp-")
    command = [
        sys.executable, "-m", "tfdist", "launch", "-n", str(processes),
        "--devices-per-worker", str(4 // processes), "-m", __spec__.name,
        "--memory-worker", directory, "--rounds", str(rounds), "--mb", str(megabytes),
        "--every", str(every),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TFDIST_CPU_DEVICES"}
    try:
        proc = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    rows = []
    for line in proc.stdout.splitlines():
        text = line.partition(" ")[2]
        if text.startswith("{") and "peak_extra_mb" in text:
            rows.append(json.loads(text))
    if proc.returncode != 0 or len(rows) != processes:
        raise RuntimeError(
            f"bench_sharded: the {processes}-process run failed (exit {proc.returncode}): "
            f"{proc.stderr[-2000:]}"
        )
    rows.sort(key=lambda row: row["rank"])
    state = rows[0]["state_mb"]
    return {
        "processes": processes,
        "per_process": rows,
        "peak_extra_fraction": {
            "sharded": round(max(row["peak_extra_mb"]["sharded"] for row in rows) / state, 3)
        },
    }


def report(result: dict) -> str:
    """The figures of ``result`` (what ``--json`` writes), one line each."""
    m, f = result["machine"], result["figures"]
    return "\n".join(
        [
            f"machine: {m['cpu']}, {m['cores']} cores; python {m['python']}, jax {m['jax']}, "
            f"keras {m['keras']}, orbax-checkpoint {m['orbax-checkpoint']}; {m['date']}",
            f"model state {f['state_mb']} MB on a 1x4 mesh, a checkpoint every "
            f"{f['every_steps']} steps, medians of {f['rounds']} rounds",
            f"step time (ms): none {f['step_ms']['none']}, sharded {f['step_ms']['sharded']}, "
            f"archive {f['step_ms']['archive']}",
            f"save stall (step time / without checkpoints): sharded {f['stall_sharded']}x, "
            f"archive {f['stall_archive']}x (goal <= 1.1)",
            f"training waits in each save call (ms): sharded {f['save_call_ms']['sharded']}, "
            f"archive {f['save_call_ms']['archive']}",
            f"peak host memory above training (fraction of the state): sharded "
            f"{f['peak_extra_fraction']['sharded']}, archive {f['peak_extra_fraction']['archive']}",
            f"restore: make_or_restore (sharded) {f['restore_s']} s vs keras.models.load_model "
            f"{f['load_model_s']} s = {f['restore_vs_load_model']}x (goal <= 1.3)",
            *_processes_lines(f.get("processes")),
            *_idle_core_lines(f.get("idle_core")),
        ]
    )


def _idle_core_lines(figures: dict | None) -> list[str]:
    if not figures:
        return []
    return [
        f"an idle core emulated (training confined to CPU 0, the writer's threads on CPU 1): "
        f"step time (ms) none {figures['step_ms']['none']}, sharded "
        f"{figures['step_ms']['sharded']}; save stall {figures['stall_sharded']}x; training "
        f"waits {figures['save_call_ms']} ms in each save call"
    ]


def _processes_lines(figures: dict | None) -> list[str]:
    if not figures:
        return []
    rows = figures["per_process"]
    held = ", ".join(f"{row['local_mb']}" for row in rows)
    fraction = figures["peak_extra_fraction"]
    return [
        f"{figures['processes']} processes x 2 devices, the same model and mesh: each holds "
        f"{held} MB of the {rows[0]['state_mb']} MB state; peak host memory above training "
        f"in the worst process while saving sharded checkpoints, as a fraction of the whole "
        f"state: {fraction['sharded']} (goal <= 0.5); archives are refused there (a variable "
        "spanning processes cannot be fetched whole)"
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=float, default=60.0, help="weights + optimizer state")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--json", help="write machine and figures to this file")
    parser.add_argument(
        "--processes", type=int, default=0, help="also measure memory per process with N (2)"
    )
    parser.add_argument(
        "--idle-core", action="store_true", help="also the stall with training on CPU 0 only"
    )
    parser.add_argument("--memory-worker", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--idle-core-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported (in measure)
    if args.idle_core_worker:
        os.sched_setaffinity(0, {0})  # before jax: its threads inherit CPU 0
        os.environ.setdefault("TFDIST_CPU_DEVICES", "4")
        print(json.dumps(measure_idle_core(args.rounds, args.mb, args.every)), flush=True)
        return 0
    if args.memory_worker:
        row = memory_worker(args.rounds, args.mb, args.every, args.memory_worker)
        print(json.dumps(row), flush=True)
        return 0
    if args.processes:  # first: it starts its own processes, before this one holds devices
        processes = measure_processes(args.processes, args.rounds, args.mb, args.every)
    os.environ.setdefault("TFDIST_CPU_DEVICES", "4")
    result = {
        "machine": harness.machine("orbax-checkpoint"),
        "figures": measure(args.rounds, args.mb, args.every),
    }
    if args.processes:
        result["figures"]["processes"] = processes
    if args.idle_core:
        result["figures"]["idle_core"] = run_idle_core(args.rounds, args.mb, args.every)
    print(report(result))
    if args.json:
        harness.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
