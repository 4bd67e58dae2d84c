"""tfdist.save / tfdist.load: formats, atomic chief-only writes, scopes, replicas, safe_mode."""

from __future__ import annotations

import glob
import json
import os
import tempfile

import keras
import numpy as np
import pytest

import tfdist
from tfdist import saving
from tfdist.core import atomic
from tfdist.core.cluster import worker_tf_config

from conftest import equivalence, last_json_line, run_python

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]


def tiny_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), epochs=1, verbose=0)
    return model


# --------------------------------------------------------------------------- who writes where


def test_write_role_comes_from_tf_config(monkeypatch):
    assert atomic.write_role() == atomic.WriteRole(is_chief=True, rank=0)
    monkeypatch.setenv("TF_CONFIG", worker_tf_config(ADDRESSES, 0))
    assert atomic.write_role() == atomic.WriteRole(is_chief=True, rank=0)
    monkeypatch.setenv("TF_CONFIG", worker_tf_config(ADDRESSES, 1))
    assert atomic.write_role() == atomic.WriteRole(is_chief=False, rank=1)
    with_chief = {
        "cluster": {"chief": ["127.0.0.1:3"], "worker": ADDRESSES},
        "task": {"type": "worker", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(with_chief))
    assert atomic.write_role() == atomic.WriteRole(is_chief=False, rank=1)


def test_staging_paths_chief_next_to_the_file_workers_in_a_temp_dir(tmp_path):
    final = tmp_path / "ckpt" / "ckpt-3.keras"
    chief = atomic.staging_path(final, atomic.WriteRole(True, 0))
    assert os.path.dirname(chief) == str(final.parent)  # same filesystem: rename is atomic
    assert os.path.basename(chief).startswith(".tmp-") and chief.endswith("ckpt-3.keras")
    worker = atomic.staging_path(final, atomic.WriteRole(False, 2), tmp_root="/scratch")
    assert worker.startswith("/scratch/tfdist-worker2-") and worker.endswith("/ckpt-3.keras")
    assert atomic.is_staging_name(os.path.basename(chief))


def test_atomic_output_chief_renames_worker_writes_nothing_failure_keeps_old(tmp_path):
    final = tmp_path / "out.bin"
    final.write_text("old")
    with atomic.atomic_output(final, role=atomic.WriteRole(True, 0)) as staging:
        assert not os.path.exists(staging)
        with open(staging, "w") as f:
            f.write("new")
        assert final.read_text() == "old"  # nothing visible before the rename
    assert final.read_text() == "new"
    assert os.listdir(tmp_path) == ["out.bin"]

    with atomic.atomic_output(final, role=atomic.WriteRole(False, 1)) as staging:
        with open(staging, "w") as f:
            f.write("worker")
    assert final.read_text() == "new"
    assert not os.path.exists(os.path.dirname(staging))  # its temp dir is removed

    with pytest.raises(RuntimeError, match="boom"):
        with atomic.atomic_output(final, role=atomic.WriteRole(True, 0)) as staging:
            with open(staging, "w") as f:
                f.write("half")
            raise RuntimeError("boom")
    assert final.read_text() == "new"
    assert os.listdir(tmp_path) == ["out.bin"]


def _write_slowly(path, chunks: int, chunk: bytes, pause_s: float = 0.02) -> None:
    import time

    with open(path, "wb") as f:
        for _ in range(chunks):
            f.write(chunk)
            f.flush()
            time.sleep(pause_s)  # the flusher polls every 5 ms: it sees the file grow


def test_atomic_output_flushes_the_chiefs_file_while_it_is_written(tmp_path, monkeypatch):
    flushed, real = [], os.fdatasync
    monkeypatch.setattr(
        saving.os, "fdatasync", lambda fd: (flushed.append(os.fstat(fd).st_size), real(fd))
    )
    final = tmp_path / "big.bin"
    chunk = b"x" * (1 << 20)
    with atomic.atomic_output(final, role=atomic.WriteRole(True, 0)) as staging:
        _write_slowly(staging, 12, chunk)
    assert final.read_bytes() == chunk * 12
    # Flushed as it grew (each flush >= 4 MiB after the last), before the final fsync.
    assert flushed and flushed == sorted(flushed) and flushed[0] >= 4 << 20
    assert all(b - a >= 4 << 20 for a, b in zip(flushed, flushed[1:], strict=False))

    flushed.clear()  # another worker's file is removed, never flushed
    with atomic.atomic_output(final, role=atomic.WriteRole(False, 1)) as staging:
        _write_slowly(staging, 6, chunk)
    assert flushed == [] and final.read_bytes() == chunk * 12


def test_atomic_output_a_failed_flush_keeps_the_old_file(tmp_path, monkeypatch):
    import errno

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(saving.os, "fdatasync", failing)
    final = tmp_path / "big.bin"
    final.write_text("old")
    # Linux reports a write-back error to one fsync only: the flusher's must not be lost.
    with pytest.raises(OSError, match=r"flushing .*big\.bin.* failed .*Input/output error"):
        with atomic.atomic_output(final, role=atomic.WriteRole(True, 0)) as staging:
            _write_slowly(staging, 6, b"x" * (1 << 20))
    assert final.read_text() == "old"
    assert os.listdir(tmp_path) == ["big.bin"]


def test_atomic_output_replaces_a_directory(tmp_path):
    final = tmp_path / "export"
    final.mkdir()
    (final / "old.pb").write_text("old")
    with atomic.atomic_output(final) as staging:
        os.makedirs(staging)
        with open(os.path.join(staging, "saved_model.pb"), "w") as f:
            f.write("new")
    assert os.listdir(final) == ["saved_model.pb"]
    assert os.listdir(tmp_path) == ["export"]


def test_stale_staging_files_of_dead_processes_are_removed(tmp_path):
    host = os.uname().nodename
    dead = tmp_path / f".tmp-999999999-{host}-ckpt-1.keras"
    live = tmp_path / f".tmp-{os.getppid()}-{host}-ckpt-2.keras"
    other = tmp_path / "ckpt-1.keras"
    for path in (dead, live, other):
        path.write_text("x")
    assert atomic.remove_stale_staging(tmp_path) == [str(dead)]
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name])


