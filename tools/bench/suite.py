"""One benchmark suite: tfdist against raw TensorFlow, measured side by side.

Each comparison runs A and B alternately in the same process run (A B A B ...) after a
warm-up, so the noise of a shared machine hits both alike, and reports the median ratio
with its min/max. It prints one table, with the machine on top.

    python -m tools.bench                 # full run (tens of minutes on 2 cores)
    python -m tools.bench --quick         # < 3 minutes: fewer pairs, data subsets
    python -m tools.bench --only pipeline --json figures.json
    python -m tools.bench --scaling       # 1/2/4 workers x 1/2 devices, both backends

The test suite checks every row's reporting on sample figures and runs two rows with
``--quick`` end to end; no test asserts on a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tools.bench import harness
from tools.bench.harness import REPO, alternate, machine, machine_line, timed, write_json


@dataclass(frozen=True)
class Comparison:
    """One row of the table.

    ``run(quick, pairs)`` does the measuring (alternating A and B itself, since some
    comparisons need processes or shared state) and returns a ``Result``.
    """

    name: str
    a: str
    b: str
    goal: str
    run: Callable[[bool, int], Result]


@dataclass
class Result:
    """Figures of one comparison. ``ratios`` holds one A/B ratio per pair."""

    ratios: list[float]
    unit: str = "ratio"
    met: bool | None = None
    a_values: list[float] = field(default_factory=list)
    b_values: list[float] = field(default_factory=list)
    value_unit: str = "s"
    notes: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)


def _cli_row(quick: bool, pairs: int) -> Result:
    """``tfdist --help`` against ``python -c pass``: the CLI must not import TensorFlow."""
    import subprocess

    def run(cmd):
        return lambda: timed(
            lambda: subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        )

    a, b = alternate(
        run([sys.executable, "-m", "tfdist", "--help"]),
        run([sys.executable, "-c", "pass"]),
        max(pairs, 5),
    )
    rs = harness.ratios(a, b)
    med = statistics.median(rs)
    return Result(
        rs,
        met=med < 5,
        a_values=a,
        b_values=b,
        notes=f"tfdist --help {statistics.median(a) * 1000:.0f} ms, python -c pass "
        f"{statistics.median(b) * 1000:.0f} ms",
    )


# --- rows measured in a fresh process each (TensorFlow fixes its devices per process) ---
#
# Each row is two functions: ``figures(quick, pairs)`` measures (the per-issue module
# beside this file) and returns its dict; ``result(figures, quick)`` turns that dict into
# the row's Result. The child process runs both; tests/project/test_benchmark.py checks every
# ``result`` on sample figures without measuring (the measuring takes minutes).


# Rows whose one measurement lasts about a second (a process start, one save) record, per
# pair, the median of REPEATS alternated pairs: one scheduler hiccup then moves the
# median of three, not the pair itself.
REPEATS = 3


def _grouped(values: list[float], size: int) -> list[float]:
    """Medians of consecutive groups of ``size`` values (one per recorded pair).

    Example:
        >>> _grouped([1.0, 5.0, 2.0, 3.0, 3.0, 9.0], 3)
        [2.0, 3.0]
    """
    if size < 1 or len(values) % size:
        raise ValueError(
            f"_grouped: {len(values)} values do not split into groups of {size}. Received: "
            f"size={size}. Measure a multiple of size values."
        )
    return [statistics.median(values[i : i + size]) for i in range(0, len(values), size)]


def _figures_overhead(quick: bool, pairs: int) -> dict:
    from tools.bench import overhead as bench_overhead

    # A quarter of MNIST per epoch (seconds per side), REPEATS alternated pairs per
    # recorded pair: on a shared machine one side's whole-MNIST epoch took from 21 to 82 s
    # in one run; shorter alternated epochs put such a stretch on both sides of a pair.
    repeats = 1 if quick else REPEATS
    f = bench_overhead.measure(
        pairs=pairs * repeats, split="train[:10%]" if quick else "train[:25%]"
    )
    return {**f, "repeats": repeats}


def _result_overhead(f: dict, quick: bool) -> Result:
    repeats = f.get("repeats", 1)
    ratios = _grouped(f["ratios"], repeats)
    return Result(
        ratios,
        met=statistics.median(ratios) <= 1.01,
        a_values=f["a_epoch_s"],
        b_values=f["b_epoch_s"],
        notes=f"epoch time on {f['replicas']} replicas, {f['steps_per_epoch']} steps "
        f"(A {statistics.median(f['a_epoch_s']):.2f} s, B {statistics.median(f['b_epoch_s']):.2f} s); "
        f"each ratio the median of {repeats} alternated pair(s)",
    )


PIPELINE_EPOCHS = 10  # each run reads MNIST 10 times: seconds for the fast side, not ~1 s


def _figures_pipeline(quick: bool, pairs: int) -> dict:
    from tools.bench import pipeline as bench_pipeline

    return bench_pipeline.throughput(rounds=pairs, epochs=1 if quick else PIPELINE_EPOCHS)


def _result_pipeline(f: dict, quick: bool) -> Result:
    ratios = harness.ratios(
        f["naive_wall_s"], f["pipeline_wall_s"]
    )  # = throughput A / throughput B
    return Result(
        ratios,
        unit="throughput ratio",
        met=statistics.median(ratios) >= 7,
        a_values=f["pipeline_wall_s"],
        b_values=f["naive_wall_s"],
        notes=f"examples/s over {f['epochs']} epoch(s): pipeline "
        f"{f['pipeline_examples_per_s']}, naive {f['naive_examples_per_s']}; ratio is "
        "throughput A / throughput B",
    )


def _figures_input_bound(quick: bool, pairs: int) -> dict:
    from tools.bench import pipeline as bench_pipeline

    return bench_pipeline.input_bound(
        rounds=1 if quick else pairs, split="train[:20%]" if quick else "train"
    )


def _result_input_bound(f: dict, quick: bool) -> Result:
    return Result(
        [f["input_bound_ratio"]],
        met=f["input_bound_ratio"] <= 1.05,
        a_values=[f["pipeline_step_ms"]],
        b_values=[f["in_memory_step_ms"]],
        value_unit="ms/step",
        notes=f"median step {f['pipeline_step_ms']} ms vs {f['in_memory_step_ms']} ms "
        f"over {f['rounds']} alternated epoch(s) each; CPU-time ratio "
        f"{f['input_bound_ratio_cpu']}",
    )


def _figures_time_to_accuracy(quick: bool, pairs: int) -> dict:
    from tools.bench import recipes as bench_recipes

    return bench_recipes.benchmark(quick=quick, seeds=list(range(1 if quick else pairs)))


def _result_time_to_accuracy(f: dict, quick: bool) -> Result:
    summary = f["summary"]
    fast, tutorial = summary["recipes"]["fast"], summary["recipes"]["tutorial"]
    ratios = summary["ratios_by_round"]
    reaches = fast["all_reach_0.99"]
    return Result(
        ratios,
        met=None if quick else (statistics.median(ratios) < 1 and reaches),
        a_values=fast["train_s"],
        b_values=tutorial["train_s"],
        notes=f"test accuracy fast {fast['test_accuracy']} vs tutorial "
        f"{tutorial['test_accuracy']}; fit time only, each run a fresh process"
        + (" (quick: 2048 examples, 1 epoch: no accuracy goal)" if quick else ""),
    )


def _figures_restart(quick: bool, pairs: int) -> dict:
    from tools.bench import restart as bench_restart

    return bench_restart.run(quick=True) if quick else bench_restart.measure(rounds=pairs)


def _result_restart(f: dict, quick: bool) -> Result:
    ratios = harness.ratios(f["resumed_to_first_step_s"], f["fresh_to_first_step_s"])
    work_ok = f["batches_applied_twice"] == 0 and f["steps_recomputed_goal_met"]
    return Result(
        ratios,
        met=statistics.median(ratios) <= 1.2 and work_ok,
        a_values=f["resumed_to_first_step_s"],
        b_values=f["fresh_to_first_step_s"],
        notes=f"after kill -9 at step {f['killed_after_step']} (save_freq "
        f"{f['save_freq']}): {f['steps_recomputed']} step(s) recomputed, "
        f"{f['batches_applied_twice']} batch(es) applied twice, {f['batches_skipped']} "
        f"skipped; restore + first step adds {f['restart_extra_s']} s in-process",
    )


def _figures_launcher(quick: bool, pairs: int) -> dict:
    from tools.bench import launcher as bench_launcher

    f = bench_launcher.startup(pairs=pairs * (1 if quick else REPEATS))
    return {**f, "repeats": 1 if quick else REPEATS}


def _result_launcher(f: dict, quick: bool) -> Result:
    repeats = f.get("repeats", 1)
    return Result(
        _grouped(f["ratios"], repeats),
        met=f["ratio_median"] <= 1.1,
        a_values=f["a"],
        b_values=f["b"],
        notes=f"launch to first step: {f['a_median']:.2f} s vs {f['b_median']:.2f} s; each "
        f"ratio the median of {repeats} alternated pair(s)",
    )


# compile(steps_per_execution=K) of the "-k8" rows: one host round-trip per K steps.
EXECUTION_STEPS = 8
MULTI_WORKER_STEP_GOAL = 1.2  # 2 workers against 2 devices, both with K = 8


def _figures_multi_worker_step(quick: bool, pairs: int, steps_per_execution: int = 1) -> dict:
    from tools.bench import launcher as bench_launcher

    # 320 timed steps: several seconds per run, so one slow second moves it by < 15 %.
    return bench_launcher.per_step(
        pairs=pairs,
        steps=32 if quick else 320,
        warmup=8 if quick else 24,
        steps_per_execution=steps_per_execution,
    )


def _result_multi_worker_step(f: dict, quick: bool) -> Result:
    spe = f.get("steps_per_execution", 1)
    goal = MULTI_WORKER_STEP_GOAL if spe > 1 else None
    return Result(
        f["ratios"],
        met=None if quick or goal is None else f["ratio_median"] <= goal,
        a_values=f["a"],
        b_values=f["b"],
        value_unit="ms/step",
        notes=f"{f['a_median']:.1f} ms vs {f['b_median']:.1f} ms per step (gRPC all-reduce "
        f"between processes against in-process all-reduce), steps_per_execution={spe}",
    )


def _figures_multi_worker_accumulation(
    quick: bool, pairs: int, steps_per_execution: int = 1
) -> dict:
    from tools.bench import accumulation as bench_accumulation

    return bench_accumulation.per_micro_step(
        pairs=pairs,
        steps=24 if quick else 420,
        warmup=4 if quick else 20,
        steps_per_execution=steps_per_execution,
    )


def _result_multi_worker_accumulation(f: dict, quick: bool) -> Result:
    return Result(
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


def _executions(figures: Callable[..., dict]) -> Callable[[bool, int], dict]:
    """``figures`` measured with ``steps_per_execution=EXECUTION_STEPS``."""
    return lambda quick, pairs: figures(quick, pairs, steps_per_execution=EXECUTION_STEPS)


# The partial-batch fixes on full batches: 2 workers (the gRPC scalar all-reduce), 1 output.
PARTIAL_BATCH_CONFIG = "2 workers, 1 output"
PARTIAL_BATCH_GOAL = 1.05


def _figures_partial_batch_cost(quick: bool, pairs: int) -> dict:
    from tools.bench import partial_batch_cost as pbc

    if quick:
        return pbc.measure(
            pairs=pairs,
            examples=10 * pbc.GLOBAL_BATCH,
            epochs=2,
            configs=(PARTIAL_BATCH_CONFIG,),
            warmup=False,
        )
    return pbc.measure(pairs=pairs, configs=(PARTIAL_BATCH_CONFIG,))


def _result_partial_batch_cost(f: dict, quick: bool) -> Result:
    row = f["configs"][PARTIAL_BATCH_CONFIG]
    a, b = statistics.median(row["a_ms"]), statistics.median(row["b_ms"])
    same = row["weights_equal"]
    met = None if quick else statistics.median(row["ratios"]) <= PARTIAL_BATCH_GOAL
    return Result(
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


def _figures_checkpoint(quick: bool, pairs: int) -> dict:
    from tools.bench import checkpoint as bench_checkpoint

    f = bench_checkpoint.measure(
        pairs=pairs * (1 if quick else REPEATS), megabytes=5.0 if quick else 50.0
    )
    return {**f, "repeats": 1 if quick else REPEATS}


def _result_checkpoint(part: str, f: dict, quick: bool) -> Result:
    row = f[part]
    goal = {"save": 1.2, "restore": 1.3}[part]
    repeats = f.get("repeats", 1)
    ratios = _grouped(row["ratios"], repeats)
    return Result(
        ratios,
        met=None if quick else statistics.median(ratios) <= goal,
        a_values=row["a_s"],
        b_values=row["b_s"],
        notes=f"{f['state_mb']} MB of weights and Adam state, a {f['file_mb']} MB archive; "
        f"medians {statistics.median(row['a_s']):.3f} s vs {statistics.median(row['b_s']):.3f} s"
        + (f"; the training step alone {f['step_s']:.3f} s" if part == "save" else "")
        + f"; each ratio the median of {repeats} alternated pair(s)",
    )


@dataclass(frozen=True)
class ChildRow:
    """A row measured in a fresh interpreter: ``figures`` measures, ``result`` reports."""

    figures: Callable[[bool, int], dict]
    result: Callable[[dict, bool], Result]
    env: dict = field(default_factory=dict)


CHILD_ROWS = {
    "overhead": ChildRow(_figures_overhead, _result_overhead, {"TFDIST_CPU_DEVICES": "2"}),
    "pipeline": ChildRow(_figures_pipeline, _result_pipeline),
    "input-bound": ChildRow(_figures_input_bound, _result_input_bound),
    "time-to-accuracy": ChildRow(_figures_time_to_accuracy, _result_time_to_accuracy),
    "restart": ChildRow(_figures_restart, _result_restart),
    "launcher": ChildRow(_figures_launcher, _result_launcher),
    "multi-worker-step": ChildRow(_figures_multi_worker_step, _result_multi_worker_step),
    "multi-worker-step-k8": ChildRow(
        _executions(_figures_multi_worker_step), _result_multi_worker_step
    ),
    "multi-worker-accumulation": ChildRow(
        _figures_multi_worker_accumulation, _result_multi_worker_accumulation
    ),
    "multi-worker-accumulation-k8": ChildRow(
        _executions(_figures_multi_worker_accumulation), _result_multi_worker_accumulation
    ),
    "partial-batch-cost": ChildRow(_figures_partial_batch_cost, _result_partial_batch_cost),
    "checkpoint-save": ChildRow(_figures_checkpoint, lambda f, q: _result_checkpoint("save", f, q)),
    "checkpoint-restore": ChildRow(
        _figures_checkpoint, lambda f, q: _result_checkpoint("restore", f, q)
    ),
}
ROW_TIMEOUT_S = 3600


def _in_child(name: str) -> Callable[[bool, int], Result]:
    """Runs row ``name`` in a fresh interpreter and reads its Result back."""

    def run(quick: bool, pairs: int) -> Result:
        import subprocess

        env = dict(
            os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", **CHILD_ROWS[name].env
        )
        cmd = [
            sys.executable,
            "-m",
            __spec__.name,
            "--child",
            name,
            "--pairs",
            str(pairs),
        ]
        proc = subprocess.run(
            cmd + (["--quick"] if quick else []),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=ROW_TIMEOUT_S,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(
                f"row {name!r} exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
            )
        return Result(**json.loads(lines[-1]))

    return run


COMPARISONS = [
    Comparison(
        "overhead",
        "tfdist.scope + tfdist.data.pipeline, epoch time",
        "hand-written MirroredStrategy + map/cache/shuffle/batch/prefetch",
        "<= 1.01",
        _in_child("overhead"),
    ),
    Comparison(
        "pipeline",
        "tfdist.data.pipeline throughput (MNIST, 10 epochs)",
        "naive raw.map(scale).batch(128)",
        ">= 7",
        _in_child("pipeline"),
    ),
    Comparison(
        "input-bound",
        "convnet step fed by tfdist.data.pipeline",
        "fed by in-memory batches",
        "<= 1.05",
        _in_child("input-bound"),
    ),
    Comparison(
        "time-to-accuracy",
        "fast recipe (>= 99.0%)",
        "tutorial recipe, 12 epochs",
        "< 1 and reaches 99%",
        _in_child("time-to-accuracy"),
    ),
    Comparison(
        "restart",
        "relaunch after kill -9 to first resumed step",
        "fresh start to first step",
        "<= 1.2, 0 batches twice",
        _in_child("restart"),
    ),
    Comparison(
        "launcher",
        "`tfdist launch -n 2` to first step",
        "two processes with hand-written TF_CONFIG",
        "<= 1.1",
        _in_child("launcher"),
    ),
    Comparison(
        "multi-worker-step",
        "2 workers, ms/step",
        "2 logical devices in one process",
        "none (the cost of gRPC)",
        _in_child("multi-worker-step"),
    ),
    Comparison(
        "multi-worker-step-k8",
        "2 workers, steps_per_execution=8, ms/step",
        "2 logical devices in one process, the same",
        f"<= {MULTI_WORKER_STEP_GOAL}",
        _in_child("multi-worker-step-k8"),
    ),
    Comparison(
        "multi-worker-accumulation",
        "2 workers, gradient_accumulation_steps=4, ms/micro-step",
        "2 logical devices in one process, the same",
        "<= 1.2",
        _in_child("multi-worker-accumulation"),
    ),
    Comparison(
        "multi-worker-accumulation-k8",
        "2 workers, gradient_accumulation_steps=4, steps_per_execution=8, ms/micro-step",
        "2 logical devices in one process, the same",
        "<= 1.2",
        _in_child("multi-worker-accumulation-k8"),
    ),
    Comparison(
        "partial-batch-cost",
        "2 workers, the partial-batch fixes on, ms/step on full batches",
        "the same with the three fixes off (upstream)",
        f"<= {PARTIAL_BATCH_GOAL}, weights A = B",
        _in_child("partial-batch-cost"),
    ),
    Comparison(
        "checkpoint-save",
        "one-step fit + tfdist.callbacks.checkpoint (50 MB)",
        "the same with keras.callbacks.ModelCheckpoint (.keras)",
        "<= 1.2",
        _in_child("checkpoint-save"),
    ),
    Comparison(
        "checkpoint-restore",
        "tfdist.make_or_restore (checked, resume state)",
        "keras.models.load_model of the same file",
        "<= 1.3",
        _in_child("checkpoint-restore"),
    ),
    Comparison("cli", "`tfdist --help`", "`python -c pass`", "small (< 5)", _cli_row),
]


def _comparisons() -> list[Comparison]:
    return COMPARISONS


def format_table(mach: dict, rows: list[tuple[Comparison, Result | None, str | None]]) -> str:
    lines = [
        machine_line(mach),
        "",
        "| name | A | B | A/B median (min-max) | goal | met |",
        "|---|---|---|---|---|---|",
    ]
    for comp, res, error in rows:
        if res is None:
            lines.append(
                f"| {comp.name} | {comp.a} | {comp.b} | error: {error} | {comp.goal} | no |"
            )
            continue
        met = {True: "yes", False: "**no**", None: "-"}[res.met]
        lines.append(
            f"| {comp.name} | {comp.a} | {comp.b} | {res.median:.3g} "
            f"({min(res.ratios):.3g}-{max(res.ratios):.3g}, n={len(res.ratios)}) "
            f"| {comp.goal} | {met} |"
        )
    notes = [
        f"- {comp.name}: {res.notes}" for comp, res, _ in rows if res is not None and res.notes
    ]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def _scaling(quick: bool, rounds: int, json_path: str | None) -> int:
    from tools.bench import scaling as bench_scaling

    mach = machine()
    figures = bench_scaling.scaling(quick=quick, rounds=rounds)
    print(bench_scaling.format_table(figures, machine_line(mach)))
    if json_path:
        write_json(json_path, {"quick": quick, **figures}, mach=mach)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pairs, data subsets (< 3 min)")
    parser.add_argument(
        "--only", action="append", metavar="NAME", help="run only this row (repeatable)"
    )
    parser.add_argument(
        "--pairs", type=int, default=None, help="recorded A/B pairs (default 5, quick 1)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--child", choices=sorted(CHILD_ROWS), help=argparse.SUPPRESS)
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="the scaling table instead: 1/2/4 workers x 1/2 devices, TensorFlow and JAX",
    )
    args = parser.parse_args(argv)
    pairs = args.pairs if args.pairs is not None else (1 if args.quick else 5)
    if pairs < 1:
        parser.error(f"--pairs must be >= 1. Received: --pairs={pairs}")

    if args.child:  # one row, in this fresh process; the parent reads the JSON line
        row = CHILD_ROWS[args.child]
        figures = asdict(row.result(row.figures(args.quick, pairs), args.quick))
        # numpy scalars (np.float64, np.bool_) from the benchmark modules -> plain Python
        print(json.dumps(figures, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
        return 0

    if args.scaling:
        return _scaling(args.quick, pairs if args.pairs is not None else 3, args.json)

    comparisons = _comparisons()
    names = [c.name for c in comparisons]
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            parser.error(f"--only: unknown name(s) {unknown}; choose from {names}")
        comparisons = [c for c in comparisons if c.name in args.only]

    mach = machine()
    rows = []
    for comp in comparisons:
        print(f"[benchmark] {comp.name}: {comp.a} vs {comp.b} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            res, error = comp.run(args.quick, pairs), None
        except Exception as err:  # one broken row must not hide the others
            res, error = None, f"{type(err).__name__}: {err}"
        print(
            f"[benchmark] {comp.name} done in {time.perf_counter() - start:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        rows.append((comp, res, error))
    print(format_table(mach, rows))
    if args.json:
        payload = {
            "machine": mach,
            "quick": args.quick,
            "pairs": pairs,
            "rows": [
                {
                    "name": comp.name,
                    "a": comp.a,
                    "b": comp.b,
                    "goal": comp.goal,
                    "error": error,
                    **({"median": res.median, **asdict(res)} if res else {}),
                }
                for comp, res, error in rows
            ],
        }
        write_json(args.json, payload)
    return 1 if any(res is None for _, res, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
