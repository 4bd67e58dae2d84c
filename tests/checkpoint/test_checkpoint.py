"""Restartable jobs: naming, make_or_restore, atomic chief-only checkpoints, exact resume, faults.

Fast tests train a tiny model in this process on the default strategy. Fault injection
runs tests/scripts/ckpt_job.py in real subprocesses that SIGKILL or SIGTERM themselves,
then starts them again and checks that the final weights equal an uninterrupted run.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import checkpoint as ckpt
from tfdist.core.config import RESTART_EXIT_CODE

from conftest import REPO, SCRIPTS, child_env, equivalence, last_json_line, warm_start

X = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
Y = X @ np.ones((4, 1), "float32")
STEPS_PER_EPOCH = 4  # 32 examples, batch 8


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


class EpochLog(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)


def fit(model, epochs, initial_epoch=0, callbacks=()):
    log = EpochLog()
    model.fit(
        X,
        Y,
        batch_size=8,
        shuffle=False,
        epochs=epochs,
        initial_epoch=initial_epoch,
        verbose=0,
        callbacks=[*callbacks, log],
    )
    return log.epochs


def restore(directory):
    return tfdist.make_or_restore(build, directory, strategy=tf.distribute.get_strategy())


def assert_same_weights(a, b, atol=1e-6):
    equivalence.assert_close(a, b, atol)


# --------------------------------------------------------------------------- names


def test_names_follow_the_guides_and_sort_by_position(tmp_path):
    assert ckpt.checkpoint_name(1) == "ckpt-1.keras"
    assert ckpt.checkpoint_name(2, 50) == "ckpt-3-50.keras"
    assert ckpt.parse_checkpoint_name("ckpt-3-50.keras") == ckpt.Position(2, 50)
    assert ckpt.parse_checkpoint_name("ckpt-12.keras") == ckpt.Position(12, 0)
    for other in ("ckpt-1.keras.corrupt", ".tmp-1-host-ckpt-2.keras", "ckpt-0-5.keras", "x"):
        assert ckpt.parse_checkpoint_name(other) is None
    for name in ("ckpt-2.keras", "ckpt-3-5.keras", "ckpt-10.keras", "ckpt-1.keras", "logs"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "ckpt-9.keras.corrupt").write_bytes(b"")
    order = [os.path.basename(p) for _, p in ckpt.list_checkpoints(tmp_path)]
    assert order == ["ckpt-1.keras", "ckpt-2.keras", "ckpt-3-5.keras", "ckpt-10.keras"]
    assert ckpt.list_checkpoints(tmp_path / "missing") == []


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "bad, error",
    [(0, ValueError), (-3, ValueError), ("batch", ValueError)]
    + [(True, TypeError), (2.5, TypeError), (None, TypeError)],  # wrong type: TypeError
)
def test_save_freq_must_be_epoch_or_positive_int(tmp_path, bad, error):
    with pytest.raises(
        error, match=r"save_freq must be 'epoch' or a positive int.*Received: save_freq="
    ):
        tfdist.callbacks.checkpoint(tmp_path, save_freq=bad)
    assert os.listdir(tmp_path) == []


def test_max_to_keep_must_be_positive(tmp_path):
    with pytest.raises(
        ValueError, match=r"max_to_keep must be None or a positive int.*max_to_keep=0"
    ):
        tfdist.callbacks.checkpoint(tmp_path, max_to_keep=0)


def test_checkpoint_dir_that_is_a_file_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("precious")
    with pytest.raises(
        NotADirectoryError, match=r"checkpoint_dir is a file.*Received: checkpoint_dir="
    ):
        tfdist.callbacks.checkpoint(path)
    with pytest.raises(NotADirectoryError, match="make_or_restore: checkpoint_dir is a file"):
        restore(path)
    assert path.read_text() == "precious"


def _unwritable_dir(tmp_path):
    if os.geteuid() != 0:
        path = tmp_path / "ro"
        path.mkdir()
        path.chmod(0o555)
        return path
    # root ignores permission bits; a read-only mount still refuses writes
    for candidate in ("/sys/fs", "/sys", "/proc/sys"):
        try:
            fd, probe = tempfile.mkstemp(dir=candidate)
        except OSError:
            return candidate
        os.close(fd)
        os.remove(probe)
    pytest.skip("no directory this user cannot write to")


def test_unwritable_checkpoint_dir_is_a_clear_error(tmp_path):
    path = _unwritable_dir(tmp_path)
    with pytest.raises(PermissionError, match=r"checkpoint_dir is not writable.*Received"):
        tfdist.callbacks.checkpoint(path)
    with pytest.raises(PermissionError, match="make_or_restore: checkpoint_dir is not writable"):
        restore(path)


def test_build_fn_must_return_a_compiled_model_and_nothing_is_lost(tmp_path):
    model = build()
    fit(model, 1, callbacks=[tfdist.callbacks.checkpoint(tmp_path)])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    strategy = tf.distribute.get_strategy()
    with pytest.raises(TypeError, match="build_fn must be a callable"):
        tfdist.make_or_restore("build", tmp_path, strategy=strategy)
    with pytest.raises(TypeError, match=r"build_fn must return a compiled keras.Model.*returned 3"):
        tfdist.make_or_restore(lambda: 3, tmp_path, strategy=strategy)

    def uncompiled():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])

    with pytest.raises(ValueError, match=r"build_fn must return a compiled model.*model.compile"):
        tfdist.make_or_restore(uncompiled, tmp_path, strategy=strategy)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_checkpoint_of_another_architecture_is_an_error_not_a_fresh_start(tmp_path):
    fit(build(), 1, callbacks=[tfdist.callbacks.checkpoint(tmp_path)])

    def wider():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        return model

    with pytest.raises(ValueError, match="ckpt-1.keras"):
        tfdist.make_or_restore(wider, tmp_path, strategy=tf.distribute.get_strategy())
    assert (tmp_path / "ckpt-1.keras").exists()


# --------------------------------------------------------------------------- restore


def test_guides_flow_one_epoch_then_two_resumes_and_matches_an_uninterrupted_run(tmp_path):
    reference = build()
    fit(reference, 2)

    model, initial_epoch = restore(tmp_path)
    assert initial_epoch == 0
    assert fit(model, 1, initial_epoch, [tfdist.callbacks.checkpoint(tmp_path)]) == [0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1.keras"]
    # the guides' files load with plain Keras
    plain = keras.models.load_model(tmp_path / "ckpt-1.keras")
    assert int(plain.optimizer.iterations.numpy()) == STEPS_PER_EPOCH

    model, initial_epoch = restore(tmp_path)
    assert initial_epoch == 1
    assert int(model.optimizer.iterations.numpy()) == STEPS_PER_EPOCH
    assert fit(model, 2, initial_epoch, [tfdist.callbacks.checkpoint(tmp_path)]) == [1]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1.keras", "ckpt-2.keras"]
    # same weights: optimizer slots and the dropout RNG state were restored too
    assert_same_weights(model.get_weights(), reference.get_weights())


def test_optimizer_state_survives_make_or_restore(tmp_path):
    model = build()
    fit(model, 1, callbacks=[tfdist.callbacks.checkpoint(tmp_path)])
    restored, _ = restore(tmp_path)
    saved = [v.numpy() for v in model.optimizer.variables]
    loaded = [v.numpy() for v in restored.optimizer.variables]
    assert len(saved) == len(loaded) > 2  # iterations, learning rate, Adam's m and v slots
    assert_same_weights(loaded, saved, atol=0)
    assert int(restored.optimizer.iterations.numpy()) == STEPS_PER_EPOCH


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    model = build()
    fit(model, 2, callbacks=[tfdist.callbacks.checkpoint(tmp_path)])
    epoch1 = keras.models.load_model(tmp_path / "ckpt-1.keras").get_weights()
    newest = tmp_path / "ckpt-2.keras"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

    with pytest.warns(RuntimeWarning, match=r"skipping checkpoint .*ckpt-2\.keras") as said:
        restored, initial_epoch = restore(tmp_path)
    # said once: one warning, and no log record repeating it
    assert len([w for w in said if "ckpt-2.keras" in str(w.message)]) == 1
    assert not [r for r in caplog.records if "ckpt-2.keras" in r.getMessage()]
    assert initial_epoch == 1
    assert_same_weights(restored.get_weights(), epoch1, atol=0)
    # kept for inspection, but no longer counted as a checkpoint
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1.keras", "ckpt-2.keras.corrupt"]


def test_corrupt_member_and_all_corrupt_directory(tmp_path):
    model = build()
    fit(model, 1, callbacks=[tfdist.callbacks.checkpoint(tmp_path)])
    path = tmp_path / "ckpt-1.keras"
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("model.weights.h5")
    # flip a byte inside the stored weights: the zip still opens, the CRC does not match
    name_len, extra_len = struct.unpack(
        "<HH", data[info.header_offset + 26 : info.header_offset + 30]
    )
    middle = info.header_offset + 30 + name_len + extra_len + info.compress_size // 2
    data[middle] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="ckpt-1.keras"):
        fresh, initial_epoch = restore(tmp_path)
    assert initial_epoch == 0
    assert int(fresh.optimizer.iterations.numpy()) == 0


def test_files_from_keras_model_checkpoint_restore(tmp_path):
    model = build()
    writer = keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch}.keras"))
    fit(model, 2, callbacks=[writer])
    restored, initial_epoch = restore(tmp_path)
    assert initial_epoch == 2
    assert_same_weights(restored.get_weights(), model.get_weights(), atol=0)
    assert tfdist.resume_state(restored).step is None


# --------------------------------------------------------------------------- writes


def test_step_checkpoints_are_pruned_and_no_staging_files_remain(tmp_path):
    dead = tmp_path / ".tmp-999999999-nohost-ckpt-7.keras"  # left by a killed save
    dead.write_bytes(b"half")
    live = tmp_path / f".tmp-{os.getppid()}-{os.uname().nodename}-ckpt-8.keras"
    live.write_bytes(b"being written")  # a live process's save in progress: kept

    model = build()
    callback = tfdist.callbacks.checkpoint(tmp_path, save_freq=3, max_to_keep=2)
    fit(model, 3, callbacks=[callback])
    live.unlink()
    # 12 steps: step saves after steps 3, 6 and 9 (ckpt-{epoch}-{batch}), epoch saves
    # after 4, 8 and 12 steps; step 12 ends an epoch and is saved once.
    assert sorted(os.listdir(tmp_path)) == ["ckpt-3-1.keras", "ckpt-3.keras"]
    meta = ckpt.read_resume_metadata(tmp_path / "ckpt-3-1.keras")
    assert (meta["epoch"], meta["batch"], meta["step"]) == (2, 1, 9)
    assert len(meta["rng"]) == 1  # the Dropout layer's seed generator


def test_mid_epoch_checkpoint_resumes_inside_the_epoch(tmp_path):
    model = build()
    fit(model, 1, callbacks=[tfdist.callbacks.checkpoint(tmp_path, save_freq=3, max_to_keep=None)])
    os.remove(tmp_path / "ckpt-1.keras")
    restored, initial_epoch = restore(tmp_path)
    state = tfdist.resume_state(restored)
    assert (initial_epoch, state.batch, state.step) == (0, 3, 3)
    assert int(restored.optimizer.iterations.numpy()) == 3


def test_resuming_mid_epoch_without_a_seeded_pipeline_says_batches_are_replayed(tmp_path, caplog):
    model = build()
    fit(model, 1, callbacks=[tfdist.callbacks.checkpoint(tmp_path, save_freq=3, max_to_keep=None)])
    os.remove(tmp_path / "ckpt-1.keras")
    restored, initial_epoch = restore(tmp_path)
    gc.collect()  # no seeded tfdist.data pipeline left alive by other tests
    with caplog.at_level(logging.WARNING, logger="tfdist.checkpoint"):
        fit(restored, 1, initial_epoch, [tfdist.callbacks.checkpoint(tmp_path)])
    assert "should skip its first 3 batch(es), but no seeded tfdist.data pipeline" in caplog.text


# --------------------------------------------------------------------------- fault injection


def run_job(directory, *extra, devices=None, timeout=240):
    args = [str(SCRIPTS / "ckpt_job.py"), "--dir", str(directory), *extra]
    env = child_env(**({"TFDIST_CPU_DEVICES": devices} if devices else {}))
    return warm_start.run(args, env=env, base_env=child_env(), cwd=REPO, timeout=timeout)


def job_result(proc):
    try:
        return last_json_line(proc.stdout)
    except AssertionError:
        pytest.fail(f"job printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def staging_files(directory):
    return [n for n in os.listdir(directory) if n.startswith(".tmp-")]


def max_diff(a, b):
    return equivalence.max_difference(a, b)


TWO_REPLICAS = ("--save-freq", "3", "--epochs", "2", "--per-replica-batch", "2")  # 16 steps/epoch


@pytest.fixture(scope="module")
def two_replica_reference(tmp_path_factory):
    """An uninterrupted run on 2 logical devices; 2 workers give the same weights."""
    directory = tmp_path_factory.mktemp("reference")
    result = job_result(run_job(directory, *TWO_REPLICAS, devices=2))
    assert result["replicas"] == 2 and result["exit_code"] == 0
    return {**result, "dir": str(directory)}


@pytest.mark.slow
@pytest.mark.devices
def test_kill_in_save_kill_mid_epoch_and_sigterm_then_resume_exactly(
    tmp_path, two_replica_reference
):
    """One job on 2 logical devices, hurt three times, ends as if never interrupted."""
    job = TWO_REPLICAS

    # 1. SIGKILL inside the 4th save (after 12 steps), staging file half written
    proc = run_job(tmp_path, *job, "--sigkill-in-save", "4", devices=2)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert len(staging_files(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path))[-1] == "ckpt-1-9.keras"

    # 2. restart: resumes from the newest complete checkpoint; SIGKILL after step 20
    proc = run_job(tmp_path, *job, "--sigkill-at-step", "20", devices=2)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert staging_files(tmp_path) == []  # the dead save's file was cleaned up
    assert "ckpt-2-2.keras" in os.listdir(tmp_path)  # step 18 = epoch 2, batch 2

    # 3. restart: resumes at step 18 (steps 19-20 are recomputed); SIGTERM at step 25
    proc = run_job(tmp_path, *job, "--sigterm-at-step", "25", devices=2)
    result = job_result(proc)
    assert proc.returncode == RESTART_EXIT_CODE, proc.stderr[-3000:]
    assert result["restored"] == {"path": "ckpt-2-2.keras", "epoch": 1, "batch": 2, "step": 18}
    assert result["trained"][0][:2] == [1, 2]  # the first batch not trained before
    # the checkpoint callback saved after step 25 and exited before later callbacks ran
    assert result["trained"][-1][2] == 24
    assert "ckpt-2-9.keras" in os.listdir(tmp_path)  # step 25 = epoch 2, batch 9

    # 4. restart: finishes; the same weights as the job that was never interrupted
    result = job_result(run_job(tmp_path, *job, devices=2))
    assert result["restored"] == {"path": "ckpt-2-9.keras", "epoch": 1, "batch": 9, "step": 25}
    assert [t[:2] for t in result["trained"]] == [[1, b] for b in range(9, 16)]
    assert result["iterations"] == two_replica_reference["iterations"] == 32
    assert max_diff(result["weights"], two_replica_reference["weights"]) <= 1e-6
    assert staging_files(tmp_path) == []


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_workers_agree_on_the_sigterm_step_save_once_and_resume_exactly(
    tmp_path, two_replica_reference
):
    """SIGTERM reaches worker 1 only; both save after the same step, exit 75, and the
    launcher's restart resumes there and ends with the uninterrupted weights."""
    temp = tmp_path / "tmp"  # where worker 1 stages its (discarded) copy of each save
    temp.mkdir()
    directory = tmp_path / "ckpt"
    command = [
        sys.executable, "-m", "tfdist", "launch", "-n", "2", "--max-restarts", "1",
        str(SCRIPTS / "ckpt_job.py"), "--dir", str(directory), *TWO_REPLICAS,
        "--sigterm-at-step", "10", "--sigterm-rank", "1",
    ]  # fmt: skip
    proc = subprocess.run(
        command, env=child_env(TMPDIR=str(temp)), capture_output=True, text=True, timeout=480
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    results = {
        worker: [json.loads(line[5:]) for line in proc.stdout.splitlines()
                 if line.startswith(f"[{worker}] {{") and '"weights"' in line]
        for worker in ("w0", "w1")
    }  # fmt: skip
    for worker in ("w0", "w1"):
        preempted, resumed = results[worker]
        assert preempted["exit_code"] == RESTART_EXIT_CODE
        assert preempted["iterations"] == 11  # the step after the notice, on both workers
        assert resumed["restored"] == {
            "path": "ckpt-1-11.keras",
            "epoch": 0,
            "batch": 11,
            "step": 11,
        }
        assert max_diff(resumed["weights"], two_replica_reference["weights"]) <= 1e-6
    assert "[w1] tfdist: SIGTERM received" in output
    assert "[w0] tfdist: SIGTERM received" not in output
    assert staging_files(directory) == []
    assert [n for n in os.listdir(temp) if n.startswith("tfdist-worker")] == []


@pytest.mark.slow
@pytest.mark.multiworker
def test_workers_that_see_different_checkpoints_fail_clearly(tmp_path, two_replica_reference):
    """A checkpoint dir on local disks: worker 0 finds checkpoints, worker 1 none."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for name in two_replica_reference["checkpoints"]:
        shutil.copy(os.path.join(two_replica_reference["dir"], name), directory)
    command = [
        sys.executable, "-m", "tfdist", "launch", "-n", "2", str(SCRIPTS / "ckpt_job.py"),
        "--dir", str(directory), "--dir-per-rank", *TWO_REPLICAS,
    ]  # fmt: skip
    proc = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    # both workers fail at once with the reason (none waits for the other)
    assert output.count("the workers found different checkpoints") >= 2, output[-4000:]
    assert "did not exit in time" not in output


def test_resume_metadata_is_json_in_the_archive(tmp_path):
    fit(build(), 1, callbacks=[tfdist.callbacks.checkpoint(tmp_path)])
    with zipfile.ZipFile(tmp_path / "ckpt-1.keras") as zf:
        meta = json.loads(zf.read(ckpt.RESUME_MEMBER))
    assert meta["epoch"] == 1 and meta["batch"] == 0 and meta["step"] == STEPS_PER_EPOCH
