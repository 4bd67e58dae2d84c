"""The README's Usage block is a complete script: it runs as written, without warnings
(any form, save tfdist.core.quiet's harmless list), on 1 device, on 2 logical devices and as
2 workers under ``tfdist launch``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tfdist.core import quiet

from conftest import REPO, child_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.mnist,
]

RESULT = re.compile(r"replicas=(\d+) global_batch=(\d+) accuracy=([0-9.]+)")
# Every form a warning takes: Python's (``UserWarning: ...``), Python logging's
# (``WARNING:tensorflow:``, ``WARNING:absl:``), absl/TensorFlow C++ lines at W, E or F
# (``W0000 00:00:...``, ``2026-11-24 01:02:03.4: W tensorflow/...``).
WARNING_LINE = re.compile(
    r"Warning\b|^WARNING[:\s]|^[WEF]\d{4} \d\d:\d\d|^\d{4}-\d\d-\d\d [\d:.]+: [WEF] "
)


def usage_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Usage\n", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "README.md: no ```python block under ## Usage"
    return found.group(1)


def _run(tmp_path, command, **env):
    script = tmp_path / "usage.py"
    script.write_text(usage_block())
    # The default warning filters, as a user's `python usage.py` has them.
    environ = child_env(**env)
    environ.pop("TF_CPP_MIN_LOG_LEVEL")  # tfdist itself must keep TensorFlow quiet
    environ.pop("PYTHONWARNINGS", None)
    proc = subprocess.run(
        [*command, str(script)],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def _check(output: str, replicas: int) -> float:
    results = RESULT.findall(output)
    assert len(results) == 1, f"one chief line expected:\n{output[-4000:]}"  # chief only
    got_replicas, global_batch, accuracy = results[0]
    assert (int(got_replicas), int(global_batch)) == (replicas, 64 * replicas)
    warned = [
        line
        for line in output.splitlines()
        if WARNING_LINE.search(line.removeprefix("[w0] ").removeprefix("[w1] "))
        and not quiet.is_harmless(line)
    ]
    assert not warned, "the Usage block must run without warnings:\n" + "\n".join(warned)
    return float(accuracy)


@pytest.mark.parametrize("devices", [1, 2])
def test_usage_block_on_local_devices(tmp_path, devices):
    output = _run(tmp_path, [sys.executable], TFDIST_CPU_DEVICES=str(devices))
    assert _check(output, devices) > 0.85
    assert (tmp_path / "model.keras").is_file()
    # Run again in the same folder: the job is finished, nothing retrains, same model.
    again = _run(tmp_path, [sys.executable], TFDIST_CPU_DEVICES=str(devices))
    assert _check(again, devices) == _check(output, devices)
    assert "Epoch 1/2" not in again


def test_usage_block_under_launch_with_two_workers(tmp_path):
    output = _run(tmp_path, [sys.executable, "-m", "tfdist", "launch", "-n", "2"])
    assert _check(output, 2) > 0.85
    assert (tmp_path / "model.keras").is_file()
    assert not list(tmp_path.rglob("*.tmp*")), "no temporary files left behind"
