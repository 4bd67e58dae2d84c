"""What `tfdist launch` costs: start-up against hand-started workers, and per-step cost.

Two comparisons, each measured side by side in one run (A B A B ..., the order inside a
pair alternating), on the job of tests/scripts/mw_bench_job.py (an MLP with 270k
parameters on MNIST-sized synthetic data, global batch 128):

* ``startup``: time from launch (before the first process starts) to the end of the
  first training step on worker 0. A: ``tfdist launch -n 2 job.py``; B: two
  ``python job.py`` processes started by hand, each with a hand-written TF_CONFIG
  (free loopback ports). Goal: A/B at most 1.1.
* ``per_step``: steady-state milliseconds per training step (after warm-up steps). A:
  2 workers (``tfdist launch -n 2``, one CPU device each, gRPC all-reduce); B: 2
  logical CPU devices in one process (``TFDIST_CPU_DEVICES=2``, MirroredStrategy).
  The same model, data and global batch; no goal, it is what multi-worker costs.
* ``network``: launch to the end of the first step, A: ``tfdist launch -n 2`` (workers
  in a private network namespace, the default, with the user-mode network stack that
  carries their outbound connections: its start is part of A), B: ``tfdist launch -n 2
  --shared-network``. Goal: A/B at most 1.05. Also says which stack A had (``egress``:
  pasta, slirp4netns, or none and why, from the launcher's log line) and what the stack
  costs alone (``stack_start``: milliseconds to create a private network with and
  without it, alternated in this process).

    python -m tools.bench.launcher            # 3 pairs each
    python -m tools.bench.launcher --quick    # 1 pair each, fewer steps
    python -m tools.bench.launcher --json figures.json
    python -m tools.bench.launcher --network-only --pairs 5
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from tfdist.core.cluster import worker_tf_config
from tfdist.launch import free_ports
from tfdist.launch.namespace import NamespaceUnavailable, PrivateNetwork
from tools.bench import harness

REPO = harness.REPO
JOB = REPO / "tests" / "scripts" / "mw_bench_job.py"
TIMEOUT = 600  # seconds for one measured run
STARTUP_GOAL = 1.1
NETWORK_GOAL = 1.05

EGRESS_THROUGH = re.compile(r"outbound connections go out through (\S+) \(")


def launched(job_args: list[str], *flags: str) -> tuple[float, dict]:
    started, report, _ = _launch(job_args, *flags)
    return started, report


def _egress(log: str) -> str:
    """Which stack carried the private network's outbound connections, from the
    launcher's log line: its name, ``none: why``, ``off`` or ``shared network``."""
    line = next((x for x in log.splitlines() if "private network: " in x), "")
    if match := EGRESS_THROUGH.search(line):
        return match.group(1)
    if "cannot reach anything outside it" in line:
        return "none: " + line.split("this host's services): ", 1)[-1].split("; install")[0]
    if "TFDIST_PRIVATE_EGRESS=0;" in line:
        return "off (TFDIST_PRIVATE_EGRESS=0)"
    return "shared network" if "shared network (--shared-network)" in log else "unknown"


def _launch(job_args: list[str], *flags: str) -> tuple[float, dict, str]:
    """Seconds since the epoch at launch, worker 0's report, the launcher's own log."""
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", "-n", "2", *flags, str(JOB), *job_args],
        cwd=REPO,
        env=harness.child_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench_launcher: tfdist launch exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    return started, harness.worker0_json(proc.stdout, "bench_launcher"), proc.stderr


def _by_hand(job_args: list[str]) -> tuple[float, dict]:
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    started = time.time()
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), *job_args],
            cwd=REPO,
            env=harness.child_env(TF_CONFIG=worker_tf_config(addresses, index)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_, err) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"bench_launcher: a worker exited {proc.returncode}:\n{err[-3000:]}")
    return started, harness.worker0_json(outputs[0][0], "bench_launcher")


