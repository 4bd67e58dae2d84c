"""``tfdist info``: the bug-report fields, on both backends, without starting anything."""

from __future__ import annotations

import json

import pytest

from tfdist.core import engines

from conftest import run_python

# What an elastic tfdist launch gives its workers (tfdist/launch/elastic.py).
RENDEZVOUS = "c10d store at 127.0.0.1:29400, job 'run42', round 2 of 2 node(s), this node 0"


@pytest.mark.devices
def test_info_json_has_every_bug_report_field():
    proc = run_python(
        "import sys; from tfdist.cli import main; sys.exit(main(['info', '--json']))",
        TFDIST_CPU_DEVICES="2",
        TFDS_DATA_DIR="/nonexistent/tfds",
        TFDIST_HEARTBEAT_TIMEOUT="30",
        KUBERNETES_SERVICE_HOST="10.96.0.1",  # a pod of an Indexed Job: a TrainJob's
        JOB_COMPLETION_INDEX="0",
        TFDIST_RESTART=None,
        RAY_ADDRESS=None,
        TFDIST_RENDEZVOUS=RENDEZVOUS,
    )
    report = json.loads(proc.stdout)
    assert report["rendezvous"] == RENDEZVOUS
    assert report["engine"]["name"] == "trainjob"
    assert report["engine"]["read"]["JOB_COMPLETION_INDEX"] == "0"
    system = report["system"]
    assert system["cpu_cores"] >= 1 and system["memory_gib"] > 0 and system["os"]
    assert report["versions"]["tensorflow"] and report["versions"]["numpy"]
    assert set(report["build"]) == {"cuda_build", "cuda", "cudnn"}
    assert report["gpus"] == []  # no nvidia-smi on a CPU machine
    assert report["environment"]["TFDIST_HEARTBEAT_TIMEOUT"] == "30"
    assert report["mnist"] == {"data_dir": "/nonexistent/tfds", "present": False}
    names = {fix["name"]: fix for fix in report["fixes"]}
    assert names["keras_tf_multi_worker_mean"]["state"] == "applied"
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
    assert "\nengine:        " in proc.stdout
    assert "\nrendezvous:    none (not a worker of an elastic tfdist launch)" in proc.stdout
    assert "  not needed:  keras_jax_initialize_once" in proc.stdout


@pytest.mark.jax
@pytest.mark.devices
def test_info_under_jax_reports_the_mesh_and_never_joins_the_job():
    """In process 1 of a TrainJob whose coordinator is not there: describing the process
    must not register with it (that would wait, or take a running process's place)."""
    proc = run_python(
        "import sys; from tfdist.cli import main; sys.exit(main(['info']))",
        KERAS_BACKEND="jax",
        TFDIST_CPU_DEVICES="4",
        JAX_COORDINATOR_ADDRESS="127.0.0.1:9",  # nothing listens there
        JAX_NUM_PROCESSES="2",
        JAX_PROCESS_ID="1",
        TFDIST_REGISTER_TIMEOUT="600",  # joining would outlast run_python's timeout
        # A fresh interpreter: these JAX_* variables would be a warm process's own, which
        # imports Keras (and starts jax) with them before the job runs.
        warm=False,
    )
    assert "backend:       jax" in proc.stdout and "mesh {'batch': 4}" in proc.stdout
    assert "replicas=4" in proc.stdout
    assert "cluster:       JAX_COORDINATOR  2 worker(s), this is worker:1" in proc.stdout


K8S = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": "mnist-worker-1"}
TF_CONFIG = '{"cluster": {"worker": ["a:2222", "b:2222"]}, "task": {"type": "worker", "index": 1}}'


@pytest.mark.parametrize(
    "env, ray, name, within",
    [
        ({}, False, "none", []),
        ({**K8S, "TF_CONFIG": TF_CONFIG}, False, "tfjob", []),
        ({**K8S, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, False, "trainjob", []),
        ({**K8S, "JOB_COMPLETION_INDEX": "0"}, False, "trainjob", []),
        ({**K8S}, False, "kubernetes", []),
        ({"TF_CONFIG": TF_CONFIG}, False, "none", []),  # TF_CONFIG by hand: no engine
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_TASKS": "2"}, False, "slurm", []),
        ({"TFDIST_RESTART": "0", "RANK": "1", "SLURM_JOB_ID": "7"}, False, "launch", ["slurm"]),
        ({**K8S, "TFDIST_RESTART": "1", "TF_CONFIG": TF_CONFIG}, False, "launch", ["kubernetes"]),
        ({"RAY_RAYLET_PID": "12", "TF_CONFIG": TF_CONFIG}, False, "ray", []),
        ({**K8S, "TF_CONFIG": TF_CONFIG}, True, "ray", ["kubernetes"]),  # Ray Train on KubeRay
    ],
)
def test_engine_is_detected_from_the_environment(env, ray, name, within):
    engine = engines.detect(env, ray_initialized=ray)
    assert (engine.name, list(engine.within)) == (name, within)


def test_engine_reports_what_it_read():
    engine = engines.detect({**K8S, "TF_CONFIG": TF_CONFIG, "OTHER": "x"})
    assert engine.summary() == {
        "name": "tfjob",
        "title": "Kubeflow TFJob",
        "read": {
            **K8S,
            "TF_CONFIG": {"task": "worker:1", "workers": 2, "addresses": ["a:2222", "b:2222"]},
        },
        "within": [],
    }
    trainjob = {**K8S, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JOB_COMPLETION_INDEX": "1"}
    assert engines.detect(trainjob).read == trainjob
    ray = engines.detect({"RAY_ADDRESS": "auto"}, ray_initialized=True).read
    assert ray == {"RAY_ADDRESS": "auto", "ray_initialized": True}
    bad = engines.detect({**K8S, "TF_CONFIG": "{not json"}).read["TF_CONFIG"]
    assert bad["error"].startswith("TF_CONFIG is not a valid cluster")
    with pytest.raises(TypeError, match=r"environ must be a mapping.*Received: environ=\['x'\]"):
        engines.detect(["x"])
