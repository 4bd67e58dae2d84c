"""Custom training loops (tfdist.loops) in the guides' style: the same weights on 1 device,
N devices and N workers/processes, and exact resume after a kill -9, a SIGTERM (save at an agreed
step, exit 75) and a damaged newest checkpoint (on JAX, the killed job writes sharded,
asynchronous checkpoints and is killed with a write under way).

The scripts are tests/scripts/loop_tf.py and loop_jax.py (docs/custom_loops.md shows
them). Each process trains every variant it can (one device and all devices in one
interpreter) and prints one JSON line, plus one per restore.
"""

from __future__ import annotations

import json
import os
import re
import signal
import warnings
import zipfile
from dataclasses import dataclass

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import (
    REPO,
    SCRIPTS,
    child_env,
    equivalence,
    last_json_line,
    launch_cli,
    run_python,
    warm_start,
)

TOLERANCE = 1e-5
STEPS = 30  # 3 epochs of 160 examples in global batches of 16
KILL_AT = 13  # between the saves of steps 12 and 16: step 13 is trained again
SHARDED_KILL_AT = 16  # a save step: its write (ckpt-2-6.orbax) is under way at the kill
DAMAGED = "ckpt-2-8.orbax"  # newer than any checkpoint at the kill: tried first
SIGTERM_AT = 20


def max_diff(a, b):
    return equivalence.max_difference(a, b)


