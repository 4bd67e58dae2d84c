"""Checkpoint directories and save/load paths given as URLs (``tfdist.core.storage``, fsspec).

Two test filesystems that need no network: fsspec's in-process ``memory://`` and its
``local://`` (the local disk through fsspec's route: staging object, then a move), which
outlives a process, for kill-and-restart. Local paths keep their behaviour (the rest of
the suite: test_checkpoint.py, test_damage.py, test_saving.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import fsspec
import pytest

from tfdist.checkpoint import names
from tfdist.core import atomic, storage

from conftest import SCRIPTS, child_env, equivalence, last_json_line, launch_cli


@pytest.fixture
def memory():
    """fsspec's memory filesystem, emptied after the test (it is process-wide)."""
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/t"):
        fs.rm("/t", recursive=True)


def test_urls_and_local_paths_are_told_apart_and_joined():
    assert storage.is_url("gs://b/run") and storage.is_url("local:///tmp/x")
    assert not storage.is_url("ckpt/") and not storage.is_url("file:///tmp/x")
    assert storage.normalize("file:///tmp/x", "f") == "/tmp/x"
    assert storage.normalize("s3://b/run//", "f") == "s3://b/run"
    assert storage.join("s3://b/run", "ckpt-1.keras") == "s3://b/run/ckpt-1.keras"
    assert storage.basename("s3://b/run/ckpt-1.keras") == "ckpt-1.keras"
    assert storage.dirname("s3://b/run/ckpt-1.keras") == "s3://b/run"


def test_a_url_without_its_filesystem_package_says_what_to_install():
    with pytest.raises(ImportError, match=r"nosuchfs://.*Install the filesystem package"):
        storage.listdir("nosuchfs://bucket/run")


def test_upload_lands_only_through_the_move_and_leaves_no_staging(memory, tmp_path):
    local = tmp_path / "m.keras"
    local.write_bytes(b"x" * 100)
    storage.upload(str(local), "memory://t/.tmp-1-h-m.keras", "memory://t/m.keras")
    assert storage.listdir("memory://t") == ["m.keras"]
    with storage.local_copy("memory://t/m.keras") as copy, open(copy, "rb") as f:
        assert f.read() == b"x" * 100
    with pytest.raises(FileNotFoundError):
        storage.upload(str(tmp_path / "absent"), "memory://t/.tmp-1-h-n", "memory://t/n")
    assert storage.listdir("memory://t") == ["m.keras"]


def test_checkpoint_listing_staging_clean_up_and_checks_on_a_url(memory):
    memory.pipe("/t/ckpt/ckpt-2.keras", b"a")
    memory.pipe("/t/ckpt/ckpt-1-5.keras", b"b")
    memory.pipe("/t/ckpt/notes.txt", b"c")
    memory.pipe("/t/ckpt/.tmp-999999-elsewhere-ckpt-3.keras", b"half")  # a dead writer's
    memory.pipe("/t/file", b"not a directory")
    found = names.list_checkpoints("memory://t/ckpt/")
    assert [p for _, p in found] == [
        "memory://t/ckpt/ckpt-1-5.keras",
        "memory://t/ckpt/ckpt-2.keras",
    ]
    removed = atomic.remove_stale_staging("memory://t/ckpt")
    assert removed == ["memory://t/ckpt/.tmp-999999-elsewhere-ckpt-3.keras"]
    assert names.check_save_target("memory://t/ckpt", "f") == "memory://t/ckpt"
    assert sorted(storage.listdir("memory://t/ckpt")) == [
        "ckpt-1-5.keras",
        "ckpt-2.keras",
        "notes.txt",
    ]
    assert names.quarantine_path("memory://t/ckpt/ckpt-2.keras").endswith("ckpt-2.keras.corrupt")
    with pytest.raises(NotADirectoryError, match="Received: checkpoint_dir='memory://t/file'"):
        names.check_dir("memory://t/file", "f", writable=True)


def test_a_reader_of_local_files_refuses_a_url_instead_of_quarantining_good_files(memory):
    from tfdist.checkpoint.restore import newest_readable

    memory.pipe("/t/ckpt/ckpt-1.keras", b"a good checkpoint, unread")
    with pytest.raises(ValueError, match=r"local path.*Received: directory='memory://t/ckpt'"):
        newest_readable("memory://t/ckpt", atomic.WriteRole())
    assert storage.listdir("memory://t/ckpt") == ["ckpt-1.keras"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("jax", marks=pytest.mark.jax)])
def test_a_url_checkpoint_directory_resumes_falls_back_and_saves_end_to_end(backend):
    """memory://: stop mid-epoch -> resume exactly; damaged newest -> previous; save/load."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "storage_job.py")],
        env=child_env(KERAS_BACKEND=backend),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = last_json_line(proc.stdout)
    assert result["after_stop"] == ["ckpt-1-5.keras", "ckpt-1.keras", "ckpt-2-2.keras"]
    assert result["resumed_step"] == 10
    assert result["resume_diff"] < 1e-5, result["resume_diff"]
    assert result["fallback"] == "memory://bucket/run/ckpt-2-7.keras"
    assert "ckpt-2.keras.corrupt" in result["after_damage"]
    assert not any(name.startswith(".tmp-") for name in result["after_damage"])
    assert {"model.keras", "model.weights.h5"} <= set(result["models"])
    assert result["round_trip_diff"] == 0.0
    assert result["staging_left"] == []
    if backend == "tensorflow":
        assert result["served_diff"] < 1e-5, result["served_diff"]
    assert "does not read back" in proc.stderr


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_killed_job_restarts_from_a_url_on_two_workers(tmp_path):
    """local:// (fsspec's route on the local disk): os._exit mid-epoch on one process, then
    two workers (``tfdist launch``: only the chief uploads, both download and agree) resume
    from the URL within 1e-5 of an uninterrupted local run on one device."""
    job, url = str(SCRIPTS / "world_size_job.py"), f"local://{tmp_path}/url-ckpt"

    def run(directory, *extra):
        argv = [sys.executable, job, "--dir", directory, *extra]
        proc = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return None if extra else last_json_line(proc.stdout)

    reference = run(str(tmp_path / "reference"))
    run(url, "--die-after-step", "13")
    stale = tmp_path / "url-ckpt" / ".tmp-999999-elsewhere-ckpt-9.keras"
    stale.write_bytes(b"half an upload")
    proc = launch_cli("-n", "2", job, "--dir", url, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = [_json(line.split("] ", 1)[-1]) for line in proc.stdout.splitlines()]
    results = [r for r in results if r is not None]
    assert sorted(r["worker"] for r in results) == [0, 1], proc.stdout[-3000:]
    for resumed in results:
        assert resumed["resumed_step"] == 10 and resumed["replicas"] == 2
        equivalence.assert_close(
            reference["weights"], resumed["weights"], 1e-5, f"worker {resumed['worker']}"
        )
    left = sorted(p.name for p in (tmp_path / "url-ckpt").iterdir())
    # save_freq=5 over 8-step epochs, max_to_keep=5; the dead writer's staging is gone.
    expected = [
        "ckpt-2-2.keras",
        "ckpt-2-7.keras",
        "ckpt-2.keras",
        "ckpt-3-4.keras",
        "ckpt-3.keras",
    ]
    assert left == expected, json.dumps(left)


def _json(line: str):
    try:
        return json.loads(line) if line.strip().startswith("{") else None
    except ValueError:
        return None
