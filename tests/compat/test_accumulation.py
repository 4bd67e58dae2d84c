"""Gradient accumulation all-reduces once per window and trains what one device trains.

``keras_tf_gradient_accumulation`` (tfdist/compat/gradient_accumulation.py) sums each replica's
gradients locally and all-reduces the window's sum once, on its k-th micro-step.
``tests/scripts/accumulation_job.py`` trains every variant (momentum; AdamW with weight
decay and ``global_clipnorm``; ``clipnorm``; no accumulation) with k=4 in one process and
counts, at run time, the gradient all-reduces that ran. The upstream failure with the fix
excluded is shown by tests/compat/test_compat.py::test_mirrored_upstream_failures_and_fixes.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import SCRIPTS, equivalence, last_json_line, launch_cli, popen_python

SCRIPT = str(SCRIPTS / "accumulation_job.py")
TOL = 1e-5
ACCUMULATING = ("sgd_momentum", "adamw_decay_global_clipnorm", "sgd_clipnorm")


def max_diff(a, b) -> float:
    return equivalence.max_difference(a, b)


def run_side_by_side(envs: dict[str, dict]) -> dict[str, dict]:
    """The job once per ``{name: environment}``, side by side (most of each is
    TensorFlow's import): ``{name: result}``."""
    procs = {name: popen_python(str(SCRIPT), **env) for name, env in envs.items()}
    try:
        outputs = {name: proc.communicate(timeout=300) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    for name, proc in procs.items():
        assert proc.returncode == 0, outputs[name][1][-5000:]
    return {name: last_json_line(out) for name, (out, _) in outputs.items()}


@pytest.fixture(scope="module")
def runs() -> dict:
    """1 device and 2 logical devices, side by side."""
    return run_side_by_side({devices: {"TFDIST_CPU_DEVICES": devices} for devices in ("1", "2")})


def check_topology(result: dict, replicas: int) -> None:
    assert result["replicas"] == replicas, f"ran on {result['replicas']} replica(s), not {replicas}"


def assert_like_one_device(result: dict, reference: dict) -> None:
    """Weights, one all-reduce per window, and the mid-window save/resume, vs 1 device."""
    for name in ACCUMULATING:
        assert max_diff(result["weights"][name], reference["weights"][name]) < TOL, name
        # One all-reduce of the gradients per window of 4 micro-steps (4 before the change).
        assert result["reduces_per_window"][name] == 1, result["reduces_per_window"]
    # The counter counts what it claims: without accumulation, one per micro-step.
    assert result["reduces_per_window"]["sgd_momentum_plain"] == 4
    # Saved mid-window, the accumulators hold what one device's hold (the window's sum so
    # far, not one replica's share), so the checkpoint resumes exactly on any world size.
    for name, run in result["mid_window"].items():
        one = reference["mid_window"][name]
        assert max_diff(run["saved_accumulators"], one["saved_accumulators"]) < TOL, name
        assert max_diff(run["resumed"], one["straight"]) < TOL, name
        assert max_diff(run["straight"], one["straight"]) < TOL, name


@pytest.mark.devices
@pytest.mark.slow
def test_two_devices_reduce_once_per_window_and_equal_one_device(runs):
    reference, mirrored = runs["1"], runs["2"]
    check_topology(reference, 1)
    check_topology(mirrored, 2)
    # Accumulation did something: the same optimizer without it ends elsewhere.
    assert (
        max_diff(reference["weights"]["sgd_momentum"], reference["weights"]["sgd_momentum_plain"])
        > 1e-3
    )
    # One device: the save/load mid-window changes nothing, and something was accumulated.
    for name, one in reference["mid_window"].items():
        assert max_diff(one["resumed"], one["straight"]) < TOL, name
        zeros = [np.zeros_like(np.asarray(a, float)) for a in one["saved_accumulators"]]
        assert equivalence.max_difference(zeros, one["saved_accumulators"]) > 1e-3
    assert_like_one_device(mirrored, reference)


@pytest.mark.multiworker
@pytest.mark.slow
def test_two_workers_reduce_once_per_window_and_equal_one_device(runs):
    proc = launch_cli("-n", "2", SCRIPT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    workers = last_json_line(proc.stdout.replace("[w0] ", ""))
    check_topology(workers, 2)
    assert_like_one_device(workers, runs["1"])
