"""Custom training loops (tfdist.loops) in the guides' style: the same weights on 1 device,
N devices and N workers/processes, and exact resume after a kill -9, a SIGTERM (save at an agreed
step, exit 75) and a damaged newest checkpoint.

The scripts are tests/scripts/loop_tf.py and loop_jax.py (docs/custom_loops.md shows
them). Each process trains every variant it can (one device and all devices in one
interpreter) and prints one JSON line, plus one per restore.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, SCRIPTS, child_env, equivalence, last_json_line, launch_cli, run_python

TOLERANCE = 1e-5
STEPS = 30  # 3 epochs of 160 examples in global batches of 16
KILL_AT = 13  # between the saves of steps 12 and 16: step 13 is trained again
SIGTERM_AT = 20


def max_diff(a, b):
    return equivalence.max_difference(a, b)


def run_script(script, directory, *extra, **env):
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--dir", str(directory), *extra],
        cwd=REPO,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return last_json_line(proc.stdout)


def worker_results(proc):
    """({worker: [final results]}, {worker: [what each attempt restored]}) from tfdist
    launch's output."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    found, restores = {}, {}
    for line in proc.stdout.splitlines():
        worker, _, rest = line.partition(" ")
        if worker.startswith("[w") and rest.startswith("{"):
            result, name = json.loads(rest), worker.strip("[]")
            if "restored" in result:
                restores.setdefault(name, []).append(result)
            else:
                found.setdefault(name, []).append(result)
    assert sorted(found) == ["w0", "w1"], proc.stdout[-3000:]
    return found, restores


def check_topology(result: dict, expected: dict) -> None:
    """``result`` (one process's JSON) ran on what ``expected`` says: ``{"key": value}``,
    "a.b" for ``result["a"]["b"]`` (replicas, workers, processes, devices)."""
    for path, value in expected.items():
        got = result
        for part in path.split("."):
            got = got[part]
        assert got == value, (path, got, value)


def damage_newest_and_resume(script, directory, single, extra, env, topology):
    """A newest archive that is a valid zip with a garbage member (a valid CRC) is skipped
    for the previous one, kept as ``*.corrupt``, and the resumed run ends the same."""
    newest = directory / "dist" / "ckpt-3-8.keras"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile: "Duplicate name" (the last one is read)
        with zipfile.ZipFile(newest, "a") as archive:
            archive.writestr("tfdist/optimizer.npz", b"garbage")
    resumed = run_script(script, directory, *extra, **env)
    check_topology(resumed, {k: v for k, v in topology.items() if "one_device" not in k})
    resumed = resumed["distributed"]
    assert resumed["restored_from"] == "ckpt-3-4.keras"  # step 24: the previous one
    assert os.path.exists(str(newest) + ".corrupt")
    full = single["distributed"]
    equivalence.assert_close(full["losses"][24:], resumed["losses"], 1e-5, "losses")
    assert max_diff(resumed["weights"], full["weights"]) <= TOLERANCE


