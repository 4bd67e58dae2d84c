"""Checkpoints and saving under KERAS_BACKEND=jax, and save-then-load on every worker.

Real processes throughout: tests/scripts/ckpt_job.py hurts itself (SIGKILL mid-epoch or
inside a save, SIGTERM) on 4 logical devices and under ``tfdist launch -n 2
--devices-per-worker 2``; each restart must end with the weights of a run that was never
interrupted. save_load_job.py checks that ``tfdist.save`` then ``tfdist.load`` works on
every worker (both backends) and that a chief-only ``load(in_scope=True)`` fails clearly
within its timeout; cross_backend_job.py writes with one backend and reads with the other.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import REPO, SCRIPTS, child_env, equivalence, last_json_line, warm_start

pytestmark = pytest.mark.jax

RESTART = 75  # tfdist.config.RESTART_EXIT_CODE (not imported: keep this process TF-free)
# 64 examples, global batch 8 (4 replicas x 2): 8 steps per epoch, 16 in all.
JOB = ("--save-freq", "3", "--epochs", "2", "--per-replica-batch", "2")


def _run(command, timeout, **env):
    env = child_env(**{"KERAS_BACKEND": "jax", **env})
    if command[1] != "-m":  # a script in one process: forked warm (tests/warm_start.py)
        return warm_start.run(command[1:], env=env, base_env=child_env(), cwd=REPO, timeout=timeout)
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_job(directory, *extra, timeout=240):
    """ckpt_job.py in one process on 4 logical CPU devices."""
    command = [sys.executable, str(SCRIPTS / "ckpt_job.py"), "--dir", str(directory), *JOB, *extra]
    return _run(command, timeout, TFDIST_CPU_DEVICES="4")


def launch_job(directory, temp, *extra, timeout=420):
    """ckpt_job.py as 2 processes x 2 devices, restarted (up to twice) by the launcher."""
    command = [
        sys.executable, "-m", "tfdist", "launch", "-n", "2", "--devices-per-worker", "2",
        "--max-restarts", "2",
        str(SCRIPTS / "ckpt_job.py"), "--dir", str(directory), *JOB, *extra,
    ]  # fmt: skip
    return _run(command, timeout, TMPDIR=str(temp))


def result_of(proc):
    try:
        return last_json_line(proc.stdout)
    except AssertionError:
        pytest.fail(f"job printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def worker_results(proc, worker):
    """The JSON results a worker printed under tfdist launch, one per attempt."""
    prefix = f"[{worker}] {{"
    return [
        json.loads(line[len(prefix) - 1 :])
        for line in proc.stdout.splitlines()
        if line.startswith(prefix) and '"weights"' in line
    ]


def max_diff(a, b):
    return equivalence.max_difference(a, b)


def staging_files(directory):
    return [n for n in os.listdir(directory) if n.startswith(".tmp-")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run on 4 logical devices."""
    result = result_of(run_job(tmp_path_factory.mktemp("reference")))
    assert result["replicas"] == 4 and result["exit_code"] == 0 and result["iterations"] == 16
    return result


