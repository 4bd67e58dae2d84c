"""Elastic re-form vs a plain restart: seconds from a lost worker to the next first step.

The job is tests/scripts/elastic_job.py (a fixed global batch, checkpoints every 4 steps),
three workers, one per node, on this host's loopback. Measured side by side, alternately:

* A, elastic: ``tfdist launch --nnodes 2:3`` on three node launchers; node 2's launcher
  and worker get SIGKILL after step ``kill_at``; the clock stops at the chief's first step
  on 2 workers (the survivors noticed the lost lease, re-formed and resumed).
* B, plain restart: one ``tfdist launch -n 3 --max-restarts 1``; one worker gets SIGKILL
  after step ``kill_at``; the clock stops at the chief's first step after the launcher
  restarted all three (the same size).

Times are those at which the chief's ``STEP`` lines reach this process (polled every
50 ms), the same way for both. The ratio is A/B, per pair.

    python -m tools.bench.elastic             # 2 pairs
    python -m tools.bench.elastic --pairs 1   # one pair
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench import harness

REPO = harness.REPO
JOB = REPO / "tests" / "scripts" / "elastic_job.py"
RESULT = harness.RESULTS / "elastic_measured.json"
TIMEOUT = 600  # seconds for one run
KILL_AT = 10  # the chief's step after which a worker is killed
RDZV_CONF = "lease=3,last_call_timeout=2,join_timeout=120"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Run:
    """Launcher processes of one run, their output in files this process polls."""

    def __init__(self, tmp: Path):
        self.tmp, self.procs, self.logs = tmp, [], []
        self.env = harness.child_env(TFDIST_UNSCOPED_MODELS="local")

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        self.logs.append(log)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tfdist", "launch", *argv, str(JOB), "--dir",
                 str(self.tmp / "ckpt"), "--step-seconds", "0.3"],
                cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def steps(self, workers: int) -> list[int]:
        pattern = re.compile(rf"STEP (\d+) WORKERS {workers}\n")
        return [int(s) for log in self.logs for s in pattern.findall(log.read_text())]

    def wait(self, test, what: str) -> float:
        """Polls until ``test()``; returns the time it first held."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if test():
                return time.time()
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.05)
        tails = "\n".join(log.read_text()[-2000:] for log in self.logs)
        raise RuntimeError(f"bench elastic: no {what}:\n{tails}")

    def end(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def elastic_seconds() -> float:
    """A: kill one of three elastic nodes; seconds to the first step on two."""
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        run = _Run(Path(tmp))
        endpoint = f"127.0.0.1:{_free_port()}"
        flags = ["--nnodes", "2:3", "--rdzv-endpoint", endpoint, "--rdzv-id", "bench"]
        flags += ["--rdzv-conf", RDZV_CONF, "-n", "1"]
        try:
            run.start("node0", *flags)
            run.wait(lambda: "hosts the store" in run.logs[0].read_text(), "store")
            victim = [run.start("node1", *flags), run.start("node2", *flags)][1]
            run.wait(lambda: max(run.steps(3), default=0) >= KILL_AT, "step on 3 workers")
            os.killpg(victim.pid, signal.SIGKILL)
            lost = time.time()
            return run.wait(lambda: run.steps(2), "step on 2 workers") - lost
        finally:
            run.end()


def restart_seconds() -> float:
    """B: kill one worker of a 3-worker launch; seconds to the first step after the restart."""
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        run = _Run(Path(tmp))
        try:
            run.start("launch", "-n", "3", "--max-restarts", "1")
            run.wait(lambda: max(run.steps(3), default=0) >= KILL_AT, "step on 3 workers")
            pid = json.loads((Path(tmp) / "ckpt" / "starts.jsonl").read_text().splitlines()[0])
            done = len(run.steps(3))
            os.kill(pid["pid"], signal.SIGKILL)  # the chief's worker
            lost = time.time()
            starts = Path(tmp) / "ckpt" / "starts.jsonl"

            def restarted():
                return len(starts.read_text().splitlines()) > 1 and len(run.steps(3)) > done

            return run.wait(restarted, "step after the restart") - lost
        finally:
            run.end()


def report(result: dict) -> str:
    """The figure's sentence (docs/elastic.md renders it through tools/docs/figures.py)."""
    return (
        f"Seconds from a lost worker to the first step after: elastic re-form on 2 of 3 "
        f"nodes {result['a_median']:.1f} s, a plain restart of the 3 workers "
        f"{result['b_median']:.1f} s; ratio {result['ratio_median']:.2f} (range "
        f"{result['ratio_min']:.2f}-{result['ratio_max']:.2f}, {len(result['ratios'])} pair(s), "
        f"lease {result['rdzv_conf'].split(',')[0].split('=')[1]} s)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args(argv)
    mach = harness.machine()
    print(harness.machine_line(mach), flush=True)
    a, b = harness.alternate(elastic_seconds, restart_seconds, args.pairs, warmup=0)
    result = {"kill_at_step": KILL_AT, "rdzv_conf": RDZV_CONF, **harness.summary(a, b)}
    harness.write_json(args.out, result, mach=mach)
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
