"""``compile(jit_compile=True)`` under a strategy: fit and evaluate are refused before the
first step with an error naming ``jit_compile=False``; predict gives one device's
predictions, and one device works.

Upstream, XLA compiles Keras's whole distributed step onto one device: a graph-execution
error after start-up (keras#19005), shown with the fix excluded.
"""

from __future__ import annotations

import json

import pytest

from conftest import SCRIPTS, equivalence, launch_cli, run_python

JOB = SCRIPTS / "jit_compile_job.py"
FIX = "keras_tf_jit_compile_refused_under_strategy"


def _result(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if "JIT " in line)
    return json.loads(line[line.index("JIT ") + len("JIT ") :])


def _run(topology: str, **env) -> dict:
    if topology == "2 workers":
        proc = launch_cli("-n", "2", str(JOB), timeout=300, **env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return _result(proc.stdout)
    if topology == "2 devices":
        env["TFDIST_CPU_DEVICES"] = "2"
    code = f"import runpy; runpy.run_path({str(JOB)!r}, run_name='__main__')"
    return _result(run_python(code, timeout=300, **env).stdout)


def check_topology(result: dict, replicas: int, workers: int) -> None:
    assert (result["replicas"], result["workers"]) == (replicas, workers), result


def check_refused(result: dict, one_device: dict, replicas: int) -> None:
    """predict gives one device's predictions; evaluate and fit are refused, naming
    ``jit_compile=False``."""
    assert result["predict"] == "ok", result["predict"]
    equivalence.assert_close(one_device["predictions"], result["predictions"], 1e-5, "predict")
    for call in ("evaluate", "fit"):
        assert result[call].startswith("ValueError: tfdist: compile(jit_compile=True)")
        assert "jit_compile=False" in result[call] and f"{replicas} replicas" in result[call]


@pytest.fixture(scope="module")
def one_device() -> dict:
    result = _run("1 device")
    check_topology(result, 1, 1)
    return result


@pytest.mark.devices
@pytest.mark.multiworker
@pytest.mark.parametrize("topology, replicas, workers", [("2 devices", 2, 1), ("2 workers", 2, 2)])
def test_jit_compile_is_refused_before_the_first_step(one_device, topology, replicas, workers):
    result = _run(topology)
    check_topology(result, replicas, workers)
    check_refused(result, one_device, replicas)


@pytest.mark.devices
def test_jit_compile_on_one_device_is_untouched(one_device):
    calls = {call: one_device[call] for call in ("predict", "evaluate", "fit")}
    assert calls == {"predict": "ok", "evaluate": "ok", "fit": "ok"}
    assert len(one_device["predictions"]) == 64


@pytest.mark.devices
@pytest.mark.upstream_failure("keras_tf_jit_compile_refused_under_strategy")
def test_upstream_fails_inside_the_graph():
    result = _run("2 devices", TFDIST_COMPAT_EXCLUDE=FIX)
    assert result["fit"].startswith("InvalidArgumentError"), result["fit"]
    assert "replica_1" in result["fit"] and "device" in result["fit"]
