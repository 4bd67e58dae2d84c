"""``compile(jit_compile=True)`` under a strategy: fit and evaluate are refused before the
first step with an error naming ``jit_compile=False``; predict and one device work.

Upstream, XLA compiles Keras's whole distributed step onto one device: a graph-execution
error after start-up (keras#19005), shown with the fix excluded.
"""

from __future__ import annotations

import json

import pytest

from conftest import SCRIPTS, launch_cli, run_python

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


@pytest.mark.devices
@pytest.mark.multiworker
@pytest.mark.parametrize("topology, replicas, workers", [("2 devices", 2, 1), ("2 workers", 2, 2)])
def test_jit_compile_is_refused_before_the_first_step(topology, replicas, workers):
    result = _run(topology)
    assert (result["replicas"], result["workers"]) == (replicas, workers)
    assert result["predict"] == "ok"
    for call in ("evaluate", "fit"):
        assert result[call].startswith("ValueError: tfdist: compile(jit_compile=True)")
        assert "jit_compile=False" in result[call] and f"{replicas} replicas" in result[call]


@pytest.mark.devices
def test_jit_compile_on_one_device_is_untouched():
    result = _run("1 device")
    assert result == {"replicas": 1, "workers": 1, "predict": "ok", "evaluate": "ok", "fit": "ok"}


@pytest.mark.devices
@pytest.mark.upstream_failure("keras_tf_jit_compile_refused_under_strategy")
def test_upstream_fails_inside_the_graph():
    result = _run("2 devices", TFDIST_COMPAT_EXCLUDE=FIX)
    assert result["fit"].startswith("InvalidArgumentError"), result["fit"]
    assert "replica_1" in result["fit"] and "device" in result["fit"]