def one_process(job_args: list[str]) -> tuple[float, dict]:
    started = time.time()
    proc = subprocess.run(
        [sys.executable, str(JOB), *job_args],
        cwd=REPO,
        env=harness.child_env(TFDIST_CPU_DEVICES="2"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench_launcher: the job exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    return started, harness.worker0_json(proc.stdout, "bench_launcher")


def startup(*, pairs: int = 3) -> dict:
    """Seconds from launch to the end of the first step: tfdist launch (A) vs by hand (B).

    Example:
        >>> startup(pairs=1)["ratio_median"]  # doctest: +SKIP
        1.02
    """
    args = ["--first-step-only"]

    def measure(run) -> Callable[[], float]:
        def once() -> float:
            started, report = run(args)
            return report["first_step"] - started

        return once

    result = harness.summary(*harness.alternate(measure(launched), measure(_by_hand), pairs))
    result.update(unit="s", goal=f"<= {STARTUP_GOAL}", met=result["ratio_median"] <= STARTUP_GOAL)
    return result


def network(*, pairs: int = 3) -> dict:
    """Seconds from launch to the end of the first step: private network (A) vs shared (B).

    Example:
        >>> network(pairs=1)["ratio_median"]  # doctest: +SKIP
        1.0
    """
    args = ["--first-step-only"]
    egress: list[str] = []

    def measure(*flags: str) -> Callable[[], float]:
        def once() -> float:
            started, report, log = _launch(args, *flags)
            if not flags:
                egress.append(_egress(log))
            return report["first_step"] - started

        return once

    result = harness.summary(*harness.alternate(measure(), measure("--shared-network"), pairs))
    result.update(unit="s", goal=f"<= {NETWORK_GOAL}", met=result["ratio_median"] <= NETWORK_GOAL)
    result.update(egress=", ".join(sorted(set(egress))), stack_start=stack_start())
    return result


def stack_start(*, repeats: int = 10) -> dict:
    """Milliseconds to create a private network without (A) and with (B) its user-mode
    network stack, alternated; their difference is what the stack adds to a start.

    Example:
        >>> stack_start(repeats=3)["tool"]  # doctest: +SKIP
        'pasta'
    """
    tools: set[str] = set()

    def create(egress: bool) -> Callable[[], float]:
        def once() -> float:
            started = time.perf_counter()
            net = PrivateNetwork.create(egress=egress)
            elapsed = (time.perf_counter() - started) * 1000
            if egress:
                tools.add(net.egress or f"none: {net.no_egress}")
            net.close()
            return elapsed

        return once

    try:
        without, with_stack = harness.alternate(create(False), create(True), repeats)
    except NamespaceUnavailable as err:
        return {"error": str(err)}
    return {
        "unit": "ms",
        "namespace_ms": statistics.median(without),
        "with_stack_ms": statistics.median(with_stack),
        "stack_ms": statistics.median(with_stack) - statistics.median(without),
        "tool": ", ".join(sorted(tools)),
        "repeats": repeats,
    }


def per_step(
    *, pairs: int = 3, steps: int = 60, warmup: int = 10, steps_per_execution: int = 1
) -> dict:
    """Milliseconds per step: 2 workers (A) vs 2 logical devices in one process (B), both
    compiled with ``steps_per_execution`` (``steps`` and ``warmup`` should be multiples).

    Example:
        >>> per_step(pairs=1, steps=32, warmup=8, steps_per_execution=8)["ratio_median"]  # doctest: +SKIP
        1.2
    """
    if steps_per_execution < 1:
        raise ValueError(
            f"bench_launcher: steps_per_execution must be >= 1. Received: {steps_per_execution}"
        )
    args = ["--steps", str(steps), "--warmup", str(warmup)]
    args += ["--steps-per-execution", str(steps_per_execution)]

    def measure(run, replicas: int) -> Callable[[], float]:
        def once() -> float:
            _, report = run(args)
            if report["replicas"] != replicas:
                raise RuntimeError(f"bench_launcher: expected {replicas} replicas: {report}")
            return report["ms_per_step"]

        return once

    result = harness.summary(
        *harness.alternate(measure(launched, 2), measure(one_process, 2), pairs)
    )
    result.update(
        unit="ms/step", steps=steps, warmup=warmup, steps_per_execution=steps_per_execution
    )
    return result


def run(*, quick: bool = False, pairs: int | None = None) -> dict:
    """Both comparisons; ``quick`` runs one pair each and fewer steps.

    Example:
        >>> figures = run(quick=True)  # doctest: +SKIP
        >>> sorted(figures)
        ['network', 'per_step', 'startup']
    """
    pairs = pairs or (1 if quick else 3)
    if pairs < 1:
        raise ValueError(f"bench_launcher: pairs must be >= 1. Received: pairs={pairs}")
    return {
        "startup": startup(pairs=pairs),
        "per_step": per_step(pairs=pairs, steps=30 if quick else 60, warmup=5 if quick else 10),
        "network": network(pairs=pairs),
    }


def _print_network(n: dict) -> None:
    print(
        f"startup (launch to end of first step), private network / --shared-network: "
        f"{n['ratio_median']:.3f} (min {n['ratio_min']:.3f}, max {n['ratio_max']:.3f}, "
        f"n={len(n['ratios'])}); {n['a_median']:.2f} s vs {n['b_median']:.2f} s; goal <= "
        f"{NETWORK_GOAL}: {'met' if n['met'] else 'NOT met'}; egress: {n['egress']}"
    )
    s = n["stack_start"]
    if "error" in s:
        print(f"private network creation not measured: {s['error']}")
        return
    print(
        f"private network creation (median of {s['repeats']}): {s['namespace_ms']:.1f} ms "
        f"loopback only, {s['with_stack_ms']:.1f} ms with its stack ({s['tool']}): the "
        f"stack adds {s['stack_ms']:.1f} ms"
    )


# --- the table's rows (python -m tools.bench, tools/bench/suite.py) --------------------


def _figures_launcher(quick: bool, pairs: int) -> dict:
    f = startup(pairs=pairs * (1 if quick else harness.REPEATS))
    return {**f, "repeats": 1 if quick else harness.REPEATS}


def _result_launcher(f: dict, quick: bool) -> harness.Result:
    repeats = f.get("repeats", 1)
    return harness.Result(
        harness.grouped(f["ratios"], repeats),
        met=f["ratio_median"] <= 1.1,
        a_values=f["a"],
        b_values=f["b"],
        notes=f"launch to first step: {f['a_median']:.2f} s vs {f['b_median']:.2f} s; each "
        f"ratio the median of {repeats} alternated pair(s)",
    )


MULTI_WORKER_STEP_GOAL = 1.2  # 2 workers against 2 devices, both with K = 8


def _figures_multi_worker_step(quick: bool, pairs: int, steps_per_execution: int = 1) -> dict:
    # 320 timed steps: several seconds per run, so one slow second moves it by < 15 %.
    return per_step(
        pairs=pairs,
        steps=32 if quick else 320,
        warmup=8 if quick else 24,
        steps_per_execution=steps_per_execution,
    )


def _result_multi_worker_step(f: dict, quick: bool) -> harness.Result:
    spe = f.get("steps_per_execution", 1)
    goal = MULTI_WORKER_STEP_GOAL if spe > 1 else None
    return harness.Result(
        f["ratios"],
        met=None if quick or goal is None else f["ratio_median"] <= goal,
        a_values=f["a"],
        b_values=f["b"],
        value_unit="ms/step",
        notes=f"{f['a_median']:.1f} ms vs {f['b_median']:.1f} ms per step (gRPC all-reduce "
        f"between processes against in-process all-reduce), steps_per_execution={spe}",
    )


TABLE_ROWS = [
    harness.Row(
        "launcher",
        "`tfdist launch -n 2` to first step",
        "two processes with hand-written TF_CONFIG",
        "<= 1.1",
        _figures_launcher,
        _result_launcher,
    ),
    harness.Row(
        "multi-worker-step",
        "2 workers, ms/step",
        "2 logical devices in one process",
        "none (the cost of gRPC)",
        _figures_multi_worker_step,
        _result_multi_worker_step,
    ),
    harness.Row(
        "multi-worker-step-k8",
        "2 workers, steps_per_execution=8, ms/step",
        "2 logical devices in one process, the same",
        f"<= {MULTI_WORKER_STEP_GOAL}",
        harness.executions(_figures_multi_worker_step),
        _result_multi_worker_step,
    ),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one pair each, fewer steps")
    parser.add_argument("--pairs", type=int, default=None, help="A/B pairs (default 3)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument(
        "--network-only", action="store_true", help="only private vs shared network start-up"
    )
    args = parser.parse_args(argv)
    if args.network_only:
        figures = {"network": network(pairs=args.pairs or 3)}
        _print_network(figures["network"])
        if args.json:
            harness.write_json(args.json, figures)
        return 0
    figures = run(quick=args.quick, pairs=args.pairs)
    s, p = figures["startup"], figures["per_step"]
    print(
        f"startup (launch to end of first step), tfdist launch -n 2 / two processes with "
        f"hand-written TF_CONFIG: {s['ratio_median']:.3f} (min {s['ratio_min']:.3f}, max "
        f"{s['ratio_max']:.3f}, n={len(s['ratios'])}); {s['a_median']:.2f} s vs "
        f"{s['b_median']:.2f} s; goal <= {STARTUP_GOAL}: {'met' if s['met'] else 'NOT met'}"
    )
    print(
        f"per step, 2 workers / 2 logical devices in one process: {p['ratio_median']:.3f} "
        f"(min {p['ratio_min']:.3f}, max {p['ratio_max']:.3f}, n={len(p['ratios'])}); "
        f"{p['a_median']:.1f} ms vs {p['b_median']:.1f} ms per step"
    )
    _print_network(figures["network"])
    if args.json:
        harness.write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
