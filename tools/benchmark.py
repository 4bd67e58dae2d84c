"""One benchmark suite: tfdist against raw TensorFlow, measured side by side.

Each comparison runs A and B alternately in the same process run (A B A B ...) after a
warm-up, so the noise of a shared machine hits both alike, and reports the median ratio
with its min/max. It prints one table, with the machine on top.

    python tools/benchmark.py                 # full run (tens of minutes on 2 cores)
    python tools/benchmark.py --quick         # < 3 minutes: fewer pairs, data subsets
    python tools/benchmark.py --only pipeline --json figures.json

The test suite runs ``--quick`` as a smoke test; no test asserts on a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:  # the per-issue benchmark modules live beside this file
    sys.path.insert(0, str(TOOLS))


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


def alternate(
    measure_a: Callable[[], float], measure_b: Callable[[], float], pairs: int, *, warmup: int = 1
):
    """Runs ``warmup`` unrecorded pairs, then ``pairs`` recorded A-then-B pairs.

    Returns (a_values, b_values); the order inside a pair alternates so that neither side
    always runs second (caches, clocks).
    """
    for _ in range(warmup):
        measure_a()
        measure_b()
    a_values, b_values = [], []
    for i in range(pairs):
        if i % 2 == 0:
            a_values.append(measure_a())
            b_values.append(measure_b())
        else:
            b_values.append(measure_b())
            a_values.append(measure_a())
    return a_values, b_values


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine() -> dict:
    """CPU, cores, GPUs and versions, for the top of the table."""
    import importlib.metadata as md

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = []
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        gpus = (
            [g.strip() for g in out.stdout.splitlines() if g.strip()] if out.returncode == 0 else []
        )
    except (OSError, subprocess.TimeoutExpired):
        pass

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpus": gpus,
        "python": platform.python_version(),
        "tensorflow": version("tensorflow"),
        "keras": version("keras"),
        "tfdist": version("tfdist"),
    }


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
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    med = statistics.median(ratios)
    return Result(
        ratios,
        met=med < 5,
        a_values=a,
        b_values=b,
        notes=f"tfdist --help {statistics.median(a) * 1000:.0f} ms, python -c pass "
        f"{statistics.median(b) * 1000:.0f} ms",
    )


COMPARISONS = [
    Comparison("cli", "`tfdist --help`", "`python -c pass`", "small (< 5)", _cli_row),
]


def _comparisons() -> list[Comparison]:
    return COMPARISONS


def format_table(mach: dict, rows: list[tuple[Comparison, Result | None, str | None]]) -> str:
    lines = [
        f"machine: {mach['cpu']}, {mach['cores']} cores, GPUs: {', '.join(mach['gpus']) or 'none'}; "
        f"python {mach['python']}, tensorflow {mach['tensorflow']}, keras {mach['keras']}; {mach['date']}",
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pairs, data subsets (< 3 min)")
    parser.add_argument(
        "--only", action="append", metavar="NAME", help="run only this row (repeatable)"
    )
    parser.add_argument(
        "--pairs", type=int, default=None, help="recorded A/B pairs (default 5, quick 2)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    pairs = args.pairs if args.pairs is not None else (2 if args.quick else 5)
    if pairs < 1:
        parser.error(f"--pairs must be >= 1. Received: --pairs={pairs}")

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
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 1 if any(res is None for _, res, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
