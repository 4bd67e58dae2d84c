"""Damaged checkpoints never make a crash loop (issue 12 item 6).

Each test hurts a copy of a real checkpoint directory (ckpt-1..3.keras from 3 epochs)
in one way, restarts the job (``make_or_restore``, then one more epoch with the
checkpoint callback, as a restarted script does) and checks either that the right
checkpoint was restored (weights equal to that file's, bitwise) with the damaged file
moved aside as ``*.corrupt``, or that the job failed at once with a message naming the
path and the fix. Then it restarts again: the second restart must not loop (no warning,
the checkpoint the first restart saved, or the same clear error).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import warnings
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import checkpoint as ckpt
from tfdist.checkpoint import names

from conftest import SCRIPTS, child_env, equivalence, last_json_line

sys.path.insert(0, str(SCRIPTS))
from damage_job import X, Y, build  # noqa: E402

NEWEST = "ckpt-3.keras"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """ckpt-1..3.keras of a 3-epoch run and the weights each holds."""
    directory = tmp_path_factory.mktemp("pristine")
    model = build()
    model.fit(X, Y, batch_size=8, shuffle=False, epochs=3, verbose=0,
              callbacks=[tfdist.callbacks.checkpoint(directory)])  # fmt: skip
    files = sorted(os.listdir(directory))
    assert files == ["ckpt-1.keras", "ckpt-2.keras", NEWEST]
    weights = {n: keras.models.load_model(directory / n).get_weights() for n in files}
    return directory, weights


@pytest.fixture
def job(tmp_path, pristine):
    """A fresh copy of the pristine checkpoint directory."""
    directory = tmp_path / "ckpt"
    shutil.copytree(pristine[0], directory)
    return directory


def restart(directory, epochs=4):
    """Restores (recording RuntimeWarnings), then trains to ``epochs`` with the callback."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, initial_epoch = tfdist.make_or_restore(
            build, directory, strategy=tf.distribute.get_strategy()
        )
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    state = ckpt.resume_state(model)
    restored = None if state is None else os.path.basename(state.path)
    weights = model.get_weights()
    model.fit(X, Y, batch_size=8, shuffle=False, epochs=epochs, verbose=0,
              initial_epoch=initial_epoch, callbacks=[tfdist.callbacks.checkpoint(directory)])  # fmt: skip
    return restored, initial_epoch, weights, said


def assert_falls_back(directory, pristine, damaged, expected):
    """Restart skips ``damaged`` (warned, kept as .corrupt), restores ``expected``; the
    next restart restores the checkpoint that restart saved, without a warning."""
    restored, initial_epoch, weights, said = restart(directory)
    assert restored == expected
    if expected is None:
        assert initial_epoch == 0
    else:
        assert initial_epoch == names.parse_checkpoint_name(expected).epoch
        for got, want in zip(weights, pristine[1][expected], strict=True):
            equivalence.assert_allclose(got, want)
    for name in damaged:
        assert any(name in text and "skipping checkpoint" in text for text in said), said
        assert os.path.lexists(directory / (name + names.CORRUPT_SUFFIX))
    assert len(said) == len(damaged)
    again = restart(directory)
    assert (again[0], again[1], again[3]) == ("ckpt-4.keras", 4, [])


def rewrite_member(path, member, data=None):
    """Rewrites a zip with ``member`` replaced by ``data`` (None: left out): valid CRCs."""
    with zipfile.ZipFile(path) as zf:
        members = [(info.filename, zf.read(info.filename)) for info in zf.infolist()]
    with zipfile.ZipFile(path, "w") as zf:
        for name, content in members:
            if name == member and data is None:
                continue
            zf.writestr(name, data if name == member else content)


def garbage(size, seed=1):
    return np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes()


# --------------------------------------------------------------------------- the file's bytes


def test_truncated_zip(job, pristine):
    path = job / NEWEST
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    assert_falls_back(job, pristine, [NEWEST], "ckpt-2.keras")


def test_zero_byte_file(job, pristine):
    (job / NEWEST).write_bytes(b"")
    assert_falls_back(job, pristine, [NEWEST], "ckpt-2.keras")


def test_random_bytes(job, pristine):
    (job / NEWEST).write_bytes(garbage(20000))
    assert_falls_back(job, pristine, [NEWEST], "ckpt-2.keras")


def test_valid_zip_missing_the_weights_member(job, pristine):
    rewrite_member(job / NEWEST, "model.weights.h5")
    assert_falls_back(job, pristine, [NEWEST], "ckpt-2.keras")


def test_garbage_weights_member_with_a_valid_crc(job, pristine):
    """The crash loop of the issue: Keras raised OSError (h5py) at every restart."""
    rewrite_member(job / NEWEST, "model.weights.h5", garbage(30000))
    assert_falls_back(job, pristine, [NEWEST], "ckpt-2.keras")


