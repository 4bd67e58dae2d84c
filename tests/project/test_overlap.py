"""The overlap experiment's pure parts (tools/bench/overlap.py) and the exposed-communication
report (tools/bench/step_breakdown.py). Timings are never asserted: only that the figures are
computed from their parts and printed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, child_env, tool_module


def test_packs_start_from_the_last_gradients_and_hold_at_least_the_pack_size():
    bo = tool_module("bench.overlap")
    assert bo.reverse_packs([40, 1200, 20], 1000) == [[2, 1], [0]]
    assert bo.reverse_packs([5, 5, 5], 1) == [[2], [1], [0]]
    assert bo.reverse_packs([5, 5, 5], 10**9) == [[2, 1, 0]]
    with pytest.raises(ValueError, match=r"Received: pack_bytes=0"):
        bo.reverse_packs([5], 0)


def test_overlap_summary_gives_ratios_to_keras_with_their_range():
    bo = tool_module("bench.overlap")
    runs = [
        {"ms": {"compute": 80.0, "keras": 100.0, "inback-256k": 90.0},
         "exposed_ms": {"keras": 20.0, "inback-256k": 10.0},
         "max_weight_diff": {"keras": 0.0, "inback-256k": 1e-7}},
        {"ms": {"compute": 90.0, "keras": 120.0, "inback-256k": 132.0},
         "exposed_ms": {"keras": 30.0, "inback-256k": 42.0},
         "max_weight_diff": {"keras": 0.0, "inback-256k": 2e-7}},
    ]  # fmt: skip
    rows = bo.summarise(runs)
    assert rows["inback-256k"]["ratio_to_keras"] == pytest.approx(
        {"median": 1.0, "min": 0.9, "max": 1.1}
    )
    assert rows["inback-256k"]["exposed_ms"] == {"median": 26.0, "min": 10.0, "max": 42.0}
    assert (
        rows["inback-256k"]["max_weight_diff"] == 2e-7 and "ratio_to_keras" not in rows["compute"]
    )


def test_unknown_model_is_an_error_naming_the_choices():
    sb = tool_module("bench.step_breakdown")
    with pytest.raises(ValueError, match=r"Received: model='vgg'"):
        sb.measure(model="vgg")


@pytest.mark.slow
@pytest.mark.multiworker
def test_step_breakdown_quick_prints_the_exposed_communication_of_both_columns(tmp_path):
    out = tmp_path / "breakdown.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench.step_breakdown", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=child_env(), cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    for where in ("workers", "devices"):
        ms = figures[where]
        assert figures["exposed_comm_ms"][where] == pytest.approx(ms["step"] - ms["compute"])
        assert ms["compute"] > 0 and ms["step"] > 0
    exposed = figures["exposed_comm_ms"]
    assert (
        f"exposed communication (step - compute), ms/step: 2 workers {exposed['workers']:.2f}, "
        f"2 devices {exposed['devices']:.2f}" in proc.stdout
    )
    assert figures["machine"]["cores"] >= 1 and len(figures["machine"]["load_avg"]) == 3
    assert proc.stdout.startswith("machine: ") and figures["model"] == "mlp"
