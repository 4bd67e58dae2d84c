"""Multi-worker training for real: equivalence, SLURM, the official tutorial, faults.

Equivalence is the main check: the same model, data and global batch trained on one
device, on 2 logical devices, on 2 workers (`tfdist launch -n 2`), on 2 workers x 2
logical devices and on a (simulated, loopback) SLURM step end with the same weights,
history, evaluation and predictions, with and without gradient accumulation.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tfdist import launch
from tfdist.backends import tensorflow as strategy_mod
from tfdist.core.config import MultiWorkerTimeouts

from conftest import REPO, SCRIPTS, child_env, equivalence, last_json_line, launch_cli, run_python

FLAGS = ["--validation", "--evaluate", "--predict", "--accumulate", "2"]
COMPARED = ("weights", "loss", "val_loss", "val_mae", "evaluate", "predict")
COMPARED += ("accumulated_weights", "accumulated_loss")


def assert_same(result: dict, reference: dict) -> None:
    equivalence.assert_close(
        {key: reference[key] for key in COMPARED}, {key: result[key] for key in COMPARED}, 1e-5
    )


def worker_results(proc: subprocess.CompletedProcess) -> dict[str, dict]:
    """The JSON line each worker printed, by prefix (``[w0]``, ``[w1]``, ...)."""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    results = {}
    for line in proc.stdout.splitlines():
        prefix, _, rest = line.partition(" ")
        if rest.startswith("{"):
            results[prefix] = json.loads(rest)
    return results


@pytest.fixture(scope="module")
def reference() -> dict:
    """fit_equivalence.py on one device: what every other setup must reproduce."""
    proc = run_python(
        f"import runpy, sys; sys.argv = ['x', *{FLAGS!r}];"
        f" runpy.run_path({str(SCRIPTS / 'fit_equivalence.py')!r}, run_name='__main__')",
        TFDIST_CPU_DEVICES="1",
        timeout=300,
    )
    result = last_json_line(proc.stdout)
    assert result["replicas"] == 1
    assert result["loss"][-1] < result["loss"][0]  # it trains
    return result


# ------------------------------------------------------------------ planning, no servers


def test_timeouts_are_validated_and_read_from_the_environment():
    env = {"TFDIST_HEARTBEAT_TIMEOUT": "20", "TFDIST_COLLECTIVE_TIMEOUT": "off"}
    assert MultiWorkerTimeouts.from_env(env) == MultiWorkerTimeouts(heartbeat=20)
    assert MultiWorkerTimeouts.from_env({"TFDIST_COLLECTIVE_TIMEOUT": "90"}).collective == 90
    with pytest.raises(ValueError, match=r"TFDIST_REGISTER_TIMEOUT must be a number .*'soon'"):
        MultiWorkerTimeouts.from_env({"TFDIST_REGISTER_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match=r"TFDIST_SHUTDOWN_TIMEOUT must be a positive.*'-1'"):
        MultiWorkerTimeouts.from_env({"TFDIST_SHUTDOWN_TIMEOUT": "-1"})
    with pytest.raises(ValueError, match=r"heartbeat must be a positive number .* heartbeat=0"):
        MultiWorkerTimeouts(heartbeat=0)
    with pytest.raises(TypeError, match=r"timeouts must be a tfdist.config.MultiWorkerTimeouts"):
        strategy_mod.plan("auto", timeouts=30, environ={})


def test_slurm_step_plans_multi_worker_with_timeouts():
    env = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "TFDIST_HEARTBEAT_TIMEOUT": "7"}
    p = strategy_mod.plan("auto", environ=env)
    assert (p.kind, p.cluster_source, p.num_workers) == ("multi_worker", "SLURM", 4)
    assert p.timeouts == MultiWorkerTimeouts(heartbeat=7)
    explicit = strategy_mod.plan("auto", environ=env, timeouts=MultiWorkerTimeouts(register=9))
    assert explicit.timeouts.register == 9 and explicit.timeouts.heartbeat == 10
    with pytest.raises(ValueError, match=r"devices cannot be chosen for kind='multi_worker'"):
        strategy_mod.plan("multi_worker", devices=["/cpu:0"], environ=env)


def test_slurm_cluster_resolver_uses_the_step_and_a_port_per_task(monkeypatch):
    for key, value in {
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_STEP_NODELIST": "node[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_ID": "40123",
    }.items():
        monkeypatch.setenv(key, value)
    resolver = strategy_mod.slurm_cluster_resolver()
    base = 20000 + 40123 % 625 * 64  # from the job id: a window of 64 ports per job
    assert resolver.cluster_spec().as_dict() == {
        "worker": [f"node07:{base}", f"node07:{base + 1}", f"node08:{base}", f"node08:{base + 1}"]
    }
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    monkeypatch.setenv("TFDIST_SLURM_PORT_BASE", "31000")
    assert strategy_mod.slurm_cluster_resolver().cluster_spec().as_dict()["worker"][3] == (
        "node08:31001"
    )
    monkeypatch.setenv("TFDIST_SLURM_PORT_BASE", "80")
    with pytest.raises(ValueError, match=r"TFDIST_SLURM_PORT_BASE must be a port .*'80'"):
        strategy_mod.slurm_cluster_resolver()
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    with pytest.raises(ValueError, match=r"not a SLURM job step .* `srun --ntasks=N"):
        strategy_mod.slurm_cluster_resolver()


# ------------------------------------------------------------------ equivalence


@pytest.mark.devices
@pytest.mark.multiworker
@pytest.mark.slow
def test_same_weights_on_1_device_2_devices_2_workers_and_2x2(reference):
    script = str(SCRIPTS / "fit_equivalence.py")
    devices = last_json_line(
        run_python(
            f"import runpy, sys; sys.argv = ['x', *{FLAGS!r}];"
            f" runpy.run_path({script!r}, run_name='__main__')",
            TFDIST_CPU_DEVICES="2",
            timeout=300,
        ).stdout
    )
    workers = worker_results(launch_cli("-n", "2", script, *FLAGS))
    grid = worker_results(launch_cli("-n", "2", "--devices-per-worker", "2", script, *FLAGS))

    assert devices["replicas"] == 2 and devices["strategy"] == "MirroredStrategy"
    assert devices["variable_type"] == "MirroredVariable"  # the model's, not the process's
    assert_same(devices, reference)
    for results, replicas in ((workers, 2), (grid, 4)):
        assert set(results) == {"[w0]", "[w1]"}
        for prefix, result in results.items():
            assert result["worker"] == int(prefix[2])
            assert result["replicas"] == replicas
            assert result["strategy"] == "CollectiveAllReduceStrategy"
            assert result["variable_type"] == "MirroredVariable"
            assert_same(result, reference)
        assert_same(results["[w1]"], results["[w0]"])  # the workers agree


def consecutive_free_ports() -> int:
    for _ in range(100):
        port = launch.free_ports(1)[0]
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


@pytest.mark.multiworker
@pytest.mark.slow
def test_a_slurm_step_picks_multi_worker_and_trains_the_same(reference):
    base = consecutive_free_ports()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "fit_equivalence.py"), *FLAGS],
            cwd=REPO,
            env=child_env(
                SLURM_STEP_NUM_TASKS="2",
                SLURM_PROCID=str(rank),
                SLURM_STEP_NODELIST="127.0.0.1",
                SLURM_STEP_TASKS_PER_NODE="2",
                SLURM_JOB_ID="1",
                TFDIST_SLURM_PORT_BASE=str(base),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, err[-5000:]
        result = last_json_line(out)
        assert (result["worker"], result["replicas"]) == (rank, 2)
        assert result["strategy"] == "CollectiveAllReduceStrategy"
        assert_same(result, reference)


# ------------------------------------------------------------------ the official tutorial


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.mnist
def test_official_tutorial_main_trains_3_epochs_on_both_workers():
    closed = "http://127.0.0.1:9"  # any download attempt fails at once, on loopback
    proc = launch_cli(
        "-n",
        "2",
        str(SCRIPTS / "tutorial" / "main.py"),
        timeout=480,
        HTTP_PROXY=closed,
        HTTPS_PROXY=closed,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-3000:]}\n{proc.stderr[-5000:]}"
    assert "all 2 worker(s) finished: w0 exited 0, w1 exited 0" in proc.stderr
    chunks = re.split(r"^\[w0\] Epoch \d/3$", out, flags=re.M)
    assert re.findall(r"^\[w0\] Epoch (\d)/3$", out, flags=re.M) == ["1", "2", "3"]
    # Each epoch's bar reaches 70/70 steps; its last redraw shows the epoch's mean loss.
    losses = []
    for chunk in chunks[1:]:
        assert "70/70" in chunk
        losses.append(float(re.findall(r"loss: ([0-9.]+)", chunk)[-1]))
    assert losses[2] < losses[0]
    # Progress is the chief's alone (every step above needed w1's all-reduce).
    assert not re.search(r"^\[w1\].*(Epoch|/step)", out, flags=re.M)


# ------------------------------------------------------------------ faults


@pytest.mark.multiworker
@pytest.mark.slow
def test_kill_9_of_a_worker_ends_the_survivor_with_an_error_naming_it(tmp_path):
    """Two nodes (one launcher each, on loopback): no launcher kills the survivor."""
    ports = launch.free_ports(2)
    hosts = f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    job = [str(SCRIPTS / "mw_steps.py"), "--progress", str(tmp_path), "--epochs", "200"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tfdist", "launch", "--nnodes", "2", "--node-rank", str(r)]
            + ["--hosts", hosts, *job, "--step-sleep", "0.2"],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    lines: list[list[str]] = [[], []]

    def read(proc, out):
        for line in proc.stdout:
            out.append(line)

    readers = [
        threading.Thread(target=read, args=(p, out), daemon=True)
        for p, out in zip(procs, lines, strict=True)
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any(line.startswith("[w0] EPOCH 1 start") for line in list(lines[0])):
            assert time.monotonic() < deadline, "".join(lines[0] + lines[1])[-3000:]
            assert all(p.poll() is None for p in procs), "".join(lines[0] + lines[1])[-3000:]
            time.sleep(0.1)
        pid = int(next(line.split()[2] for line in lines[1] if line.startswith("[w1] PID")))
        os.kill(pid, signal.SIGKILL)
        node1 = procs[1].wait(timeout=30)
        # The survivor's own collectives fail (heartbeat timeout): within 60 s of the kill.
        node0 = procs[0].wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
        for reader in readers:
            reader.join(timeout=10)
    out0, out1 = "".join(lines[0]), "".join(lines[1])
    assert node1 == 128 + signal.SIGKILL
    assert "failed: worker w1 was killed by signal 9 (SIGKILL), exit status 137" in out1
    assert node0 == 1 and "failed: worker w0 exited with code 1" in out0
    # Either the heartbeat verdict ("tasks are unhealthy ... task:1") or, when the dead
    # peer's socket resets an all-reduce first, "Connection reset ... remote target
    # .../task:1": both name the dead worker.
    survivor = "\n".join(line for line in out0.splitlines() if line.startswith("[w0]"))
    assert "UnavailableError" in survivor and "/job:worker/replica:0/task:1" in survivor, out0[
        -3000:
    ]
    # One line, not a traceback (tfdist.bootstrap; TFDIST_DEBUG=1 shows it).
    assert "Traceback" not in survivor, survivor[-3000:]
    assert "tfdist: UnavailableError:" in survivor, survivor[-3000:]


@pytest.mark.multiworker
@pytest.mark.slow
def test_with_max_restarts_a_killed_job_resumes_and_finishes_exactly(tmp_path):
    proc = launch_cli(
        *("-n", "2", "--max-restarts", "1", str(SCRIPTS / "mw_steps.py")),
        *("--progress", str(tmp_path), "--epochs", "4", "--die-at-epoch", "2", "--die-rank", "1"),
        timeout=300,
    )
    assert (
        "worker w1 was killed by signal 9 (SIGKILL), exit status 137: restarting all workers"
        in proc.stderr
    )
    results = worker_results(proc)
    assert set(results) == {"[w0]", "[w1]"}
    for result in results.values():
        assert (result["restart"], result["first_epoch"], result["epochs"]) == (1, 2, 4)
        assert result["diff"] < 1e-5  # the same weights as an uninterrupted run
