"""A checkpoint resumes on another world size with the same global batch, exactly.

tests/scripts/world_size_job.py trains with a fixed global batch and a schedule by
optimizer step; a first run dies abruptly after step 13 (the last checkpoint is at step
10, mid-epoch), and a second run on another number of replicas resumes it. Each pair ends
within 1e-5 of one uninterrupted run on one device: 1 device -> 2 devices, 2 devices ->
1 device, 1 worker -> 2 workers (``tfdist launch``) and 2 workers -> 1 worker.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import SCRIPTS, child_env, equivalence, last_json_line, launch_cli

JOB = SCRIPTS / "world_size_job.py"
DIE_AFTER = 13  # checkpoints every 5 steps: the resume starts at step 10, epoch 1 batch 2


TOPOLOGY = {"1": (1, 1), "2": (2, 1), "w2": (2, 2)}  # topology -> (replicas, workers)


def run_job(ckpt, topology: str, *extra: str, **env) -> dict:
    """Runs the job as ``topology`` ('1' or '2' devices, 'w2' two workers); the chief's JSON
    (the line a dying run prints as it dies, too)."""
    argv = [str(JOB), "--dir", str(ckpt), *extra]
    if topology == "w2":
        proc = launch_cli("-n", "2", *argv, timeout=300, **env)
    else:
        proc = subprocess.run(
            [sys.executable, *argv],
            env=child_env(TFDIST_CPU_DEVICES=topology, **env),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = [line.split("] ", 1)[-1] for line in proc.stdout.splitlines()]
    results = [r for r in map(_json_or_none, lines) if r is not None]
    return next(r for r in results if r["worker"] == 0)


def _json_or_none(line: str):
    try:
        return last_json_line(line)
    except (ValueError, AssertionError, IndexError):
        return None


def check_topology(result: dict, topology: str) -> None:
    assert (result["replicas"], result["workers"]) == TOPOLOGY[topology], (topology, result)


def check_died(died: dict, topology: str) -> None:
    """The first run ran as ``topology`` and died after step ``DIE_AFTER``, unresumed."""
    check_topology(died, topology)
    assert died["died"] and died["steps"] == DIE_AFTER and died["resumed_step"] is None, died


def check_resumed(resumed: dict, topology: str, reference: dict, what: str = "") -> None:
    """The second run ran as ``topology``, resumed step 10's checkpoint and ended as the
    uninterrupted run on one device."""
    check_topology(resumed, topology)
    assert resumed["resumed_step"] == 10, resumed["resumed_step"]
    assert resumed["steps"] == 24
    equivalence.assert_close(reference["weights"], resumed["weights"], 1e-5, what)


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.multiworker
def test_a_checkpoint_resumes_on_another_world_size_with_the_same_global_batch(tmp_path):
    reference = run_job(tmp_path / "reference", "1")
    check_topology(reference, "1")
    assert reference["steps"] == 24 and reference["resumed_step"] is None
    for first, second in (("1", "2"), ("2", "1"), ("1", "w2"), ("w2", "1")):
        ckpt = tmp_path / f"{first}-to-{second}"
        check_died(run_job(ckpt, first, "--die-after-step", str(DIE_AFTER)), first)
        check_resumed(run_job(ckpt, second), second, reference, f"{first} -> {second}")