# --------------------------------------------------------------------------- save / load


def test_save_and_load_each_format_predict_the_same(tmp_path):
    model = tiny_model()
    x = np.linspace(-1, 1, 12, dtype="float32").reshape(4, 3)
    expected = model.predict(x, verbose=0)

    path = tfdist.save(model, tmp_path / "m.keras")
    loaded = tfdist.load(path)
    equivalence.assert_allclose(loaded.predict(x, verbose=0), expected, rtol=0, atol=1e-6)
    assert int(loaded.optimizer.iterations.numpy()) == 1  # optimizer state came along

    tfdist.save(model, tmp_path / "w.weights.h5")
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    fresh.compile(optimizer="adam", loss="mse")
    loaded = tfdist.load(tmp_path / "w.weights.h5", model=fresh)
    equivalence.assert_allclose(loaded.predict(x, verbose=0), expected, rtol=0, atol=1e-6)
    assert int(loaded.optimizer.iterations.numpy()) == 1

    tfdist.save(model, tmp_path / "export" / "1")
    served = tfdist.load(tmp_path / "export" / "1")
    equivalence.assert_allclose(served.serve(x).numpy(), expected, rtol=0, atol=1e-6)
    assert not glob.glob(str(tmp_path / "**" / ".tmp-*"), recursive=True)


def test_save_and_load_reject_bad_input(tmp_path):
    model = tiny_model()
    with pytest.raises(TypeError, match=r"model must be a keras.Model.*Received: model='m'"):
        tfdist.save("m", tmp_path / "m.keras")
    with pytest.raises(ValueError, match=r"cannot tell the format.*m\.pb"):
        tfdist.save(model, tmp_path / "m.pb")
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="not built"):
        tfdist.save(unbuilt, tmp_path / "u.keras")
    (tmp_path / "keep.keras").write_text("precious")
    with pytest.raises(FileExistsError, match="overwrite=False"):
        tfdist.save(model, tmp_path / "keep.keras", overwrite=False)
    assert (tmp_path / "keep.keras").read_text() == "precious"
    with pytest.raises(FileNotFoundError, match=r"nothing at path.*missing\.keras"):
        tfdist.load(tmp_path / "missing.keras")
    with pytest.raises(ValueError, match=r"not a \.keras archive"):
        tfdist.load(tmp_path / "keep.keras")
    tfdist.save(model, tmp_path / "w.weights.h5")
    with pytest.raises(ValueError, match=r"holds no architecture.*model=model"):
        tfdist.load(tmp_path / "w.weights.h5")
    with pytest.raises(TypeError, match="in_scope must be a bool"):
        tfdist.load(tmp_path / "w.weights.h5", in_scope="yes")


