"""tools/benchmark.py --quick runs every row end to end (a smoke test: no timing is asserted)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, child_env

MNIST_ON_DISK = (
    Path(os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets"))
    .expanduser()
    .joinpath("mnist")
    .is_dir()
)


def test_unknown_row_is_an_error_naming_the_choices():
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "benchmark.py"), "--only", "nope"],
        capture_output=True, text=True, timeout=60, env=child_env(),
    )  # fmt: skip
    assert (
        proc.returncode == 2
        and "unknown name(s) ['nope']" in proc.stderr
        and "'cli'" in proc.stderr
    )


@pytest.mark.slow
@pytest.mark.skipif(not MNIST_ON_DISK, reason="needs MNIST on disk (set TFDS_DATA_DIR)")
def test_quick_suite_prints_every_row_and_writes_the_same_figures_as_json(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "benchmark.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=1500, env=child_env(), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    names = [row["name"] for row in figures["rows"]]
    assert names == [
        "overhead", "pipeline", "input-bound", "time-to-accuracy", "restart", "launcher",
        "multi-worker-step", "checkpoint-save", "checkpoint-restore", "cli",
    ]  # fmt: skip
    for row in figures["rows"]:
        assert row["error"] is None, row
        assert row["ratios"] and all(r > 0 for r in row["ratios"]), row
        # the table shows the same median as the JSON
        assert f"| {row['name']} |" in proc.stdout and f"{row['median']:.3g}" in proc.stdout
    assert figures["machine"]["cores"] == os.cpu_count()
    assert proc.stdout.startswith("machine: ")


def _tool(name: str):
    tools = str(REPO / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module(name)


def test_scaling_rows_are_efficiency_against_one_worker_one_device():
    bs = _tool("bench_scaling")
    rows = bs.table_rows("jax", {"1x1": [100.0, 120.0], "2x1": [50.0, 70.0], "4x2": [30.0]}, 128)
    assert [(r["workers"], r["devices_per_worker"], r["replicas"]) for r in rows] == [
        (1, 1, 1), (2, 1, 2), (4, 2, 8),
    ]  # fmt: skip
    assert [round(r["efficiency"], 3) for r in rows] == [1.0, 0.545, 0.273]
    assert rows[0]["ms_per_step"] == pytest.approx(1000 * 128 / 110)


def test_scaling_rounds_alternate_their_order():
    bs = _tool("bench_scaling")
    order = []
    runs = {name: (lambda n=name: order.append(n) or 1.0) for name in ("a", "b", "c")}
    assert bs.rounds_of(runs, 2) == {"a": [1.0, 1.0], "b": [1.0, 1.0], "c": [1.0, 1.0]}
    assert order == ["a", "b", "c", "c", "b", "a"]


def test_scaling_commands_use_the_launcher_and_logical_devices():
    bs = _tool("bench_scaling")
    cmd, env = bs.command("tensorflow", 1, 2, ["--steps", "5"])
    assert cmd[-2:] == ["--steps", "5"]
    assert cmd[1].endswith("mw_bench_job.py") and env["TFDIST_CPU_DEVICES"] == "2"
    cmd, env = bs.command("jax", 4, 2, [])
    assert cmd[2:8] == ["tfdist", "launch", "-n", "4", "--devices-per-worker", "2"]
    assert cmd[-1].endswith("jax_bench_job.py") and env["KERAS_BACKEND"] == "jax"
    assert "TFDIST_CPU_DEVICES" not in env


def test_step_breakdown_explains_the_step_from_its_parts():
    sb = _tool("step_breakdown")
    ms = {"input": 1.0, "compute": 5.0, "allreduce": 4.0, "step": 8.0, "fit": 11.0,
          "fit_accuracy": 12.5}  # fmt: skip
    assert sb.derived(ms) == {
        "input": 1.0, "compute_without_input": 4.0, "exposed_allreduce": 3.0,
        "python_callbacks": 3.0, "fit": 11.0, "metrics": 1.5,
    }  # fmt: skip
    table = sb.format_table(
        {"workers": ms, "devices": {k: v / 2 for k, v in ms.items()}, "pairs": 1, "rounds": 1,
         "calls": 2, "global_batch": 128}
    )  # fmt: skip
    assert (
        "| fit | 11.00 | 5.50 | 2.00 |" in table
        and "| exposed_allreduce | 3.00 | 1.50 | +1.50 |" in table
    )


def test_bench_comm_names_its_variants():
    bc = _tool("bench_comm")
    with pytest.raises(ValueError, match=r"unknown variant. Received: name='x'"):
        bc.measure("x")
    assert {"ring", "pack-64k", "pack-256k"} <= set(bc.VARIANTS)