@pytest.mark.slow
@pytest.mark.devices
def test_jax_kill_in_save_and_kill_mid_epoch_then_resume_exactly(tmp_path, reference):
    # 1. SIGKILL inside the 4th save (ckpt-2-1, after step 9), staging file half written
    proc = run_job(tmp_path, "--sigkill-in-save", "4")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert len(staging_files(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path))[-1] == "ckpt-1.keras"

    # 2. restart from ckpt-1 (step 8); SIGKILL mid-epoch after step 13 (saved at 12)
    proc = run_job(tmp_path, "--sigkill-at-step", "13")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert staging_files(tmp_path) == []
    assert "ckpt-2-4.keras" in os.listdir(tmp_path)

    # 3. restart at step 12 (step 13 is trained again): ends with the reference weights
    result = result_of(run_job(tmp_path))
    assert result["restored"] == {"path": "ckpt-2-4.keras", "epoch": 1, "batch": 4, "step": 12}
    assert [t[:2] for t in result["trained"]] == [[1, b] for b in range(4, 8)]
    assert result["iterations"] == 16
    assert max_diff(result["weights"], reference["weights"]) <= 1e-6
    assert staging_files(tmp_path) == []


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_processes_resume_exactly_after_sigterm_then_kill_9(tmp_path, reference):
    """2 processes x 2 devices. Attempt 0: SIGTERM reaches process 1 after step 5; both
    save after step 6 (mid epoch 0) and exit 75. Attempt 1: resumes there, ends epoch 0
    short and runs epoch 1 in full (not cut to the resumed epoch's length); process 1 is
    killed -9 after step 14. Attempt 2: resumes from step 12 and ends with the reference
    weights."""
    temp = tmp_path / "tmp"  # where process 1 stages its discarded copy of each save
    temp.mkdir()
    directory = tmp_path / "ckpt"
    faults = ("--sigterm-at-step", "5", "--sigterm-rank", "1")
    faults += ("--sigkill-at-step", "14", "--sigkill-rank", "1", "--sigkill-attempt", "1")
    proc = launch_job(directory, temp, *faults)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[w1] tfdist: SIGTERM received" in proc.stdout + proc.stderr
    assert '[w1] {"dying_at_step": 14}' in proc.stdout
    for worker in ("w0", "w1"):
        preempted, resumed = worker_results(proc, worker)  # the killed attempt printed none
        assert preempted["exit_code"] == RESTART and preempted["iterations"] == 6
        assert "ckpt-1-6.keras" in preempted["checkpoints"]
        assert resumed["restored"] == {"path": "ckpt-2-4.keras", "epoch": 1, "batch": 4, "step": 12}
        assert resumed["replicas"] == 4 and resumed["iterations"] == 16
        assert max_diff(resumed["weights"], reference["weights"]) <= 1e-5
    assert staging_files(directory) == []
    assert [n for n in os.listdir(temp) if n.startswith("tfdist-worker")] == []


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_save_then_load_on_every_worker_and_chief_only_load_fails_clearly(tmp_path, backend):
    command = [
        sys.executable, "-m", "tfdist", "launch", "-n", "2",
        str(SCRIPTS / "save_load_job.py"), str(tmp_path),
    ]  # fmt: skip
    proc = _run(command, 300, KERAS_BACKEND=backend)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = {}
    for worker in ("w0", "w1"):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"[{worker}] {{"))
        results[worker] = json.loads(line.partition(" ")[2])
    for result in results.values():
        assert result["keras_diff"] == 0.0 and result["weights_diff"] == 0.0
        assert result["optimizer_steps"] == 4 and result["staging_left"] == []
    chief = results["w0"]
    assert "every worker must call this" in chief["chief_only"]
    assert "load('model.keras', in_scope=True)" in chief["chief_only"]
    assert chief["chief_only_s"] < 60  # ended by its 5 s timeout, not a hang
    assert sorted(os.listdir(tmp_path)) == ["model.keras", "model.weights.h5"]


@pytest.mark.slow
def test_checkpoints_written_by_one_backend_load_in_the_other(tmp_path):
    """.keras and .weights.h5 both ways: JAX writes; TensorFlow writes and reads JAX's;
    JAX reads TensorFlow's. Weights and optimizer state are the same bytes."""
    script = str(SCRIPTS / "cross_backend_job.py")
    from_jax, from_tf = tmp_path / "from_jax", tmp_path / "from_tf"
    steps = [
        ("jax", ["save", from_jax]),
        ("tensorflow", ["save", from_tf, "load", from_jax]),
        ("jax", ["load", from_tf]),
    ]
    results = []
    for backend, args in steps:
        command = [sys.executable, script, *map(str, args)]
        proc = _run(command, 180, KERAS_BACKEND=backend)
        assert proc.returncode == 0, proc.stderr[-4000:]
        if "load" in args:
            results.append(last_json_line(proc.stdout))
    assert [r["loaded"] for r in results] == ["tensorflow", "jax"]
    for result in results:
        assert result["steps"] == 8
        for key in ("keras_weights", "keras_optimizer", "h5_weights", "h5_optimizer"):
            assert result[key] == 0.0, key
        assert result["keras_predictions"] <= 1e-6