def test_a_worker_saves_nothing_at_the_path_and_leaves_no_temp_files(tmp_path, monkeypatch):
    model = tiny_model()
    monkeypatch.setenv("TF_CONFIG", worker_tf_config(ADDRESSES, 1))
    before = set(os.listdir(tempfile.gettempdir()))
    tfdist.save(model, tmp_path / "m.keras")
    assert os.listdir(tmp_path) == []
    leftovers = [n for n in set(os.listdir(tempfile.gettempdir())) - before if "tfdist-worker" in n]
    assert leftovers == []


def test_safe_mode_refuses_a_lambda_archive_and_runs_none_of_its_code(tmp_path):
    marker = tmp_path / "lambda-ran"

    # The marker path is a constant of the lambda's own code (Keras cannot restore
    # default arguments), so calling the deserialized lambda creates the file.
    touch = eval(f"lambda x: (open({str(marker)!r}, 'w').close(), x)[1]")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Lambda(touch)])
    path = tmp_path / "lambda.keras"
    model.save(path)
    marker.unlink()  # building the model ran the lambda once; start clean

    with pytest.raises(ValueError, match=r"refused .* in safe mode"):
        tfdist.load(path)
    with pytest.raises(ValueError, match="in safe mode"):
        tfdist.load(path, in_scope=True)
    assert not marker.exists()

    # the check can see the code run: without safe mode, loading does run it
    tfdist.load(path, safe_mode=False)
    assert marker.exists()


def test_legacy_h5_model_files_are_refused_in_safe_mode(tmp_path):
    path = tmp_path / "old.h5"
    path.write_bytes(b"\x89HDF\r\n\x1a\n")
    with pytest.raises(ValueError, match="legacy HDF5"):
        tfdist.load(path)


# --------------------------------------------------------------------------- scopes, replicas

SAVE_IN_SCOPE = """
import json, numpy as np, tfdist, keras
strategy = tfdist.strategy()
keras.utils.set_random_seed(2)
with tfdist.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
rng = np.random.default_rng(0)
model.fit(rng.normal(size=(32, 3)).astype("float32"), rng.normal(size=(32, 2)).astype("float32"),
          batch_size=8, epochs=1, verbose=0)
x = np.linspace(-1, 1, 15, dtype="float32").reshape(5, 3)
for name in ("m.keras", "w.weights.h5", "export"):
    tfdist.save(model, "{d}/" + name)
print(json.dumps({{"replicas": strategy.num_replicas_in_sync,
                  "variable": type(model.weights[0].value).__name__,
                  "pred": model.predict(x, verbose=0).tolist()}}))
"""