def check_loop(script, tmp_path, single_env, launch_args, env, topology, extra=()):
    """One device vs all devices of one process vs N workers; kill -9, SIGTERM, damage.
    ``topology``: what the single process (``"single"``) and each launched process
    (``"launched"``) must report it ran on (see ``check_topology``)."""
    single_dir = tmp_path / "single"
    single = run_script(script, single_dir, "--one-device-too", *extra, **single_env, **env)
    check_topology(single, topology["single"])
    reference = single["one_device"]
    assert reference["step"] == STEPS and reference["restored_from"] is None
    assert max_diff(single["distributed"]["weights"], reference["weights"]) <= TOLERANCE
    # Saves every 4 steps, kept to the newest 5 (the epoch-end ones are ckpt-{epoch}).
    assert reference["checkpoints"] == [
        "ckpt-2-2.keras", "ckpt-2-6.keras", "ckpt-2.keras", "ckpt-3-4.keras", "ckpt-3-8.keras"
    ]  # fmt: skip

    job = [str(SCRIPTS / script), *extra]
    plain, _ = worker_results(launch_cli(*launch_args, *job, "--dir", str(tmp_path / "n"), **env))
    # Attempt 0 is killed (-9) after step 13; in attempt 1 worker 1 gets SIGTERM after
    # step 20: every worker saves after step 21 and exits 75; attempt 2 ends the job.
    faults = ["--kill-at-step", str(KILL_AT), "--sigterm-at-step", str(SIGTERM_AT)]
    restarts = ["--max-restarts", "2"]
    proc = launch_cli(*launch_args, *restarts, *job, "--dir", str(tmp_path / "k"), *faults, **env)
    killed, restores = worker_results(proc)
    output = proc.stdout + proc.stderr
    assert "[w1] tfdist: SIGTERM received" in output
    # (Worker 0 may print the line too: once worker 1 has exited 75, the launcher stops a
    # worker still winding down with SIGTERM. Both saving at the agreed step is what counts.)
    for worker in ("w0", "w1"):
        (uninterrupted,) = plain[worker]
        check_topology(uninterrupted, topology["launched"])
        uninterrupted = uninterrupted["distributed"]
        assert max_diff(uninterrupted["weights"], reference["weights"]) <= TOLERANCE
        assert [(r["attempt"], r["restored"], r["at_step"]) for r in restores[worker]] == [
            (0, None, 0),
            (1, "ckpt-2-2.keras", 12),  # the save before the kill: epoch 1, batch 2
            (2, "ckpt-3-1.keras", SIGTERM_AT + 1),  # the agreed preemption save
        ]
        (resumed,) = killed[worker]  # attempts 0 and 1 ended before printing
        check_topology(resumed, topology["launched"])
        resumed = resumed["distributed"]
        assert resumed["step"] == STEPS
        equivalence.assert_close(uninterrupted["losses"][21:], resumed["losses"], 1e-5, "losses")
        assert max_diff(resumed["weights"], uninterrupted["weights"]) <= TOLERANCE
    damage_newest_and_resume(
        script, single_dir, single, extra, {**single_env, **env}, topology["single"]
    )
    return single


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.multiworker
def test_tensorflow_loop_matches_one_device_on_two_devices_two_workers_and_after_kill(
    tmp_path,
):
    topology = {
        "single": {"workers": 1, "one_device.replicas": 1, "distributed.replicas": 2},
        "launched": {"workers": 2, "distributed.replicas": 2},
    }
    check_loop("loop_tf.py", tmp_path, {"TFDIST_CPU_DEVICES": "2"}, ["-n", "2"], {}, topology)


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.multiworker
def test_jax_loop_matches_one_device_on_four_devices_two_processes_and_after_kill(tmp_path):
    launch = ["-n", "2", "--devices-per-worker", "2"]
    env = {"KERAS_BACKEND": "jax"}
    # With Dropout: its masks come from the global batch's shape under jit (the same on
    # every mesh), and its RNG state is part of the checkpoint.
    devices = {"TFDIST_CPU_DEVICES": "4"}
    topology = {
        "single": {
            "processes": 1,
            "devices": 4,
            "one_device.devices": 1,
            "distributed.devices": 4,
        },
        "launched": {"processes": 2, "devices": 4, "distributed.devices": 4},
    }
    check_loop("loop_jax.py", tmp_path, devices, launch, env, topology, ["--dropout"])


def test_checkpointer_and_helpers_name_what_is_wrong(tmp_path):
    import tfdist

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match=r"Received: pipeline=None, steps_per_epoch=None"):
        tfdist.loops.Checkpointer(tmp_path, model=model, optimizer=optimizer)
    with pytest.raises(TypeError, match=r"optimizer must be .*Received: optimizer='sgd'"):
        tfdist.loops.Checkpointer(tmp_path, model=model, optimizer="sgd", steps_per_epoch=2)
    with pytest.raises(TypeError, match=r"dataset must be .*Received"):
        tfdist.loops.distribute([1, 2, 3])
    with (
        tf.distribute.OneDeviceStrategy("/cpu:0").scope(),
        pytest.raises(RuntimeError, match=r"inside strategy.run"),
    ):
        tfdist.loops.average_loss(tf.zeros(3))


_SHORT_LAST_BATCH = """
import json
import numpy as np
import tensorflow as tf
import tfdist

strategy = tfdist.strategy()
values = np.arange(1, 12, dtype="float32")  # 11 examples: batches of 4, 4 and a short 3
dataset = tf.data.Dataset.from_tensor_slices(values).batch(4)
dist = strategy.experimental_distribute_dataset(dataset)

@tf.function
def step(batch):
    per_replica = strategy.run(
        lambda x: (tfdist.loops.average_loss(x), tf.shape(x)[0]), args=(batch,)
    )
    loss, sizes = per_replica
    return (
        strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None),
        strategy.experimental_local_results(sizes),
    )

out = []
for batch in dist:
    loss, sizes = step(batch)
    out.append({"loss": float(loss), "sizes": [int(s) for s in sizes]})
print(json.dumps({"replicas": strategy.num_replicas_in_sync, "steps": out}))
"""


@pytest.mark.devices
def test_average_loss_averages_a_short_last_batch_over_its_true_size_on_two_replicas():
    """The per-example "loss" is the example's value: each step's loss must be the mean of
    its global batch, the short last one (3 examples, split 2 + 1) included."""
    result = last_json_line(run_python(_SHORT_LAST_BATCH, TFDIST_CPU_DEVICES="2").stdout)
    assert result["replicas"] == 2
    steps = result["steps"]
    assert [sum(s["sizes"]) for s in steps] == [4, 4, 3]
    assert sorted(steps[-1]["sizes"]) == [1, 2]  # the short batch is split unevenly
    means = [np.mean(chunk) for chunk in (range(1, 5), range(5, 9), range(9, 12))]
    equivalence.assert_close(means, [s["loss"] for s in steps], 1e-6, "average_loss")
