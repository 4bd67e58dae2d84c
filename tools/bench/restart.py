"""Restart cost of a tfdist job: relaunch-to-first-resumed-step vs a fresh start, and work lost.

Each round launches the job of tests/scripts/ckpt_job.py fresh (A), lets it SIGKILL itself
after step ``kill_at`` (between two step checkpoints), then relaunches it (B), which
restores and finishes. A and B alternate (A B A B ...), so the machine's noise hits both
alike. Measured, from process launch (before the interpreter starts) to the end of the
first training step:

* ``ratio``: B's time over A's, per round (goal: at most 1.2);
* work lost: steps recomputed after the kill (goal: at most ``save_freq``), and, over the
  whole run, batches applied twice and batches skipped (goal: 0), read from the
  positions each process trained;
* ``restart_extra_s``: what the restart itself adds inside the process (restoring, then
  fit's start to the first step), apart from interpreter and TensorFlow start-up;
* the same kill with Keras's own ``BackupAndRestore`` (``save_freq`` steps too) as a
  baseline: it restarts the interrupted epoch at batch 0.

    python -m tools.bench.restart              # 5 rounds, ~1M-parameter model
    python -m tools.bench.restart --quick      # 1 round, small model
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench import harness

REPO = harness.REPO
JOB = REPO / "tests" / "scripts" / "ckpt_job.py"
TIMEOUT = 600  # seconds for one job process


def _env(devices: int | None) -> dict:
    env = harness.child_env()
    if devices:
        env["TFDIST_CPU_DEVICES"] = str(devices)
    return env


def _launch(args: list[str], env: dict) -> dict:
    """Runs the job; returns its first-step report, final report, exit code, launch time."""
    launched = time.time()
    proc = subprocess.Popen(
        [sys.executable, str(JOB), *args, "--report-first-step"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"bench_restart: the job did not finish within {TIMEOUT} s") from None
    first = final = None
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        data = json.loads(line)
        if "first_step" in data:
            first = data["first_step"]
        elif "weights" in data:
            final = data
    if first is None:
        raise RuntimeError(
            f"bench_restart: the job trained no step (exit {proc.returncode}):\n{err[-3000:]}"
        )
    return {
        "stderr_tail": err[-3000:],
        "to_first_step": first["unix"] - launched,
        "first": first,
        "final": final,
        "returncode": proc.returncode,
    }


def _lineage(steps_per_epoch: int, kept_steps: int, resumed: list) -> tuple[int, int]:
    """(batches applied twice, batches skipped) of the model that finished the job.

    The finished model carries the first ``kept_steps`` steps of the killed run (those in
    the checkpoint it resumed from; their positions follow from the step number), then
    every step the relaunched run trained, at the positions it reported.
    """
    seen = [
        ((s - 1) // steps_per_epoch, (s - 1) % steps_per_epoch) for s in range(1, kept_steps + 1)
    ]
    seen += [tuple(p[:2]) for p in resumed]
    twice = len(seen) - len(set(seen))
    epochs = max(e for e, _ in seen) + 1
    expected = {(e, b) for e in range(epochs) for b in range(steps_per_epoch)}
    return twice, len(expected - set(seen))


def _own_cost(times: dict) -> float:
    return times["make_or_restore"] + times["fit_start_to_first_step"]


def _count(nested) -> int:
    return sum(_count(x) for x in nested) if isinstance(nested, list) else 1


def _round(job: list[str], env: dict, workdir: Path, tag: str, kill_at: int, keras_backup: bool):
    directory = workdir / tag
    shutil.rmtree(directory, ignore_errors=True)
    extra = ["--keras-backup"] if keras_backup else []
    fresh = _launch([*job, *extra, "--dir", str(directory), "--sigkill-at-step", str(kill_at)], env)
    if fresh["returncode"] != -9:
        raise RuntimeError(
            f"bench_restart: the fresh job exited {fresh['returncode']}, not by its SIGKILL:\n"
            f"{fresh['stderr_tail']}"
        )
    sizes = [p.stat().st_size for p in directory.rglob("*") if p.is_file()]
    resumed = _launch([*job, *extra, "--dir", str(directory)], env)
    if resumed["returncode"] != 0 or resumed["final"] is None:
        raise RuntimeError(
            f"bench_restart: the relaunched job exited {resumed['returncode']}:\n"
            f"{resumed['stderr_tail']}"
        )
    return fresh, resumed, max(sizes, default=0)


def measure(
    *,
    rounds: int = 5,
    save_freq: int = 10,
    kill_at: int = 25,
    epochs: int = 2,
    examples: int = 512,
    per_replica_batch: int = 16,
    width: int = 1024,
    hidden2: int = 1024,
    devices: int | None = None,
    baseline: bool = True,
    warmup: int = 1,
) -> dict:
    """Runs ``rounds`` kill-and-relaunch rounds; returns the figures as a dict.

    Args:
        rounds: fresh/relaunch pairs (A B A B ...).
        save_freq: step checkpoint interval; ``kill_at`` should not be a multiple of it.
        kill_at: global step after which the fresh job SIGKILLs itself.
        epochs, examples, per_replica_batch: the job's training length and data.
        width, hidden2: hidden layer sizes (1024, 1024: about 1.07M parameters).
        devices: ``TFDIST_CPU_DEVICES`` for the jobs (None: one device).
        baseline: also run one round with Keras's ``BackupAndRestore``.
        warmup: unrecorded rounds first (cold file caches slow the first launch).
    """
    for name, value in (("rounds", rounds), ("save_freq", save_freq), ("kill_at", kill_at)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"measure: {name} must be a positive int. Received: {name}={value!r}")
    replicas = devices or 1
    steps_per_epoch = examples // (per_replica_batch * replicas)
    if kill_at >= steps_per_epoch * epochs:
        raise ValueError(
            f"measure: kill_at must fall inside the run ({steps_per_epoch * epochs} steps). "
            f"Received: kill_at={kill_at}"
        )
    job = [
        "--epochs", str(epochs), "--save-freq", str(save_freq), "--examples", str(examples),
        "--per-replica-batch", str(per_replica_batch), "--width", str(width),
        "--hidden2", str(hidden2), "--max-to-keep", "2",
    ]  # fmt: skip
    env = _env(devices)
    workdir = Path(tempfile.mkdtemp(prefix="tfdist-bench-restart-"))
    try:
        fresh_s, resumed_s, ratios, recomputed, twice, skipped = [], [], [], [], [], []
        own_fresh, own_resumed = [], []  # restore + fit start to first step, in-process
        ckpt_bytes = 0
        for i in range(warmup):
            _round(job, env, workdir, f"warmup{i}", kill_at, False)
        for i in range(rounds):
            fresh, resumed, size = _round(job, env, workdir, f"round{i}", kill_at, False)
            ckpt_bytes = max(ckpt_bytes, size)
            fresh_s.append(fresh["to_first_step"])
            resumed_s.append(resumed["to_first_step"])
            ratios.append(resumed["to_first_step"] / fresh["to_first_step"])
            restored_step = resumed["final"]["restored"]["step"]
            recomputed.append(kill_at - restored_step)
            t, s = _lineage(steps_per_epoch, restored_step, resumed["final"]["trained"])
            twice.append(t)
            skipped.append(s)
            own_fresh.append(_own_cost(fresh["first"]["times"]))
            own_resumed.append(_own_cost(resumed["first"]["times"]))
        figures = {
            "rounds": rounds,
            "warmup_rounds": warmup,
            "model_parameters": _count(resumed["final"]["weights"]),
            "checkpoint_mb": round(ckpt_bytes / 2**20, 2),
            "steps_per_epoch": steps_per_epoch,
            "save_freq": save_freq,
            "killed_after_step": kill_at,
            "fresh_to_first_step_s": [round(v, 2) for v in fresh_s],
            "resumed_to_first_step_s": [round(v, 2) for v in resumed_s],
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
            "ratio_goal_met": statistics.median(ratios) <= 1.2,
            # The part a restart adds or changes, without interpreter and TensorFlow start-up
            # (which dominate, and vary by seconds on a busy machine): make_or_restore, then
            # fit's start (tracing, skipping the trained batches) to the first step's end.
            "restore_and_first_step_fresh_s": round(statistics.median(own_fresh), 3),
            "restore_and_first_step_resumed_s": round(statistics.median(own_resumed), 3),
            "restart_extra_s": round(
                statistics.median(r - f for r, f in zip(own_resumed, own_fresh, strict=True)), 3
            ),
            "steps_recomputed": max(recomputed),
            "steps_recomputed_goal_met": max(recomputed) <= save_freq,
            "batches_applied_twice": max(twice),
            "batches_skipped": max(skipped),
            "replicas": replicas,
        }
        if baseline:
            fresh, resumed, _ = _round(job, env, workdir, "keras", kill_at, True)
            restored_step = resumed["first"]["step"] - 1  # iterations before its first step
            t, s = _lineage(steps_per_epoch, restored_step, resumed["final"]["trained"])
            figures["keras_backup_and_restore"] = {
                "resumed_at": resumed["first"]["at"],
                "restored_step": restored_step,
                "batches_applied_twice": t,
                "batches_skipped": s,
                "ratio": round(resumed["to_first_step"] / fresh["to_first_step"], 3),
            }
        return figures
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(*, quick: bool = False) -> dict:
    """The figures for the benchmark suite: ``quick`` is one round on a small model."""
    if quick:
        return measure(rounds=1, width=64, hidden2=0, examples=256, baseline=False)
    return measure()


# --- the table's rows (python -m tools.bench, tools/bench/suite.py) --------------------


def _figures_restart(quick: bool, pairs: int) -> dict:
    return run(quick=True) if quick else measure(rounds=pairs)


def _result_restart(f: dict, quick: bool) -> harness.Result:
    ratios = harness.ratios(f["resumed_to_first_step_s"], f["fresh_to_first_step_s"])
    work_ok = f["batches_applied_twice"] == 0 and f["steps_recomputed_goal_met"]
    return harness.Result(
        ratios,
        met=statistics.median(ratios) <= 1.2 and work_ok,
        a_values=f["resumed_to_first_step_s"],
        b_values=f["fresh_to_first_step_s"],
        notes=f"after kill -9 at step {f['killed_after_step']} (save_freq "
        f"{f['save_freq']}): {f['steps_recomputed']} step(s) recomputed, "
        f"{f['batches_applied_twice']} batch(es) applied twice, {f['batches_skipped']} "
        f"skipped; restore + first step adds {f['restart_extra_s']} s in-process",
    )


TABLE_ROWS = [
    harness.Row(
        "restart",
        "relaunch after kill -9 to first resumed step",
        "fresh start to first step",
        "<= 1.2, 0 batches twice",
        _figures_restart,
        _result_restart,
    )
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, small model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--devices", type=int, default=None, help="TFDIST_CPU_DEVICES")
    args = parser.parse_args(argv)
    if args.quick:
        figures = run(quick=True)
    else:
        figures = measure(rounds=args.rounds, devices=args.devices)
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
