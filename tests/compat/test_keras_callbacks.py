"""Keras's own file-writing callbacks in a multi-worker job (tfdist.compat.chief_checkpoints and chief_writes).

One job script (tests/scripts/keras_callbacks_job.py) trains with ModelCheckpoint
(``.weights.h5`` per epoch, ``save_best_only`` ``.keras``, ``save_freq`` in steps),
BackupAndRestore, CSVLogger, TensorBoard, LearningRateScheduler, ReduceLROnPlateau and
EarlyStopping in one fit, on one process and on two workers (TensorFlow's
MultiWorkerMirroredStrategy; jax's multi-process runtime), and lists and loads every
file it finds. Two workers must end where one process ends (weights within 1e-5, the
same epochs, learning rates and checkpoint contents), with each file written once (by
the chief) and nothing left in the workers' temporary directories. The job's initial
weights come from numpy, so one TensorFlow process is the reference for both backends.
Without the fixes the workers collide (h5py's lock, ``FileExistsError``); with them a
backup survives a kill -9 and a torn write and the job resumes exactly.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tfdist import compat, saving
from tfdist.compat import chief_checkpoints, chief_writes
from tfdist.core import atomic, fix_registry, upstream

from conftest import REPO, SCRIPTS, child_env, equivalence, last_json_line, launch_cli, warm_start

TOL = 1e-5
JOB = str(SCRIPTS / "keras_callbacks_job.py")
FIXES = [fix.name for fix in chief_checkpoints.FIXES + chief_writes.FIXES]
EVENTS = re.compile(r"events\.out\.tfevents\.[^/]+$")
COLLISION = re.compile(r"unable to lock file|FileExistsError")


# ------------------------------------------------------------------ helpers


def run_one_process(directory, *argv, timeout=240, **env):
    proc = warm_start.run(
        [str(JOB), "--dir", str(directory), *argv],
        env=child_env(**env),
        base_env=child_env(),
        cwd=REPO,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return last_json_line(proc.stdout)


def worker_results(proc) -> dict[int, dict]:
    """The last JSON line each worker printed, by rank."""
    found = {}
    for line in proc.stdout.splitlines():
        match = re.match(r"^\[w(\d+)\] (\{.*\})$", line)
        if match and '"variants"' in line:
            found[int(match.group(1))] = json.loads(match.group(2))
    return found


def launch(tmp_path, *argv, timeout=400, **env):
    """``tfdist launch -n 2 ... JOB argv`` with the workers' TMPDIR under ``tmp_path``."""
    temp = tmp_path / "worker-tmp"
    temp.mkdir(exist_ok=True)
    return launch_cli(*argv, timeout=timeout, TMPDIR=str(temp), **env), temp


def normalized(files: dict) -> dict:
    """Files and what loading them gave, TensorBoard's host/pid file names as one name."""
    return {EVENTS.sub("events.out.tfevents.*", name): value for name, value in files.items()}


def max_diff(a, b) -> float:
    return equivalence.max_difference(a, b)


def assert_like_one_process(results: dict[int, dict], reference: dict, variant: str) -> None:
    """Both workers: the reference's weights, epochs, rates and files, each file once."""
    assert sorted(results) == [0, 1]
    assert [results[r]["chief"] for r in (0, 1)] == [True, False]
    expected = reference["variants"][variant]
    for rank, result in results.items():
        got = result["variants"][variant]
        assert max_diff(got["weights"], expected["weights"]) <= TOL, rank
        # EarlyStopping stopped, and ReduceLROnPlateau cut the rate, at the same epochs.
        assert got["epochs"] == expected["epochs"], rank
        equivalence.assert_allclose(got["rates"], expected["rates"], rtol=1e-6, err_msg=str(rank))
        files, want = normalized(got["files"]), normalized(expected["files"])
        assert sorted(files) == sorted(want), rank
        events = [name for name in got["files"] if EVENTS.search(name)]
        assert len(events) == 1, (rank, events)  # TensorBoard's too: one writer
        for name, value in want.items():
            if isinstance(value, float):  # a checkpoint: loaded, holding the same weights
                assert abs(files[name] - value) <= TOL, (rank, name)
            else:
                assert files[name] == value, (rank, name)
    # Every worker saw the same logs, so every decision from them was the same.
    assert results[0]["variants"][variant]["history"] == results[1]["variants"][variant]["history"]


