"""The scaling table: 1, 2 and 4 workers x 1 and 2 devices each, images/s and efficiency.

Every configuration trains the same job (tests/scripts/mw_bench_job.py on TensorFlow,
tests/scripts/jax_bench_job.py on JAX: the 269k-parameter MLP, global batch 128, SGD)
as ``tfdist launch -n N --devices-per-worker G`` (one process when N is 1, with
``TFDIST_CPU_DEVICES=G``). A round runs every configuration once, the order reversed
every other round, so load drift hits them alike; the table holds medians and ranges.
Efficiency is images/s over images/s of 1 worker x 1 device: the global batch is fixed
and every process shares this machine's cores, so it measures what distribution costs,
not what extra hardware would give.

JAX rows (issue 11): ``tfdist.scope()`` against a hand-written ``keras.distribution
DataParallel`` on the same 4 logical devices (goal <= 1.01), and that DataParallel
against one device with no distribution (no goal: what 4 devices cost on one CPU).

    python -m tools.bench --scaling [--quick] [--json FILE]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable

from tools.bench import harness

REPO = harness.REPO
SCRIPTS = REPO / "tests" / "scripts"
TIMEOUT_S = 600
CONFIGS = ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2))  # (workers, devices per worker)
QUICK_CONFIGS = ((1, 1), (2, 1))
OVERHEAD_GOAL = 1.01


def _env(backend: str, devices: int | None) -> dict[str, str]:
    env = harness.child_env(KERAS_BACKEND=backend)
    if devices and devices > 1:
        env["TFDIST_CPU_DEVICES"] = str(devices)
    return env


def command(backend: str, workers: int, devices: int, job_args: list[str]) -> tuple[list, dict]:
    """The command line and environment of one configuration.

    Example:
        >>> command("jax", 2, 1, [])[0][3:6]
        ['launch', '-n', '2']
    """
    job = SCRIPTS / ("jax_bench_job.py" if backend == "jax" else "mw_bench_job.py")
    if workers == 1:
        return [sys.executable, str(job), *job_args], _env(backend, devices)
    launch = [sys.executable, "-m", "tfdist", "launch", "-n", str(workers)]
    launch += ["--devices-per-worker", str(devices)]
    return [*launch, str(job), *job_args], _env(backend, None)


def run_once(cmd: list, env: dict) -> dict:
    """Runs one job and returns the JSON line of worker 0."""
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    for line in reversed(proc.stdout.splitlines()):
        start = line.find("{")
        if proc.returncode == 0 and start >= 0 and line[:start].strip() in ("", "[w0]"):
            return json.loads(line[start:])
    raise RuntimeError(
        f"bench_scaling: {' '.join(cmd[-6:])} exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    )


def rounds_of(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each named measurement once per round, the order reversed every other round.

    Example:
        >>> rounds_of({"a": lambda: 1.0, "b": lambda: 2.0}, 2)
        {'a': [1.0, 1.0], 'b': [2.0, 2.0]}
    """
    values: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in harness.in_turn(names, r):
            values[name].append(runs[name]())
    return values


def table_rows(backend: str, values: dict[str, list[float]], global_batch: int) -> list[dict]:
    """Rows of the table from images/s per configuration ("NxG" keys); 1x1 is the base.

    Example:
        >>> rows = table_rows("tensorflow", {"1x1": [100.0], "2x1": [50.0]}, 128)
        >>> [r["efficiency"] for r in rows]
        [1.0, 0.5]
    """
    base = statistics.median(values["1x1"])
    rows = []
    for key, ips in values.items():
        workers, devices = (int(v) for v in key.split("x"))
        med = statistics.median(ips)
        rows.append({
            "backend": backend, "workers": workers, "devices_per_worker": devices,
            "replicas": workers * devices, "global_batch": global_batch,
            "images_per_s": med, "range": [min(ips), max(ips)],
            "ms_per_step": 1000 * global_batch / med, "efficiency": med / base, "n": len(ips),
        })  # fmt: skip
    return rows