def test_truncated_weights_member_with_a_valid_crc(job, pristine):
    with zipfile.ZipFile(job / NEWEST) as zf:
        h5 = zf.read("model.weights.h5")
    rewrite_member(job / NEWEST, "model.weights.h5", h5[: len(h5) * 3 // 4])
    assert_falls_back(job, pristine, [NEWEST], "ckpt-2.keras")


@pytest.mark.parametrize("config", [b"{not json", b"\xff\xfe", b"[1, 2]"])
def test_garbage_or_wrong_shaped_config_json(job, pristine, config):
    rewrite_member(job / NEWEST, "config.json", config)
    assert_falls_back(job, pristine, [NEWEST], "ckpt-2.keras")


@pytest.mark.parametrize(
    "meta",
    [b"{truncated", b'{"epoch": "3", "batch": 0}', b'{"epoch": 3, "batch": 0, "rng": "x"}'],
)
def test_damaged_resume_metadata(job, pristine, meta):
    rewrite_member(job / NEWEST, ckpt.RESUME_MEMBER, meta)
    assert_falls_back(job, pristine, [NEWEST], "ckpt-2.keras")


def test_newest_two_damaged_falls_back_further_and_all_damaged_starts_fresh(
    job, pristine, tmp_path
):
    (job / NEWEST).write_bytes(b"")
    rewrite_member(job / "ckpt-2.keras", "model.weights.h5", garbage(1000))
    assert_falls_back(job, pristine, [NEWEST, "ckpt-2.keras"], "ckpt-1.keras")

    every = tmp_path / "every"
    shutil.copytree(pristine[0], every)
    for name in os.listdir(every):
        (every / name).write_bytes(garbage(100))
    assert_falls_back(every, pristine, ["ckpt-1.keras", "ckpt-2.keras", NEWEST], None)


def test_a_second_damaged_file_of_the_same_name_is_kept_too(job, pristine):
    (job / (NEWEST + names.CORRUPT_SUFFIX)).write_bytes(b"an older damaged ckpt-3")
    (job / NEWEST).write_bytes(b"")
    restored, *_ = restart(job)
    assert restored == "ckpt-2.keras"
    assert (job / (NEWEST + names.CORRUPT_SUFFIX)).read_bytes() == b"an older damaged ckpt-3"
    assert (job / f"{NEWEST}.2{names.CORRUPT_SUFFIX}").read_bytes() == b""


def test_resume_metadata_missing_is_a_keras_file_not_damage(job, pristine):
    rewrite_member(job / NEWEST, ckpt.RESUME_MEMBER)
    restored, initial_epoch, weights, said = restart(job)
    assert (restored, initial_epoch, said) == (NEWEST, 3, [])
    for got, want in zip(weights, pristine[1][NEWEST], strict=True):
        equivalence.assert_allclose(got, want)


# --------------------------------------------------------------------------- the directory entry


@pytest.mark.parametrize("kind", ["dangling symlink", "fifo"])
def test_dangling_symlink_or_fifo(job, pristine, kind):
    if kind == "fifo":
        os.mkfifo(job / "ckpt-5.keras")  # opening it to read would wait for a writer
    else:
        os.symlink(job / "gone.keras", job / "ckpt-5.keras")
    assert_falls_back(job, pristine, ["ckpt-5.keras"], NEWEST)


def test_staging_file_left_by_a_kill_during_save(job, pristine):
    dead = job / f".tmp-999999999-{socket.gethostname()}-ckpt-4.keras"
    dead.write_bytes(garbage(5000))
    restored, initial_epoch, _, said = restart(job, epochs=3)
    assert (restored, initial_epoch, said) == (NEWEST, 3, [])
    assert not dead.exists()  # removed at train begin


def test_directory_with_a_checkpoint_name_fails_before_training(job, pristine):
    blocker = job / "ckpt-4.keras"
    blocker.mkdir()
    (blocker / "precious").write_text("user data")
    for _attempt in range(2):  # a clear error each time, nothing moved or trained
        with pytest.raises(IsADirectoryError, match=r"ckpt-4\.keras.*a directory.*Move it out"):
            restart(job)
    assert (blocker / "precious").read_text() == "user data"
    assert sorted(os.listdir(job)) == ["ckpt-1.keras", "ckpt-2.keras", NEWEST, "ckpt-4.keras"]
    assert names.blocked_paths(job) == [str(blocker)]
    shutil.move(blocker, job.parent / "moved")
    assert restart(job)[:2] == (NEWEST, 3)


def _chattr(flag, path):
    proc = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True)
    return proc.returncode == 0


def test_immutable_checkpoint_file_or_directory_fails_before_training(job, pristine):
    if not _chattr("+i", job / "ckpt-1.keras"):
        pytest.skip("this filesystem has no immutable flag (chattr +i)")
    try:
        with pytest.raises(PermissionError, match=r"ckpt-1\.keras.*immutable.*chattr -i"):
            restart(job)
        with pytest.raises(PermissionError, match="ckpt-1.keras"):
            names.check_save_target(job, "on_train_begin")
    finally:
        _chattr("-i", job / "ckpt-1.keras")
    assert names.blocked_paths(job) == []
    assert _chattr("+i", job)  # the directory itself: no file can be created in it
    try:
        with pytest.raises(PermissionError, match="checkpoint_dir is not writable"):
            restart(job)
    finally:
        _chattr("-i", job)
    assert restart(job)[:2] == (NEWEST, 3)


def test_unreadable_file(job, pristine):
    """chmod 000 does not stop root: the restart runs without CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH (setpriv), as a non-root user would."""
    (job / NEWEST).chmod(0)
    caps = "-dac_override,-dac_read_search"
    command = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--",
               sys.executable, str(SCRIPTS / "damage_job.py"), "--dir", str(job)]  # fmt: skip
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv to drop root's file capabilities")
    for expected in (["skipping checkpoint"], []):  # the second restart: no warning
        proc = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                              timeout=180)  # fmt: skip
        result = last_json_line(proc.stdout)
        assert result["restored"] == "ckpt-2.keras", proc.stderr[-3000:]
        assert [e for e in expected if any(e in w for w in result["warnings"])] == expected
        assert len(result["warnings"]) == len(expected)
        for got, want in zip(result["weights"], pristine[1]["ckpt-2.keras"], strict=True):
            equivalence.assert_allclose(np.asarray(got, "float32"), want)
    assert (job / (NEWEST + names.CORRUPT_SUFFIX)).exists()


