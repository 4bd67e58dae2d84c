"""``tfdist info``: the bug-report fields, on both backends, without starting anything."""

from __future__ import annotations

import json

import pytest

from conftest import run_python


@pytest.mark.devices
def test_info_json_has_every_bug_report_field():
    proc = run_python(
        "import sys; from tfdist.cli import main; sys.exit(main(['info', '--json']))",
        TFDIST_CPU_DEVICES="2",
        TFDS_DATA_DIR="/nonexistent/tfds",
        TFDIST_HEARTBEAT_TIMEOUT="30",
    )
    report = json.loads(proc.stdout)
    system = report["system"]
    assert system["cpu_cores"] >= 1 and system["memory_gib"] > 0 and system["os"]
    assert report["versions"]["tensorflow"] and report["versions"]["numpy"]
    assert set(report["build"]) == {"cuda_build", "cuda", "cudnn"}
    assert report["gpus"] == []  # no nvidia-smi on a CPU machine
    assert report["environment"]["TFDIST_HEARTBEAT_TIMEOUT"] == "30"
    assert report["mnist"] == {"data_dir": "/nonexistent/tfds", "present": False}
    names = {fix["name"]: fix for fix in report["fixes"]}
    assert names["keras_multi_worker_mean"]["state"] == "applied"
    assert names["keras_jax_initialize_once"] == {
        "name": "keras_jax_initialize_once",
        "package": "keras",
        "state": "not needed",
        "why": "another backend",
    }


@pytest.mark.devices
def test_info_text_explains_the_one_cpu_device():
    proc = run_python("import sys; from tfdist.cli import main; sys.exit(main(['info']))")
    assert "the CPU is one device; TFDIST_CPU_DEVICES=N splits it" in proc.stdout
    assert "cores" in proc.stdout and "fixes:" in proc.stdout
    assert "  not needed:  keras_jax_initialize_once" in proc.stdout


@pytest.mark.jax
@pytest.mark.devices
def test_info_under_jax_reports_the_mesh():
    proc = run_python(
        "import sys; from tfdist.cli import main; sys.exit(main(['info']))",
        KERAS_BACKEND="jax",
        TFDIST_CPU_DEVICES="4",
    )
    assert "backend:       jax" in proc.stdout and "mesh {'batch': 4}" in proc.stdout
    assert "replicas=4" in proc.stdout
