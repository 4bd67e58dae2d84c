"""What every benchmark shares: the machine stamp, A/B alternation, the child processes'
environment and the JSON a run writes (with the machine and the date inside).

A and B are measured side by side, alternately (A B, then B A, ...), after a warm-up, so
that the noise of a shared machine hits both alike; a figure is the median of the ratios
with their range.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "tools" / "results"
# Cluster settings a benchmark's child must not inherit from the shell that started it.
CLUSTER_VARIABLES = ("TF_CONFIG", "TFDIST_CPU_DEVICES", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [g.strip() for g in out.stdout.splitlines() if g.strip()] if out.returncode == 0 else []


def machine(*packages: str) -> dict:
    """The machine a figure is measured on: date, CPU, cores, load average, GPUs, and the
    versions of Python, TensorFlow, Keras, JAX, tfdist and ``packages``.

    Example:
        >>> sorted(machine("orbax-checkpoint"))[:4]
        ['cores', 'cpu', 'date', 'gpus']
    """
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "gpus": _gpus(),
        "python": platform.python_version(),
        "tensorflow": _version("tensorflow") or _version("tensorflow-cpu"),
        **{name: _version(name) for name in ("keras", "jax", "tfdist", *packages)},
    }


def machine_line(mach: dict) -> str:
    """The line on top of every table printed."""
    return (
        f"machine: {mach['cpu']}, {mach['cores']} cores, GPUs: {', '.join(mach['gpus']) or 'none'}; "
        f"python {mach['python']}, tensorflow {mach['tensorflow']}, keras {mach['keras']}; {mach['date']}"
    )


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(
    measure_a: Callable[[], float], measure_b: Callable[[], float], pairs: int, *, warmup: int = 1
) -> tuple[list[float], list[float]]:
    """Runs ``warmup`` unrecorded pairs (caches, compilation), then ``pairs`` recorded ones.

    Returns (a_values, b_values); the order inside a pair alternates so that neither side
    always runs second.

    Example:
        >>> calls = []
        >>> alternate(lambda: calls.append("a") or 1.0, lambda: calls.append("b") or 2.0, 2)
        ([1.0, 1.0], [2.0, 2.0])
        >>> "".join(calls)  # a warm-up pair, then A B and B A
        'ababba'
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


def in_turn(items: Sequence, round_index: int) -> list:
    """``items`` in their order on even rounds and reversed on odd ones, so that no
    variant always runs first.

    Example:
        >>> in_turn(["a", "b", "c"], 0), in_turn(["a", "b", "c"], 1)
        (['a', 'b', 'c'], ['c', 'b', 'a'])
    """
    return list(items) if round_index % 2 == 0 else list(reversed(items))


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """A/B of each pair.

    Example:
        >>> ratios([2.0, 3.0], [1.0, 2.0])
        [2.0, 1.5]
    """
    return [x / y for x, y in zip(a, b, strict=True)]


def summary(a: list[float], b: list[float]) -> dict:
    """The ratios of alternated A/B values with their median and range, and both sides'
    medians.

    Example:
        >>> summary([1.5, 2.5], [1.0, 1.0])["ratio_median"]
        2.0
    """
    rs = ratios(a, b)
    return {
        "ratio_median": statistics.median(rs),
        "ratio_min": min(rs),
        "ratio_max": max(rs),
        "ratios": rs,
        "a": a,
        "b": b,
        "a_median": statistics.median(a),
        "b_median": statistics.median(b),
    }


def child_env(**extra: str) -> dict[str, str]:
    """os.environ for a benchmark's child process: no cluster settings, TensorFlow's
    start-up lines quiet, output unbuffered, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", **extra)
    return env


def worker0_json(text: str, tool: str) -> dict:
    """The JSON line worker 0 printed (``[w0] {...}`` under the launcher, bare alone)."""
    for line in reversed(text.splitlines()):
        start = line.find("{")
        if start >= 0 and line[:start].strip() in ("", "[w0]"):
            try:
                return json.loads(line[start:])
            except ValueError:
                continue
    raise RuntimeError(f"{tool}: the job printed no report:\n{text[-3000:]}")


def write_json(path: str | Path, payload: dict, *, mach: dict | None = None) -> None:
    """Writes ``payload`` to ``path`` as indented JSON with the machine (and so the date)
    under ``"machine"``: ``mach`` if given, else the payload's own, else this one's."""
    stamped = {"machine": mach or payload.get("machine") or machine(), **payload}
    # numpy scalars (np.float64, np.bool_) -> plain Python
    text = json.dumps(
        stamped, indent=2, default=lambda o: o.item() if hasattr(o, "item") else str(o)
    )
    Path(path).write_text(text + "\n")


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


@dataclass(frozen=True)
class Row:
    """One row of ``python -m tools.bench``'s table, declared by the module that measures it.

    ``figures(quick, pairs)`` measures (in a fresh interpreter with ``env`` added: TensorFlow
    fixes its devices per process) and returns a dict; ``result(figures, quick)`` turns that
    dict into the row's Result (tests/project/test_benchmark.py checks every ``result`` on
    sample figures without measuring).
    """

    name: str
    a: str
    b: str
    goal: str
    figures: Callable[[bool, int], dict]
    result: Callable[[dict, bool], Result]
    env: dict = field(default_factory=dict)


# Rows whose one measurement lasts about a second (a process start, one save) record, per
# pair, the median of REPEATS alternated pairs: one scheduler hiccup then moves the
# median of three, not the pair itself.
REPEATS = 3


def grouped(values: list[float], size: int) -> list[float]:
    """Medians of consecutive groups of ``size`` values (one per recorded pair).

    Example:
        >>> grouped([1.0, 5.0, 2.0, 3.0, 3.0, 9.0], 3)
        [2.0, 3.0]
    """
    if size < 1 or len(values) % size:
        raise ValueError(
            f"grouped: {len(values)} values do not split into groups of {size}. Received: "
            f"size={size}. Measure a multiple of size values."
        )
    return [statistics.median(values[i : i + size]) for i in range(0, len(values), size)]


# compile(steps_per_execution=K) of the "-k8" rows: one host round-trip per K steps.
EXECUTION_STEPS = 8


def executions(figures: Callable[..., dict]) -> Callable[[bool, int], dict]:
    """``figures`` measured with ``steps_per_execution=EXECUTION_STEPS``."""
    return lambda quick, pairs: figures(quick, pairs, steps_per_execution=EXECUTION_STEPS)