def assert_nothing_left(directory: Path, temp: Path) -> None:
    staging = [p for p in directory.rglob("*") if atomic.is_staging_name(p.name)]
    assert staging == []
    assert [p.name for p in temp.iterdir() if p.name.startswith("tfdist-worker")] == []


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Both variants on one TensorFlow process: the reference of every multi-worker run."""
    directory = tmp_path_factory.mktemp("one-process")
    result = run_one_process(directory, "--variant", "all,backup")
    every = result["variants"]["all"]
    # The reference exercises what the multi-worker runs must agree on: EarlyStopping
    # ends the fit early, ReduceLROnPlateau cuts the rate before the last epoch.
    assert len(every["epochs"]) < 8
    assert every["rates"][-1] < 0.5 * every["rates"][-2]  # the schedule alone gives 0.9x
    return result


# ------------------------------------------------------------------ unit


def test_chief_write_fixes_are_registered_guarded_and_documented():
    required = {entry for entries in upstream.REQUIRED.values() for entry in entries}
    assert FIXES == [
        "keras_model_checkpoint_chief_writes",
        "keras_backup_and_restore_chief_writes",
        "keras_csv_logger_chief_only",
        "keras_tensorboard_chief_only",
        "keras_user_saves_chief_writes",
    ]
    for fix in chief_checkpoints.FIXES + chief_writes.FIXES:
        assert fix.name in compat.fix_names()
        assert fix_registry.guard(fix) is None, fix.name
        assert len(fix.apply.__doc__.split()) > 60, fix.name
        for target in fix.targets:
            private = any(p.startswith("_") for p in target.entry.replace(":", ".").split("."))
            if target.instance:
                assert target.entry in upstream.SOURCE_ATTRIBUTES, target.entry
            elif private:
                assert target.entry in required, target.entry


def test_one_process_calls_upstream_unchanged(tmp_path, monkeypatch):
    import keras

    compat.apply_all()
    assert set(FIXES) <= set(compat.applied())

    def never(*args, **kwargs):
        raise AssertionError("a one-process save went through the multi-worker protocol")

    monkeypatch.setattr(saving, "write_on_every_worker", never)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    callbacks = [
        keras.callbacks.ModelCheckpoint(tmp_path / "w-{epoch}.weights.h5", save_weights_only=True),
        keras.callbacks.BackupAndRestore(tmp_path / "backup", delete_checkpoint=False),
        keras.callbacks.CSVLogger(tmp_path / "log.csv"),
        keras.callbacks.TensorBoard(tmp_path / "tb"),
    ]
    x = np.ones((8, 2), "float32")
    model.fit(x, x[:, :1], epochs=2, verbose=0, callbacks=callbacks)
    assert not saving.has_other_workers(model)
    assert sorted(p.name for p in tmp_path.glob("w-*")) == ["w-1.weights.h5", "w-2.weights.h5"]
    backup = tmp_path / "backup"
    assert json.loads((backup / "training_metadata.json").read_text())["epoch"] == 2
    # upstream's backup: no tfdist metadata inside the weights file
    assert chief_checkpoints.embedded_position(str(backup / "latest.weights.h5")) is None
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 3
    assert len(list((tmp_path / "tb" / "train").iterdir())) == 1


# ------------------------------------------------------------------ two workers


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_tensorflow_workers_write_each_file_once_and_match_one_process(tmp_path, one_process):
    directory = tmp_path / "out"
    proc, temp = launch(tmp_path, "-n", "2", JOB, "--dir", str(directory), "--variant", "all")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = worker_results(proc)
    assert {r["replicas"] for r in results.values()} == {2}
    assert_like_one_process(results, one_process, "all")
    assert_nothing_left(directory, temp)
    # The backup's weights file records the epoch it belongs to (its one atomic commit).
    latest = directory / "all" / "backup" / "latest.weights.h5"
    epochs = len(one_process["variants"]["all"]["epochs"])
    assert chief_checkpoints.embedded_position(str(latest)) == {"epoch": epochs, "batch": 0}


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.jax
def test_two_jax_processes_write_each_file_once_and_match_one_process(tmp_path, one_process):
    directory = tmp_path / "out"
    proc, temp = launch(
        tmp_path, "-n", "2", JOB, "--dir", str(directory), "--variant", "all", KERAS_BACKEND="jax"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = worker_results(proc)
    assert {(r["replicas"], r["workers"]) for r in results.values()} == {(2, 2)}
    assert_like_one_process(results, one_process, "all")
    assert_nothing_left(directory, temp)


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.upstream_failure(
    "keras_model_checkpoint_chief_writes",
    "keras_backup_and_restore_chief_writes",
    "keras_csv_logger_chief_only",
    "keras_tensorboard_chief_only",
)
def test_upstream_callbacks_collide_without_the_fixes(tmp_path):
    """Upstream: both workers write every file. If this fails because the job succeeds,
    Keras fixed it: retire the fix."""
    # 1. No fix: both workers write ModelCheckpoint's step file (batch 5) into one HDF5 path.
    # Whether that first write or a later one (an epoch's ckpt_1) is the one that fails
    # depends on timing (the HDF5 lock is a race), so only the collision is asserted.
    first = tmp_path / "none"
    proc, _ = launch(
        tmp_path, "-n", "2", JOB, "--dir", str(first), "--variant", "all",
        TFDIST_COMPAT_EXCLUDE=",".join(FIXES),
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert COLLISION.search(output), output[-4000:]
    assert (first / "all" / "steps" / "step-1-5.weights.h5").exists()  # the file fought over
    assert len(list((first / "all" / "tb" / "train").glob("events.*"))) == 2  # one per worker

    # 2. ModelCheckpoint fixed: BackupAndRestore collides at the end of the first epoch,
    # after both workers wrote CSVLogger's header and first row into the one file.
    second = tmp_path / "backup"
    proc, _ = launch(
        tmp_path, "-n", "2", JOB, "--dir", str(second), "--variant", "all",
        TFDIST_COMPAT_EXCLUDE=",".join(FIXES[1:]),
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert COLLISION.search(output), output[-4000:]
    assert (second / "all" / "backup").is_dir()
    rows = [r.split(",")[0] for r in (second / "all" / "log.csv").read_text().splitlines()]
    # Both workers wrote the header and every row they reached into the one file. Which
    # epoch's backup collides first depends on timing (the HDF5 lock is a race), so only
    # the doubling is asserted: each epoch's row twice, and epoch 0 was reached.
    assert rows.count("epoch") == 2 and rows.count("0") == 2, rows
    assert all(rows.count(r) == 2 for r in rows), rows
    assert (second / "all" / "ckpt" / "ckpt_1.weights.h5").is_file()  # the fixed save landed


@pytest.mark.slow
@pytest.mark.multiworker
def test_backup_survives_kill_9_and_a_torn_write_then_resumes_exactly(tmp_path, one_process):
    """Attempt 0: worker 1 is SIGKILLed when epoch 2 begins (backups of epochs 0-1 exist).
    Attempt 1 resumes at epoch 2; the chief is SIGKILLed with the backup of epoch 3 half
    written. Attempt 2 resumes at epoch 3, from the last complete backup, and ends with
    the weights of the uninterrupted run."""
    directory = tmp_path / "out"
    proc, temp = launch(
        tmp_path, "-n", "2", "--max-restarts", "2", JOB, "--dir", str(directory),
        "--variant", "backup", "--kill-rank", "1", "--kill-epoch", "2",
        "--tear-rank", "0", "--tear-epoch", "3", timeout=500,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "[w1] worker 1: SIGKILL at the start of epoch 2" in output
    assert re.search(r"\[w0\] worker 0: SIGKILL with \S+/\.tmp-\S+latest\.weights\.h5 half", output)
    assert "(restart 2 of 2)" in output
    assert "removed staging files left by an interrupted save" in output
    results = worker_results(proc)
    assert sorted(results) == [0, 1]
    expected = one_process["variants"]["backup"]
    for rank, result in results.items():
        got = result["variants"]["backup"]
        assert got["epochs"] == [3, 4, 5, 6, 7], rank  # every worker restored the same backup
        assert max_diff(got["weights"], expected["weights"]) <= TOL, rank
        # the checkpoints of every epoch, from all three attempts, hold the uninterrupted run's
        assert sorted(got["files"]) == sorted(expected["files"])
        for name, value in expected["files"].items():
            assert abs(got["files"][name] - value) <= TOL, (rank, name)
    assert not (directory / "backup" / "backup").exists()  # deleted at the end, by the chief
    assert_nothing_left(directory, temp)


# ------------------------------------------------------------------ the tutorial


def _mnist_data_dir(tmp_path_factory) -> str:
    """TFDS_DATA_DIR with MNIST, or a small stand-in in tfds's format (no download)."""
    real = Path(os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")).expanduser()
    if list(real.glob("mnist/*/dataset_info.json")):  # prepared, not a download under way
        return str(real)
    from tensorflow_datasets.image_classification import mnist

    class StandIn(mnist.MNIST, skip_registration=True):
        """MNIST's features and version; 512 synthetic training images."""

        name = "mnist"

        def _split_generators(self, dl_manager):
            return {
                "train": self._generate_examples(512, 0),
                "test": self._generate_examples(64, 1),
            }

        def _generate_examples(self, num_examples, seed):
            rng = np.random.default_rng(seed)
            for i in range(num_examples):
                label = int(rng.integers(10))
                image = (rng.random((28, 28, 1)) * 64).astype("uint8")
                image[2 * label : 2 * label + 4] = 255  # learnable: a bar where the label says
                yield i, {"image": image, "label": label}

    directory = tmp_path_factory.mktemp("tfds")
    StandIn(data_dir=str(directory)).download_and_prepare()
    return str(directory)


@pytest.mark.slow
@pytest.mark.multiworker
def test_tutorial_second_half_runs_on_two_workers(tmp_path, tmp_path_factory):
    """TensorFlow's "Multi-worker training with Keras", second half (saving, checkpoints,
    BackupAndRestore three ways) under ``tfdist launch -n 2``. Upstream worker 0 dies
    with FileExistsError on backup_dir (or an HDF5 lock error)."""
    root = tmp_path / "tutorial"
    root.mkdir()
    closed = "http://127.0.0.1:9"  # any download attempt fails at once
    proc, temp = launch(
        tmp_path, "-n", "2", str(SCRIPTS / "tutorial" / "keras_multi_worker_part2.py"), str(root),
        timeout=590, TFDS_DATA_DIR=_mnist_data_dir(tmp_path_factory),
        HTTP_PROXY=closed, HTTPS_PROXY=closed,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "all 2 worker(s) finished: w0 exited 0, w1 exited 0" in proc.stderr
    assert not COLLISION.search(output)
    # three BackupAndRestore fits of 3 epochs (progress on the chief only)
    assert re.findall(r"^\[w0\] Epoch 3/3$", proc.stdout, flags=re.M) == ["[w0] Epoch 3/3"] * 3
    assert zipfile.is_zipfile(root / "keras-model.keras")
    assert (root / "ckpt" / "checkpoint").is_file()
    assert not (root / "backup").exists()  # each fit's backup deleted at its end, by the chief
    assert_nothing_left(root, temp)