def run_script(script, directory, *extra, **env):
    proc = warm_start.run(
        [str(SCRIPTS / script), "--dir", str(directory), *extra],
        cwd=REPO,
        env=child_env(**env),
        base_env=child_env(),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return last_json_line(proc.stdout)


def worker_lines(proc) -> list[tuple[str, dict]]:
    """``(worker, JSON line)`` of every JSON line the workers printed under tfdist launch."""
    found = []
    for line in proc.stdout.splitlines():
        worker, _, rest = line.partition(" ")
        if worker.startswith("[w") and rest.startswith("{"):
            found.append((worker.strip("[]"), json.loads(rest)))
    return found


def worker_results(proc):
    """({worker: [final results]}, {worker: [what each attempt restored]}) from tfdist
    launch's output."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    found, restores = {}, {}
    for name, result in worker_lines(proc):
        if "restored" in result:
            restores.setdefault(name, []).append(result)
        elif "distributed" in result:
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


@dataclass(frozen=True)
class LoopJob:
    """A custom-loop job and how each test runs it."""

    script: str
    single_env: dict  # the single process's devices
    launch: list  # tfdist launch's arguments
    env: dict  # every run's environment
    # What the single process ("single") and each launched one ("launched") must report
    # it ran on (see check_topology).
    topology: dict
    extra: tuple = ()  # the script's switches
    # The job killed -9 in attempt 0 (and sent SIGTERM in attempt 1): its own switches,
    # and the suffix of the checkpoints it writes.
    kill: tuple = ("--kill-at-step", str(KILL_AT))
    suffix: str = ".keras"


TF_LOOP = LoopJob(
    "loop_tf.py",
    {"TFDIST_CPU_DEVICES": "2"},
    ["-n", "2"],
    {},
    {
        "single": {"workers": 1, "one_device.replicas": 1, "distributed.replicas": 2},
        "launched": {"workers": 2, "distributed.replicas": 2},
    },
)
# With Dropout: its masks come from the global batch's shape under jit (the same on
# every mesh), and its RNG state is part of the checkpoint.
JAX_LOOP = LoopJob(
    "loop_jax.py",
    {"TFDIST_CPU_DEVICES": "4"},
    ["-n", "2", "--devices-per-worker", "2"],
    {"KERAS_BACKEND": "jax"},
    {
        "single": {
            "processes": 1,
            "devices": 4,
            "one_device.devices": 1,
            "one_device.state_devices": 1,
            "distributed.devices": 4,
            "distributed.state_devices": 4,  # the mesh given was the mesh trained on
        },
        "launched": {
            "processes": 2,
            "devices": 4,
            "distributed.devices": 4,
            "distributed.state_devices": 4,
        },
    },
    ("--dropout",),
    # Sharded checkpoints, every process killed right after step 16's save call, that
    # write under way; worker 0 first adds a damaged copy of the newest finished one.
    ("--sharded", "--kill-in-write", str(SHARDED_KILL_AT), "--plant-damaged", DAMAGED),
    ".orbax",
)


def damage_newest_and_resume(job: LoopJob, directory, single):
    """A newest archive that is a valid zip with a garbage member (a valid CRC) is skipped
    for the previous one, kept as ``*.corrupt``, and the resumed run ends the same."""
    newest = directory / "dist" / "ckpt-3-8.keras"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile: "Duplicate name" (the last one is read)
        with zipfile.ZipFile(newest, "a") as archive:
            archive.writestr("tfdist/optimizer.npz", b"garbage")
    resumed = run_script(job.script, directory, *job.extra, **job.single_env, **job.env)
    expected = job.topology["single"]
    check_topology(resumed, {k: v for k, v in expected.items() if "one_device" not in k})
    resumed = resumed["distributed"]
    assert resumed["restored_from"] == "ckpt-3-4.keras"  # step 24: the previous one
    assert os.path.exists(str(newest) + ".corrupt")
    full = single["distributed"]
    equivalence.assert_close(full["losses"][24:], resumed["losses"], 1e-5, "losses")
    assert max_diff(resumed["weights"], full["weights"]) <= TOLERANCE


def run_single(job: LoopJob, directory, *, check: bool = True, **env):
    """One process: the one-device reference, and all the process's devices matching it
    (``check_single``, unless ``check=False``); ``env`` adds to the process's environment."""
    single = run_script(
        job.script, directory, "--one-device-too", *job.extra, **job.single_env, **job.env, **env
    )
    if check:
        check_single(job, single)
    return single


def check_single(job: LoopJob, single: dict) -> None:
    """``run_single``'s process ran on its devices, its one-device reference trained and
    saved as planned, and its distributed variant ended with the reference's weights."""
    check_topology(single, job.topology["single"])
    reference = single["one_device"]
    assert reference["step"] == STEPS and reference["restored_from"] is None
    assert max_diff(single["distributed"]["weights"], reference["weights"]) <= TOLERANCE
    # Saves every 4 steps, kept to the newest 5 (the epoch-end ones are ckpt-{epoch}).
    assert reference["checkpoints"] == [
        "ckpt-2-2.keras", "ckpt-2-6.keras", "ckpt-2.keras", "ckpt-3-4.keras", "ckpt-3-8.keras"
    ]  # fmt: skip


def check_loop(job: LoopJob, tmp_path, single, single_dir):
    """``single`` (``run_single`` in ``single_dir``) vs N workers, uninterrupted and after
    kill -9 and SIGTERM; then a damaged newest archive."""
    reference = single["one_device"]
    command = [*job.launch, str(SCRIPTS / job.script), *job.extra]
    plain, _ = worker_results(launch_cli(*command, "--dir", str(tmp_path / "n"), **job.env))
    # Attempt 0 is killed (-9) after step 13 (or in step 16's write); in attempt 1 worker 1
    # gets SIGTERM after step 20: every worker saves after step 21 and exits 75; attempt 2
    # ends the job.
    faults = [*job.kill, "--sigterm-at-step", str(SIGTERM_AT)]
    restarts = ["--max-restarts", "2"]
    proc = launch_cli(*restarts, *command, "--dir", str(tmp_path / "k"), *faults, **job.env)
    killed, restores = worker_results(proc)
    output = proc.stdout + proc.stderr
    # (once Orbax is imported, the root logger has a handler: a level prefix comes first)
    assert re.search(r"\[w1\] \S*tfdist: SIGTERM received", output), output[-3000:]
    # (Worker 0 may print the line too: once worker 1 has exited 75, the launcher stops a
    # worker still winding down with SIGTERM. Both saving at the agreed step is what counts.)
    for worker in ("w0", "w1"):
        (uninterrupted,) = plain[worker]
        check_topology(uninterrupted, job.topology["launched"])
        uninterrupted = uninterrupted["distributed"]
        assert max_diff(uninterrupted["weights"], reference["weights"]) <= TOLERANCE
        assert [(r["attempt"], r["restored"], r["at_step"]) for r in restores[worker]] == [
            (0, None, 0),
            (1, "ckpt-2-2" + job.suffix, 12),  # the save before the kill: epoch 1, batch 2
            (2, "ckpt-3-1" + job.suffix, SIGTERM_AT + 1),  # the agreed preemption save
        ]
        (resumed,) = killed[worker]  # attempts 0 and 1 ended before printing
        check_topology(resumed, job.topology["launched"])
        resumed = resumed["distributed"]
        assert resumed["step"] == STEPS
        equivalence.assert_close(uninterrupted["losses"][21:], resumed["losses"], 1e-5, "losses")
        assert max_diff(resumed["weights"], uninterrupted["weights"]) <= TOLERANCE
    if job.suffix == ".orbax":
        check_sharded_faults(proc, tmp_path / "k" / "dist")
    damage_newest_and_resume(job, single_dir, single)


def check_sharded_faults(proc, directory) -> None:
    """What the sharded job's faults left and said: the write killed mid-way never became
    a checkpoint (the relaunch restored the one before, above) and was removed; the
    damaged copy was skipped with one warning per process, no asyncio tracebacks."""
    output = proc.stdout + proc.stderr
    dying = [line for worker, line in worker_lines(proc) if "dying_in_write" in line]
    assert dying and all(
        d == {"dying_in_write": "ckpt-2-6.orbax", "landed": False} for d in dying
    ), dying
    assert re.search(r"\[w0\] \S*tfdist: removing \S+/ckpt-2-6\.orbax\.orbax-checkp", output)
    assert re.search(rf"\[w0\] .*skipping checkpoint '\S+/{re.escape(DAMAGED)}'", output)
    skipped = [line[:4] for line in output.splitlines() if "skipping checkpoint" in line]
    assert sorted(set(skipped)) == sorted(skipped), skipped  # once per process at most
    assert "Event loop is closed" not in output
    names = os.listdir(directory)
    assert DAMAGED + ".corrupt" in names, names
    assert all(n.endswith((".orbax", ".corrupt")) for n in names), names  # no unfinished


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.multiworker
@pytest.mark.tensorflow
def test_tensorflow_loop_matches_one_device_on_two_devices_two_workers_and_after_kill(
    tmp_path,
):
    single = run_single(TF_LOOP, tmp_path / "single")
    check_loop(TF_LOOP, tmp_path, single, tmp_path / "single")


@pytest.fixture(scope="module")
def jax_single(tmp_path_factory):
    """``(directory, result)`` of JAX_LOOP's ``run_single`` (its one-device reference and
    its 4 devices, never interrupted), run once for the module's JAX tests."""
    directory = tmp_path_factory.mktemp("jax_single")
    return directory, run_single(JAX_LOOP, directory)


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.multiworker
def test_jax_loop_matches_one_device_on_four_devices_two_processes_and_after_kill(
    tmp_path, jax_single
):
    """As on TensorFlow, with sharded asynchronous checkpoints in the killed job: killed
    -9 with a write under way, which never becomes a checkpoint."""
    single_dir, single = jax_single
    check_loop(JAX_LOOP, tmp_path, single, single_dir)


@pytest.mark.slow
@pytest.mark.jax
def test_jax_loop_with_sharded_checkpoints_in_a_bucket_resumes_after_kill_9(s3_bucket, jax_single):
    """``Checkpointer(..., sharded=True)`` on ``s3://`` (moto's S3 server): the loop on 4
    devices is killed -9 right after step 16's save call, that write under way. In the
    bucket only what Orbax committed (``commit_success.txt``, written last) counts: the
    restart restores step 12's ``ckpt-2-2.orbax`` (nothing of the cut write counts) and
    ends within 1e-5 of the same loop never interrupted (``jax_single``'s, on disk)."""
    run, env = s3_bucket.url("run"), {**JAX_LOOP.single_env, **JAX_LOOP.env, **s3_bucket.env}
    sharded = [*JAX_LOOP.extra, "--sharded"]
    argv = [str(SCRIPTS / JAX_LOOP.script), "--dir", run, *sharded]
    kill = ["--kill-in-write", str(SHARDED_KILL_AT)]
    proc = warm_start.run(
        [*argv, *kill], cwd=REPO, env=child_env(**env), base_env=child_env(), timeout=240
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert '"dying_in_write": "ckpt-2-6.orbax"' in proc.stdout, proc.stdout[-3000:]
    left = {
        n: "commit_success.txt" in s3_bucket.names(f"run/dist/{n}")
        for n in s3_bucket.names("run/dist")
    }
    committed = sorted(name for name, done in left.items() if done)
    assert committed == ["ckpt-1-4.orbax", "ckpt-1-8.orbax", "ckpt-2-2.orbax"], left

    resumed = run_script(JAX_LOOP.script, run, *sharded, **env)
    check_topology(
        resumed, {k: v for k, v in JAX_LOOP.topology["single"].items() if "one_device" not in k}
    )
    resumed, full = resumed["distributed"], jax_single[1]["distributed"]
    assert resumed["restored_from"] == "ckpt-2-2.orbax" and resumed["step"] == STEPS
    equivalence.assert_close(full["losses"][12:], resumed["losses"], 1e-5, "losses")
    assert max_diff(resumed["weights"], full["weights"]) <= TOLERANCE
    kept = [name.replace(".keras", ".orbax") for name in full["checkpoints"]]
    assert resumed["checkpoints"] == s3_bucket.names("run/dist") == kept  # pruned, none cut


@pytest.mark.tensorflow
def test_tensorflow_loop_in_a_bucket_resumes_after_kill_9_like_one_device(s3_bucket):
    """The Checkpointer on ``s3://`` (moto's S3 server, tests/object_store.py): the loop
    killed -9 after step 13 (the last save after step 12) and started again restores
    ``ckpt-2-2.keras`` from the bucket and ends within 1e-5 of the same loop run
    uninterrupted on one device (in the same process, into another prefix)."""
    run = s3_bucket.url("run")
    env = child_env(**s3_bucket.env)
    argv = [str(SCRIPTS / "loop_tf.py"), "--dir", run, "--kill-at-step", str(KILL_AT)]
    proc = warm_start.run(argv, cwd=REPO, env=env, base_env=child_env(), timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert s3_bucket.names("run/dist") == ["ckpt-1-4.keras", "ckpt-1-8.keras", "ckpt-2-2.keras"]

    result = run_script("loop_tf.py", run, "--one-device-too", **s3_bucket.env)
    reference, resumed = result["one_device"], result["distributed"]
    assert reference["restored_from"] is None and reference["step"] == STEPS
    assert resumed["restored_from"] == "ckpt-2-2.keras" and resumed["step"] == STEPS
    equivalence.assert_close(reference["losses"][12:], resumed["losses"], 1e-5, "losses")
    assert max_diff(resumed["weights"], reference["weights"]) <= TOLERANCE
    kept = ["ckpt-2-2.keras", "ckpt-2-6.keras", "ckpt-2.keras", "ckpt-3-4.keras", "ckpt-3-8.keras"]
    assert resumed["checkpoints"] == reference["checkpoints"] == kept  # pruned in the bucket
    assert s3_bucket.names("run/dist") == kept  # no staging object left


def test_checkpointer_and_helpers_name_what_is_wrong(tmp_path):
    import tfdist

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match=r"Received: pipeline=None, steps_per_epoch=None"):
        tfdist.loops.Checkpointer(tmp_path, model=model, optimizer=optimizer)
    with pytest.raises(TypeError, match=r"optimizer must be .*Received: optimizer='sgd'"):
        tfdist.loops.Checkpointer(tmp_path, model=model, optimizer="sgd", steps_per_epoch=2)
    with pytest.raises(ValueError, match=r"sharded=True needs the JAX backend.*'tensorflow'"):
        tfdist.loops.Checkpointer(
            tmp_path, model=model, optimizer=optimizer, steps_per_epoch=2, sharded=True
        )
    with pytest.raises(TypeError, match=r"sharded must be a bool.*Received: sharded='yes'"):
        tfdist.loops.Checkpointer(
            tmp_path, model=model, optimizer=optimizer, steps_per_epoch=2, sharded="yes"
        )
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
@pytest.mark.tensorflow
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
