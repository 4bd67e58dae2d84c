"""tools/benchmark.py --quick runs every row end to end (a smoke test: no timing is asserted)."""

from __future__ import annotations

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
        "multi-worker-step", "cli",
    ]  # fmt: skip
    for row in figures["rows"]:
        assert row["error"] is None, row
        assert row["ratios"] and all(r > 0 for r in row["ratios"]), row
        # the table shows the same median as the JSON
        assert f"| {row['name']} |" in proc.stdout and f"{row['median']:.3g}" in proc.stdout
    assert figures["machine"]["cores"] == os.cpu_count()
    assert proc.stdout.startswith("machine: ")