def scaling(*, quick: bool = False, rounds: int = 3, global_batch: int = 128) -> dict:
    """The table for both backends plus the two JAX comparisons.

    Example:
        >>> scaling(quick=True)["rows"][0]["efficiency"]  # doctest: +SKIP
        1.0
    """
    configs = QUICK_CONFIGS if quick else CONFIGS
    steps = ["--steps", "30" if quick else "60", "--warmup", "5" if quick else "10"]
    job = [*steps, "--global-batch", str(global_batch)]
    rows = []
    for backend in ("tensorflow", "jax"):
        runs = {
            f"{w}x{g}": _images_per_s(backend, w, g, job + _mode(backend, "tfdist"))
            for w, g in configs
        }
        rows += table_rows(backend, rounds_of(runs, 1 if quick else rounds), global_batch)
    return {"rows": rows, "jax": jax_rows(quick=quick, rounds=rounds, job=job), "steps": steps}


def _mode(backend: str, mode: str) -> list[str]:
    return ["--mode", mode] if backend == "jax" else []


def _images_per_s(backend: str, workers: int, devices: int, job: list[str]):
    cmd, env = command(backend, workers, devices, job)
    return lambda: run_once(cmd, env)["images_per_s"]


def jax_rows(*, quick: bool, rounds: int, job: list[str]) -> dict:
    """tfdist.scope / hand-written DataParallel (4 devices); DataParallel 4 / one device."""
    runs = {
        "tfdist_4": _images_per_s("jax", 1, 4, job + ["--mode", "tfdist"]),
        "keras_4": _images_per_s("jax", 1, 4, job + ["--mode", "keras"]),
        "none_1": _images_per_s("jax", 1, 1, job + ["--mode", "none"]),
    }
    v = rounds_of(runs, 1 if quick else rounds)
    # Ratios of step times (A/B > 1: A slower), pair by pair, from images/s.
    overhead = [k / t for t, k in zip(v["tfdist_4"], v["keras_4"], strict=True)]
    cost = [n / k for k, n in zip(v["keras_4"], v["none_1"], strict=True)]
    return {
        "images_per_s": {name: statistics.median(x) for name, x in v.items()},
        "tfdist_over_keras": statistics.median(overhead),
        "tfdist_over_keras_range": [min(overhead), max(overhead)],
        "overhead_goal_met": statistics.median(overhead) <= OVERHEAD_GOAL,
        "dp4_over_one_device": statistics.median(cost),
        "dp4_over_one_device_range": [min(cost), max(cost)],
    }


def format_table(f: dict, machine_line: str) -> str:
    lines = [
        machine_line,
        "",
        "| backend | workers x devices | replicas | images/s (min-max) | ms/step | efficiency |",
        "|---|---|---|---|---|---|",
    ]
    for r in f["rows"]:
        lo, hi = r["range"]
        lines.append(
            f"| {r['backend']} | {r['workers']} x {r['devices_per_worker']} | {r['replicas']} "
            f"| {r['images_per_s']:,.0f} ({lo:,.0f}-{hi:,.0f}, n={r['n']}) "
            f"| {r['ms_per_step']:.1f} | {r['efficiency']:.0%} |"
        )
    j = f["jax"]
    lo, hi = j["tfdist_over_keras_range"]
    lines += [
        "",
        f"- JAX, 4 logical devices: tfdist.scope / hand-written DataParallel step time "
        f"{j['tfdist_over_keras']:.3f} ({lo:.3f}-{hi:.3f}); goal <= {OVERHEAD_GOAL}: "
        f"{'met' if j['overhead_goal_met'] else 'not met'}",
        f"- JAX: DataParallel on 4 logical devices / one device, no distribution: step time "
        f"{j['dp4_over_one_device']:.2f}x (one CPU shared by the 4 devices: the cost, no goal)",
    ]
    return "\n".join(lines)
