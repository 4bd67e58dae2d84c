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

import numpy as np
import pytest

from conftest import SCRIPTS, child_env, last_json_line, launch_cli

JOB = SCRIPTS / "world_size_job.py"
DIE_AFTER = 13  # checkpoints every 5 steps: the resume starts at step 10, epoch 1 batch 2


def _run(ckpt, topology: str, *extra: str) -> dict:
    """Runs the job as ``topology`` ('1' or '2' devices, 'w2' two workers); the chief's JSON."""
    argv = [str(JOB), "--dir", str(ckpt), *extra]
    if topology == "w2":
        proc = launch_cli("-n", "2", *argv, timeout=300)
    else:
        proc = subprocess.run(
            [sys.executable, *argv],
            env=child_env(TFDIST_CPU_DEVICES=topology),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    if extra:  # it died on purpose: no result line
        return {}
    lines = [line.split("] ", 1)[-1] for line in proc.stdout.splitlines()]
    results = [r for r in map(_json_or_none, lines) if r is not None]
    return next(r for r in results if r["worker"] == 0)


def _json_or_none(line: str):
    try:
        return last_json_line(line)
    except (ValueError, AssertionError, IndexError):
        return None


def _max_diff(a: dict, b: dict) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(a["weights"], b["weights"], strict=True)
    )


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.multiworker
def test_a_checkpoint_resumes_on_another_world_size_with_the_same_global_batch(tmp_path):
    reference = _run(tmp_path / "reference", "1")
    assert reference["steps"] == 24 and reference["resumed_step"] is None
    diffs = {}
    for first, second in (("1", "2"), ("2", "1"), ("1", "w2"), ("w2", "1")):
        ckpt = tmp_path / f"{first}-to-{second}"
        _run(ckpt, first, "--die-after-step", str(DIE_AFTER))
        resumed = _run(ckpt, second)
        assert resumed["resumed_step"] == 10, resumed["resumed_step"]
        assert resumed["steps"] == 24
        assert resumed["replicas"] == (2 if second in ("2", "w2") else 1)
        diffs[f"{first} -> {second}"] = _max_diff(resumed, reference)
    assert max(diffs.values()) < 1e-5, diffs