def _same_script(directory, *extra, launch=False, timeout=300, **env):
    script = [str(SCRIPTS / "same_script.py"), str(directory), *extra]
    if launch:
        script = ["-m", "tfdist", "launch", "-n", "2", "--devices-per-worker", "2", *script]
    proc = _run([sys.executable, *script], timeout, **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    if not launch:
        return [last_json_line(proc.stdout)]
    lines = [x.partition(" ")[2] for x in proc.stdout.splitlines() if '"weights"' in x]
    return [json.loads(line) for line in lines]


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.multiworker
def test_the_same_script_gives_the_same_weights_everywhere(tmp_path):
    """same_script.py (pipeline, make_or_restore, callbacks.standard, save, load in a
    scope): 1 device = 4 devices = 2x2 ModelParallel = 2 processes x 2 devices on JAX,
    and it runs unchanged on TensorFlow."""
    (one,) = _same_script(tmp_path / "one")
    (four,) = _same_script(tmp_path / "four", TFDIST_CPU_DEVICES="4")
    (model_parallel,) = _same_script(tmp_path / "mp", "mp", TFDIST_CPU_DEVICES="4")
    processes = _same_script(tmp_path / "two", launch=True)
    (tensorflow,) = _same_script(tmp_path / "tf", KERAS_BACKEND="tensorflow")
    assert [one["replicas"], four["replicas"], model_parallel["replicas"]] == [1, 4, 2]
    assert sorted(r["chief"] for r in processes) == [False, True]
    for result in (four, model_parallel, *processes):
        assert result["steps"] == one["steps"] == 48
        assert max_diff(result["weights"], one["weights"]) <= 1e-5
    for result in (one, four, model_parallel, *processes, tensorflow):
        assert result["loaded_diff"] == 0.0  # tfdist.load(in_scope=True) on every worker
    assert tensorflow["backend"] == "tensorflow" and tensorflow["steps"] == 48
    # written once, by the chief, atomically: the 5 newest checkpoints and the model
    expected = ["ckpt-2.keras", "ckpt-3-13.keras", "ckpt-3-3.keras", "ckpt-3-8.keras"]
    assert sorted(os.listdir(tmp_path / "two")) == [*expected, "ckpt-3.keras", "final.keras"]


# ------------------------------------------------------------------ sharded checkpoints


def orbax_writes(directory):
    """Orbax's temporary directories: sharded writes that never finished."""
    return [n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n]


@pytest.mark.slow
@pytest.mark.devices
def test_sharded_kill_9_after_a_step_resumes_from_the_last_finished_write(tmp_path, reference):
    """``checkpoint(..., sharded=True)`` on 4 devices: SIGKILL right after step 13 (the
    background write of step 12 may or may not have finished); a dead job's unfinished
    write is ignored and removed; the resume ends with the archive run's weights."""
    proc = run_job(tmp_path, "--sharded", "--sigkill-at-step", "13")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    finished = sorted(n for n in os.listdir(tmp_path) if n.endswith(".orbax"))
    assert {"ckpt-1.orbax", "ckpt-2-1.orbax"} <= set(finished), finished
    # What a job killed inside a write leaves, whatever the timing was above.
    stale = tmp_path / "ckpt-2-7.orbax.orbax-checkpoint-tmp"
    (stale / "state").mkdir(parents=True)
    (stale / "state" / "half").write_bytes(b"\0" * 100)

    result = result_of(run_job(tmp_path, "--sharded"))
    # step 12's checkpoint if its write finished before the kill, else step 9's
    assert result["restored"]["path"] in ("ckpt-2-4.orbax", "ckpt-2-1.orbax"), result["restored"]
    assert result["iterations"] == 16
    assert max_diff(result["weights"], reference["weights"]) <= 1e-6
    assert orbax_writes(tmp_path) == [] and staging_files(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt-2-4.orbax", "ckpt-2-7.orbax", "ckpt-2.orbax"]


@pytest.fixture(scope="module")
def model_parallel_reference(tmp_path_factory):
    """An uninterrupted run on a 1x4 ModelParallel mesh in one process (global batch 8)."""
    directory = tmp_path_factory.mktemp("mp-reference")
    result = result_of(run_job(directory, *MODEL_PARALLEL))
    assert result["replicas"] == 1 and result["first_kernel"] == "P(None, 'model')"
    assert result["kernel_blocks_here"] == 4  # one block per device
    assert result["iterations"] == 16
    return result


MODEL_PARALLEL = ("--model-parallel", "8", "--sharded")


@pytest.mark.slow
@pytest.mark.multiworker
def test_sharded_model_parallel_two_processes_survive_sigterm_and_kill_9_in_a_write(
    tmp_path, model_parallel_reference
):
    """2 processes x 2 devices, a 1x4 ModelParallel mesh, sharded checkpoints every 3 steps.
    Attempt 0: SIGTERM -> both save after step 6 and exit 75. Attempt 1: process 1 is
    killed -9 right after step 12's save call, while that write runs in the background.
    Attempt 2 removes that unfinished write, resumes from step 9's checkpoint and ends
    within 1e-5 of a one-process run. The model axis runs across the processes: each holds
    half of the sharded kernel (2 of its 4 blocks) and wrote its own shard store; the job's last checkpoint
    restores on one device to the same weights. The same job with archives is refused at
    train begin (Keras's save cannot fetch a variable that spans processes)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    directory = tmp_path / "ckpt"
    faults = ("--sigterm-at-step", "5", "--sigterm-rank", "1")
    faults += ("--sigkill-at-step", "12", "--sigkill-rank", "1", "--sigkill-attempt", "1")
    proc = launch_job(directory, temp, *MODEL_PARALLEL, *faults)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # (importing Orbax gives the root logger a handler: records carry a level prefix)
    assert re.search(r"\[w1\] \S*tfdist: SIGTERM received", proc.stdout + proc.stderr)
    assert '[w1] {"dying_at_step": 12}' in proc.stdout
    assert re.search(
        r"\[w0\] \S*tfdist: removing \S+/ckpt-2-4\.orbax\.orbax-checkpoint-tmp",
        proc.stdout + proc.stderr,
    )
    restored = set()
    for worker in ("w0", "w1"):
        preempted, resumed = worker_results(proc, worker)  # the killed attempt printed none
        assert preempted["exit_code"] == RESTART and preempted["iterations"] == 6
        assert "ckpt-1-6.orbax" in preempted["checkpoints"]  # the preemption save, finished
        assert resumed["first_kernel"] == "P(None, 'model')"
        assert resumed["kernel_blocks_here"] == 2  # of 4: the model axis spans both processes
        # step 12's write died with process 1 (Orbax commits once every process is done)
        assert resumed["restored"]["path"] == "ckpt-2-1.orbax", resumed["restored"]
        assert resumed["iterations"] == 16
        assert max_diff(resumed["weights"], model_parallel_reference["weights"]) <= 1e-5
        restored.add(json.dumps(resumed["restored"], sort_keys=True))
    assert len(restored) == 1  # both processes restored the same checkpoint
    state = directory / "ckpt-2.orbax" / "state"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(state))
    assert orbax_writes(directory) == []

    alone = tmp_path / "alone"
    alone.mkdir()
    os.rename(directory / "ckpt-2.orbax", alone / "ckpt-2.orbax")
    command = [sys.executable, str(SCRIPTS / "ckpt_job.py"), "--dir", str(alone), *JOB, "--sharded"]
    result = result_of(_run(command, 240, TFDIST_CPU_DEVICES="1"))
    assert result["replicas"] == 1 and result["restored"]["path"] == "ckpt-2.orbax"
    assert result["trained"] == []
    assert max_diff(result["weights"], model_parallel_reference["weights"]) <= 1e-5

    # Archives cannot hold that model: said at train begin on every process, naming the fix.
    archive = tmp_path / "archive"
    command = [
        sys.executable, "-m", "tfdist", "launch", "-n", "2", "--devices-per-worker", "2",
        str(SCRIPTS / "ckpt_job.py"), "--dir", str(archive), *JOB, "--model-parallel", "8",
    ]  # fmt: skip
    proc = _run(command, 240, TMPDIR=str(temp))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "span devices of other processes" in output and "Pass sharded=True" in output
    assert not [n for n in os.listdir(archive) if n.startswith("ckpt-")]