LOAD_IN_OTHER_SCOPE = """
import json, numpy as np, tfdist, keras
strategy = tfdist.strategy()
x = np.linspace(-1, 1, 15, dtype="float32").reshape(5, 3)
out = {{"replicas": strategy.num_replicas_in_sync}}
inside = tfdist.load("{d}/m.keras", in_scope=True)
out["in_scope_keras"] = inside.predict(x, verbose=0).tolist()
out["in_scope_variable"] = type(inside.weights[0].value).__name__
out["in_scope_copies"] = len(inside.weights[0].value.values)
out["outside_keras"] = tfdist.load("{d}/m.keras").predict(x, verbose=0).tolist()
with strategy.scope():
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    fresh.compile(optimizer="adam", loss="mse")
weights = tfdist.load("{d}/w.weights.h5", model=fresh)
out["in_scope_weights"] = weights.predict(x, verbose=0).tolist()
# keep the loaded objects referenced: their functions do not own the variables
served_in_scope = tfdist.load("{d}/export", strategy=strategy)
out["in_scope_saved_model"] = served_in_scope.serve(x).numpy().tolist()
served_outside = tfdist.load("{d}/export")
out["outside_saved_model"] = served_outside.serve(x).numpy().tolist()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.devices
def test_saved_in_a_two_replica_scope_loads_outside_and_in_a_three_replica_scope(tmp_path):
    saved = last_json_line(
        run_python(SAVE_IN_SCOPE.format(d=tmp_path), TFDIST_CPU_DEVICES="2").stdout
    )
    assert saved["replicas"] == 2 and saved["variable"] == "MirroredVariable"
    loaded = last_json_line(
        run_python(LOAD_IN_OTHER_SCOPE.format(d=tmp_path), TFDIST_CPU_DEVICES="3").stdout
    )
    assert loaded["replicas"] == 3
    assert loaded["in_scope_variable"] == "MirroredVariable" and loaded["in_scope_copies"] == 3
    for key in (
        "in_scope_keras",
        "outside_keras",
        "in_scope_weights",
        "in_scope_saved_model",
        "outside_saved_model",
    ):
        equivalence.assert_allclose(loaded[key], saved["pred"], rtol=0, atol=1e-5, err_msg=key)
    # and in this process: one device, no scope
    here = tfdist.load(tmp_path / "m.keras")
    x = np.linspace(-1, 1, 15, dtype="float32").reshape(5, 3)
    equivalence.assert_allclose(here.predict(x, verbose=0), saved["pred"], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- every worker


def test_save_and_load_check_timeout_and_sync_is_a_no_op_on_one_worker(tmp_path):
    model = tiny_model()
    saving.sync_workers("nothing to wait for", timeout=1)
    with pytest.raises(ValueError, match=r"tfdist\.save: timeout must be a positive number"):
        tfdist.save(model, tmp_path / "m.keras", timeout=0)
    assert not os.path.exists(tmp_path / "m.keras")
    tfdist.save(model, tmp_path / "m.keras", timeout=5)
    with pytest.raises(ValueError, match=r"tfdist\.load: timeout must be a positive number"):
        tfdist.load(tmp_path / "m.keras", timeout=-1)
    assert tfdist.load(tmp_path / "m.keras", in_scope=True, timeout=5).built


def test_a_save_some_workers_skip_fails_naming_the_rule(tmp_path, monkeypatch):
    def barrier(name, timeout=None):
        raise RuntimeError(f"tfdist.barrier({name!r}): not every worker arrived within 5 s")

    monkeypatch.setattr(tfdist.distribute, "barrier", barrier)
    monkeypatch.setattr(saving, "_has_other_workers", lambda model: True)
    with pytest.raises(RuntimeError, match=r"tfdist\.save\('m\.keras'\): every worker must call"):
        tfdist.save(tiny_model(), tmp_path / "m.keras")
    assert os.listdir(tmp_path) == []  # it failed before writing anything


class _Array:
    """Stands for a jax.Array's placement attributes (a TF tensor has neither)."""

    def __init__(self, addressable: bool, replicated: bool):
        self.is_fully_addressable, self.is_fully_replicated = addressable, replicated


class _Variable:
    def __init__(self, value):
        self.value = value


class _Model:
    def __init__(self, *values, optimizer_values=()):
        self.variables = [_Variable(v) for v in values]
        self.optimizer = type("Optimizer", (), {})()
        self.optimizer.variables = [_Variable(v) for v in optimizer_values]


def test_only_variables_sharded_across_processes_need_every_process():
    local, replicated = _Array(True, False), _Array(False, True)
    sharded = _Array(False, False)
    assert not saving.needs_every_process(_Model(np.zeros(3), local, replicated))
    assert saving.needs_every_process(_Model(local, sharded))
    assert saving.needs_every_process(_Model(local, optimizer_values=[sharded]))


def test_a_lone_save_lands_whole_or_leaves_the_previous_file(tmp_path):
    final = tmp_path / "w.bin"

    def write(staging):
        assert os.path.basename(staging).startswith(".tmp-")  # next to the final name
        assert os.path.dirname(staging) == str(tmp_path)
        with open(staging, "w") as f:
            f.write("whole")
        return "written"

    assert saving.write_alone(_Model(np.zeros(2)), final, write, what="test") == "written"
    assert final.read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin"]  # no staging left

    def fail(staging):
        with open(staging, "w") as f:
            f.write("torn")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        saving.write_alone(_Model(np.zeros(2)), final, fail, what="test")
    assert final.read_text() == "whole"  # the previous file stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin"]
