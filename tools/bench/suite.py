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
from dataclasses import asdict, dataclass

from tools.bench import (
    accumulation,
    checkpoint,
    harness,
    launcher,
    overhead,
    partial_batch_cost,
    pipeline,
    recipes,
    restart,
)
from tools.bench.harness import REPO, Result, alternate, machine, machine_line, timed, write_json


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
# Each module below declares its rows (TABLE_ROWS, harness.Row): ``figures(quick, pairs)``
# measures and returns a dict, ``result(figures, quick)`` turns it into the row's Result.
# The child process runs both; tests/project/test_benchmark.py checks every ``result`` on
# sample figures without measuring (the measuring takes minutes).

# The modules whose rows the table shows, in the table's order.
ROW_MODULES = (
    overhead,
    pipeline,
    recipes,
    restart,
    launcher,
    accumulation,
    partial_batch_cost,
    checkpoint,
)
CHILD_ROWS = {row.name: row for module in ROW_MODULES for row in module.TABLE_ROWS}
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
    *(Comparison(r.name, r.a, r.b, r.goal, _in_child(r.name)) for r in CHILD_ROWS.values()),
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
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench", description=__doc__.splitlines()[0]
    )
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