@pytest.mark.jax
def test_jax_backend_skips_a_garbage_weights_member_too(job, pristine):
    rewrite_member(job / NEWEST, "model.weights.h5", garbage(30000))
    command = [sys.executable, str(SCRIPTS / "damage_job.py"), "--dir", str(job)]
    for warned in (1, 0):  # the second restart: no warning
        proc = subprocess.run(command, env=child_env(KERAS_BACKEND="jax"), capture_output=True,
                              text=True, timeout=180)  # fmt: skip
        result = last_json_line(proc.stdout)
        assert result.get("restored") == "ckpt-2.keras", (result.get("error"), proc.stderr[-3000:])
        assert len(result["warnings"]) == warned
        for got, want in zip(result["weights"], pristine[1]["ckpt-2.keras"], strict=True):
            equivalence.assert_allclose(np.asarray(got, "float32"), want)


# --------------------------------------------------------------------------- the model


def test_checkpoint_of_another_shape_is_a_clear_error_every_time_and_kept(job):
    def wider():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(9), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        return model

    before = {p.name: p.read_bytes() for p in job.iterdir()}
    for _attempt in range(2):  # not skipped, not renamed: the same error at every start
        with pytest.raises(ValueError, match=r"ckpt-3\.keras.*does not fit the model.*build_fn"):
            tfdist.make_or_restore(wider, job, strategy=tf.distribute.get_strategy())
    assert {p.name: p.read_bytes() for p in job.iterdir()} == before


def test_a_model_instance_instead_of_build_fn_is_a_clear_type_error(job):
    model = build()
    with pytest.raises(
        TypeError,
        match=r"make_or_restore: build_fn must be a function that builds and compiles the "
        r"model, not a model instance\. Received: build_fn=<Sequential.*make_or_restore\(",
    ):
        tfdist.make_or_restore(model, job, strategy=tf.distribute.get_strategy())


# --------------------------------------------------------------------------- many workers


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_workers_skip_the_same_damaged_checkpoint(job, pristine):
    """Both workers fall back to the same checkpoint (only the chief moves the file
    aside), and the next start of the group restores it again without a warning."""
    rewrite_member(job / NEWEST, "model.weights.h5", garbage(30000))
    command = [sys.executable, "-m", "tfdist", "launch", "-n", "2",
               str(SCRIPTS / "damage_job.py"), "--dir", str(job)]  # fmt: skip
    for attempt in range(2):
        proc = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        results = {
            line[1:3]: json.loads(line[5:])
            for line in proc.stdout.splitlines()
            if line[:5] in ("[w0] ", "[w1] ") and line[5:].startswith("{")
        }
        assert sorted(results) == ["w0", "w1"], proc.stdout[-3000:]
        # worker 1 may list the directory after the chief moved the file: no warning
        assert len(results["w0"]["warnings"]) == (1 if attempt == 0 else 0)
        assert len(results["w1"]["warnings"]) <= (1 if attempt == 0 else 0)
        for result in results.values():
            assert result["restored"] == "ckpt-2.keras"
            for got, want in zip(result["weights"], pristine[1]["ckpt-2.keras"], strict=True):
                equivalence.assert_allclose(np.asarray(got, "float32"), want)
        assert sorted(os.listdir(job)) == ["ckpt-1.keras", "ckpt-2.keras", NEWEST + ".corrupt"]


def test_a_save_that_would_fail_fails_at_train_begin(tmp_path):
    import keras
    import numpy as np

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    callback = tfdist.callbacks.checkpoint(tmp_path)
    (tmp_path / "ckpt-2.keras").mkdir()
    with pytest.raises(
        IsADirectoryError, match=r"tfdist.callbacks.checkpoint: .*ckpt-2\.keras.*a directory"
    ):
        model.fit(
            np.ones((16, 2)),
            np.ones((16, 1)),
            batch_size=8,
            epochs=2,
            verbose=0,
            callbacks=[callback],
        )
    assert int(model.optimizer.iterations.numpy()) == 0  # nothing trained, nothing lost
