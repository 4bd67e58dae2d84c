"""Checkpoints in a bucket, through a real S3 API: moto's server on 127.0.0.1.

The preemptible-VM job: ``s3://`` checkpoint directories and save paths, the endpoint and
credentials given to the job in its environment (``AWS_ENDPOINT_URL``, read by botocore
whenever s3fs makes a client, so a user's script needs no change), jobs killed with
SIGKILL and started again (tests/scripts/ckpt_job.py, forked warm: tests/warm_start.py).
Also: sharded Orbax checkpoints (JAX) in the bucket, committed by Orbax's
``commit_success.txt``, and both backends' jobs as 2 workers under the default
``tfdist launch`` (a private network namespace reaching the server at its gateway).

What makes an upload that was cut invisible, on S3: tfdist never writes a checkpoint's
final name but by a server-side copy from a staging object that was uploaded whole, and
S3 creates an object only once its PUT (or multipart upload) completes; there is no
commit marker, the object's existence under a checkpoint's name is the commit. Whatever
does stand under such a name is then read back whole before it is restored (zip CRCs,
config, every weight, resume metadata), so a truncated or garbage object written there by
anything else is set aside as ``*.corrupt`` and the previous checkpoint restored.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import urllib.parse

import pytest

from tfdist.checkpoint import names
from tfdist.core import atomic, storage

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

# 64 examples, 4 per batch: 16 steps an epoch, 3 epochs; a checkpoint every 5 steps and at
# each epoch end, the newest 3 kept.
JOB = ("--save-freq", "5", "--epochs", "3")


def run_job(bucket, directory, *extra, backend="tensorflow", timeout=300, **env):
    """tests/scripts/ckpt_job.py on ``s3://bucket/directory``, forked warm."""
    argv = [str(SCRIPTS / "ckpt_job.py"), "--dir", bucket.url(directory), *JOB, *extra]
    base = child_env(KERAS_BACKEND=backend, **env)
    return warm_start.run(
        argv, env={**base, **bucket.env}, base_env=base, cwd=REPO, timeout=timeout
    )


def finished(proc) -> dict:
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return last_json_line(proc.stdout)


def killed(proc) -> None:
    assert proc.returncode == -signal.SIGKILL, (proc.stdout[-2000:], proc.stderr[-4000:])


@pytest.fixture(scope="module")
def reference(s3_server):
    """The job on TensorFlow, never interrupted, its checkpoints in a bucket of its own."""
    bucket = s3_server.create_bucket("reference")
    result = finished(run_job(bucket, "run"))
    assert result["restored"] is None and result["iterations"] == 48
    return result


def _cut_put(bucket, key: str, data: bytes) -> None:
    """A PUT of ``data`` whose connection closes after half of it (a writer killed
    mid-upload); sent raw, as moto's server does not check signatures."""
    endpoint = urllib.parse.urlsplit(bucket.env["AWS_ENDPOINT_URL"])
    with socket.create_connection((endpoint.hostname, endpoint.port)) as sock:
        head = f"PUT /{bucket.name}/{key} HTTP/1.1\r\nHost: {endpoint.netloc}\r\n"
        sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode())
        sock.sendall(data[: len(data) // 2])


def test_the_store_shows_only_whole_objects_and_tfdist_lists_only_checkpoints(
    s3_bucket, monkeypatch, tmp_path
):
    """The storage layer on S3: an upload lands under its final name only through the
    copy; a PUT cut mid-body and a multipart upload never completed leave no object; a
    dead writer's staging object is removed; the chief's write probe leaves nothing."""
    import s3fs

    for key, value in s3_bucket.env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance made for another endpoint
    try:
        run = s3_bucket.url("run")
        local = tmp_path / "ckpt-1.keras"
        local.write_bytes(os.urandom(4096))
        staging = atomic.staging_path(storage.join(run, "ckpt-1.keras"), atomic.WriteRole())
        storage.upload(str(local), staging, storage.join(run, "ckpt-1.keras"))
        assert s3_bucket.names("run") == ["ckpt-1.keras"]

        _cut_put(s3_bucket, "run/ckpt-1-5.keras", os.urandom(100_000))
        upload = s3_bucket.fs.call_s3(
            "create_multipart_upload", Bucket=s3_bucket.name, Key="run/ckpt-1-9.keras"
        )
        s3_bucket.fs.call_s3(
            "upload_part", Bucket=s3_bucket.name, Key="run/ckpt-1-9.keras", PartNumber=1,
            UploadId=upload["UploadId"], Body=os.urandom(5 << 20),
        )  # fmt: skip
        s3_bucket.fs.pipe(f"{s3_bucket.name}/run/.tmp-999999-elsewhere-ckpt-2.keras", b"whole")
        assert s3_bucket.names("run") == [".tmp-999999-elsewhere-ckpt-2.keras", "ckpt-1.keras"]
        assert [p for _, p in names.list_checkpoints(run)] == [f"{run}/ckpt-1.keras"]
        assert atomic.remove_stale_staging(run) == [f"{run}/.tmp-999999-elsewhere-ckpt-2.keras"]
        assert names.check_save_target(run, "test") == run  # the probe writes and removes
        assert s3_bucket.names("run") == ["ckpt-1.keras"]
        with storage.local_copy(f"{run}/ckpt-1.keras") as copy:
            assert open(copy, "rb").read() == local.read_bytes()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_save_and_load_round_trip_through_s3(s3_bucket):
    """``tfdist.save(model, "s3://...")`` then ``tfdist.load``: the same weights, exactly;
    only the final object is left in the bucket."""
    proc = run_python(
        f"""
        import json, keras, numpy as np, tfdist
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        model.fit(np.ones((8, 4)), np.ones((8, 1)), epochs=1, verbose=0)
        tfdist.save(model, "{s3_bucket.url("m.keras")}")
        loaded = tfdist.load("{s3_bucket.url("m.keras")}")
        diff = max(float(np.max(np.abs(a - b)))
                   for a, b in zip(model.get_weights(), loaded.get_weights()))
        print(json.dumps({{"diff": diff, "n": len(loaded.get_weights())}}))
        """,
        **s3_bucket.env,
    )
    result = last_json_line(proc.stdout)
    assert result == {"diff": 0.0, "n": 4}
    assert s3_bucket.names("") == ["m.keras"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("jax", marks=pytest.mark.jax)])
def test_kill_9_mid_epoch_resumes_from_s3_like_an_uninterrupted_run(s3_bucket, reference, backend):
    """SIGKILL after step 13 (mid-epoch; the last save after step 10), then a restart
    from ``s3://``: it resumes at step 10 and ends within 1e-5 of the uninterrupted run."""
    if backend == "tensorflow":
        expected = reference
    else:
        expected = finished(run_job(s3_bucket, "reference", backend=backend))
    killed(run_job(s3_bucket, "run", "--sigkill-at-step", "13", backend=backend))
    assert s3_bucket.names("run") == ["ckpt-1-10.keras", "ckpt-1-5.keras"]
    result = finished(run_job(s3_bucket, "run", backend=backend))
    assert result["restored"] == {"path": "ckpt-1-10.keras", "epoch": 0, "batch": 10, "step": 10}
    assert result["iterations"] == 48
    equivalence.assert_close(expected["weights"], result["weights"], 1e-5, backend)
    assert not [n for n in s3_bucket.names("run") if n.startswith(".tmp-")]


@pytest.mark.slow
def test_an_upload_cut_by_a_kill_is_never_read_as_a_checkpoint(s3_bucket, reference):
    """The job is killed in its 3rd checkpoint upload (after step 15, half the staging
    object's PUT sent): the bucket holds no object of it. Then what other cuts leave is
    put beside it: a dead writer's whole staging object, a multipart upload under a
    checkpoint's name never completed (neither is a checkpoint: the first has no
    checkpoint's name, the second is no object), and half an archive written directly
    under a checkpoint's name (read back whole first, so set aside as ``*.corrupt``).
    The restart resumes from step 10 and ends within 1e-5 of the uninterrupted run."""
    proc = run_job(s3_bucket, "run", "--sigkill-in-upload", "3")
    killed(proc)
    assert last_json_line(proc.stdout) == {"dying_in_upload": s3_bucket.url("run/ckpt-1-15.keras")}
    assert s3_bucket.names("run") == ["ckpt-1-10.keras", "ckpt-1-5.keras"]

    fs, run = s3_bucket.fs, f"{s3_bucket.name}/run"
    whole = fs.cat(f"{run}/ckpt-1-10.keras")
    fs.pipe(f"{run}/.tmp-999999-elsewhere-ckpt-1-15.keras", whole)  # killed before the copy
    upload = fs.call_s3("create_multipart_upload", Bucket=s3_bucket.name, Key="run/ckpt-2.keras")
    fs.call_s3(
        "upload_part", Bucket=s3_bucket.name, Key="run/ckpt-2.keras", PartNumber=1,
        UploadId=upload["UploadId"], Body=whole,
    )  # fmt: skip
    fs.pipe(f"{run}/ckpt-1-12.keras", whole[: len(whole) // 2])  # a non-atomic writer's half

    proc = run_job(s3_bucket, "run")
    result = finished(proc)
    assert result["restored"] == {"path": "ckpt-1-10.keras", "epoch": 0, "batch": 10, "step": 10}
    assert "skipping checkpoint" in proc.stderr and "ckpt-1-12.keras" in proc.stderr
    equivalence.assert_close(reference["weights"], result["weights"], 1e-5, "after the cut")
    left = s3_bucket.names("run")
    assert "ckpt-1-12.keras.corrupt" in left and "ckpt-1-12.keras" not in left
    assert not [n for n in left if n.startswith(".tmp-")], left


@pytest.mark.slow
def test_a_damaged_newest_object_falls_back_to_the_previous_one(s3_bucket, reference):
    """The newest checkpoint object overwritten with garbage bytes after a kill: the
    restart restores the one before, keeps the garbage as ``*.corrupt``, and ends within
    1e-5 of the uninterrupted run."""
    killed(run_job(s3_bucket, "run", "--sigkill-at-step", "13"))
    newest = f"{s3_bucket.name}/run/ckpt-1-10.keras"
    s3_bucket.fs.pipe(newest, os.urandom(len(s3_bucket.fs.cat(newest))))
    proc = run_job(s3_bucket, "run")
    result = finished(proc)
    assert result["restored"] == {"path": "ckpt-1-5.keras", "epoch": 0, "batch": 5, "step": 5}
    assert "skipping checkpoint" in proc.stderr and "ckpt-1-10.keras" in proc.stderr
    equivalence.assert_close(reference["weights"], result["weights"], 1e-5, "after damage")
    assert "ckpt-1-10.keras.corrupt" in s3_bucket.names("run")


# ------------------------------------------------------------------ under tfdist launch


def namespace_endpoint(endpoint: str) -> str:
    """``endpoint`` (on this host's 127.0.0.1) as workers in ``tfdist launch``'s private
    network reach it: at the namespace's default gateway, which the user-mode stack maps
    to this host's loopback. pasta (preferred) copies this host's default gateway into
    the namespace (``--config-net``); slirp4netns's gateway is 10.0.2.2."""
    if shutil.which("pasta"):
        with open("/proc/net/route") as routes:
            rows = [line.split() for line in routes.readlines()[1:]]
        gateway = next(socket.inet_ntoa(struct.pack("<L", int(r[2], 16))) for r in rows
                       if r[1] == "00000000")  # fmt: skip
    else:
        gateway = "10.0.2.2"
    return endpoint.replace("127.0.0.1", gateway)


def worker_results(proc, worker: str) -> list[dict]:
    """The JSON results ``worker`` printed under tfdist launch, one per attempt."""
    prefix = f"[{worker}] {{"
    return [json.loads(line[len(prefix) - 1 :]) for line in proc.stdout.splitlines()
            if line.startswith(prefix) and '"weights"' in line]  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_private_workers_checkpoint_to_s3_through_the_stack_and_resume_after_kill_9(
    s3_bucket, tmp_path
):
    """The default ``tfdist launch -n 2`` (a private network namespace, egress through
    pasta or slirp4netns), 2 TensorFlow workers (global batch 4, as the reference's)
    checkpointing archives to the bucket at the endpoint rewritten to the namespace's
    gateway. Both are killed by SIGKILL after step 13; the launcher's restart resumes
    from step 10 in the bucket and ends within 1e-5 of an uninterrupted run on 2 logical
    devices in one process."""
    two = ("--per-replica-batch", "2")
    expected = finished(run_job(s3_bucket, "reference", *two, TFDIST_CPU_DEVICES="2"))
    assert expected["replicas"] == 2
    env = {
        **s3_bucket.env,
        "AWS_ENDPOINT_URL": namespace_endpoint(s3_bucket.env["AWS_ENDPOINT_URL"]),
    }
    proc = launch_cli(
        "-n", "2", "--max-restarts", "1", str(SCRIPTS / "ckpt_job.py"), "--dir",
        s3_bucket.url("run"), *JOB, *two, "--sigkill-at-step", "13",
        timeout=420, TMPDIR=str(tmp_path), **env,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert re.search(r"outbound connections go out through (pasta|slirp4netns)", output), output[
        -3000:
    ]
    for worker in ("w0", "w1"):
        (resumed,) = worker_results(proc, worker)  # the killed attempt printed none
        assert resumed["restored"] == {
            "path": "ckpt-1-10.keras",
            "epoch": 0,
            "batch": 10,
            "step": 10,
        }
        assert resumed["iterations"] == 48 and resumed["replicas"] == 2
        equivalence.assert_close(expected["weights"], resumed["weights"], 1e-5, worker)
    assert s3_bucket.names("run") == ["ckpt-3-13.keras", "ckpt-3-8.keras", "ckpt-3.keras"]


# ------------------------------------------------------------------ sharded (Orbax, JAX)


def sharded_names(bucket, directory: str) -> dict[str, bool]:
    """The ``.orbax`` directories under ``directory``: committed (``commit_success.txt``
    inside, Orbax's marker written last) or not."""
    return {
        name: "commit_success.txt" in bucket.names(f"{directory}/{name}")
        for name in bucket.names(directory)
        if ".orbax" in name
    }


def _copy_tree(bucket, source: str, target: str, skip=()) -> None:
    """Copies the objects under ``source`` to ``target`` (both under the bucket), but
    those named in ``skip``, and garbles the array data files when ``skip`` says "data"."""
    fs = bucket.fs
    for path in fs.find(f"{bucket.name}/{source}"):
        inner = path[len(f"{bucket.name}/{source}/") :]
        if inner.rsplit("/", 1)[-1] in skip:
            continue
        data = fs.cat(path)
        if "data" in skip and "/d/" in f"/{inner}":
            data = os.urandom(len(data))
        fs.pipe(f"{bucket.name}/{target}/{inner}", data)


SHARDED = ("--sharded", "--epochs", "2")
SHARDED_KEPT = dict.fromkeys(["ckpt-2-14.orbax", "ckpt-2-9.orbax", "ckpt-2.orbax"], True)


@pytest.fixture(scope="module")
def sharded_reference(s3_server):
    """The job on JAX on 1 device with sharded checkpoints, never interrupted, in a
    bucket of its own: 2 epochs of 16 steps, 3 committed checkpoints kept."""
    bucket = s3_server.create_bucket("sharded-reference")
    result = finished(run_job(bucket, "run", *SHARDED, backend="jax"))
    assert result["iterations"] == 32 and sharded_names(bucket, "run") == SHARDED_KEPT
    return result


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
def test_sharded_checkpoints_in_s3_resume_on_another_mesh_after_kill_9(
    s3_bucket, sharded_reference
):
    """``checkpoint("s3://...", sharded=True)``: Orbax writes each checkpoint in place and
    commits it with ``commit_success.txt``, written last. A job on 2 devices (global batch
    4) is killed by SIGKILL after step 13. Beside what it left, a write that never
    committed (every object of a checkpoint but the marker, under a newer name) and a
    committed newer checkpoint whose array data is garbage. The restart on 1 device
    (same global batch: Orbax reshards the 2-device arrays onto it) skips the first and
    removes it, sets the second aside as ``*.corrupt``, resumes from the newest good
    checkpoint and ends within 1e-5 of a run on 1 device never interrupted."""
    sharded, expected = SHARDED, sharded_reference
    two = ("--per-replica-batch", "2")
    killed(
        run_job(s3_bucket, "run", *sharded, *two, "--sigkill-at-step", "13", backend="jax",
                TFDIST_CPU_DEVICES="2")
    )  # fmt: skip
    left = sharded_names(s3_bucket, "run")
    # Step 10's checkpoint if its background write ended before the kill, else step 5's.
    newest = "ckpt-1-10.orbax" if left.get("ckpt-1-10.orbax") else "ckpt-1-5.orbax"
    assert left.get(newest), left
    _copy_tree(s3_bucket, f"run/{newest}", "run/ckpt-1-14.orbax", skip=("commit_success.txt",))
    _copy_tree(s3_bucket, f"run/{newest}", "run/ckpt-1-12.orbax", skip=("data",))

    proc = run_job(s3_bucket, "run", *sharded, backend="jax")
    result = finished(proc)
    assert result["restored"]["path"] == newest, result["restored"]
    assert "ckpt-1-12.orbax" in proc.stderr and "ckpt-1-14.orbax" in proc.stderr
    assert result["iterations"] == 32 and result["replicas"] == 1
    equivalence.assert_close(expected["weights"], result["weights"], 1e-5, "resharded")
    left = sharded_names(s3_bucket, "run")
    assert left == {"ckpt-1-12.orbax.corrupt": True, **SHARDED_KEPT}, left


PAGE = REPO / "docs" / "buckets.md"
RECIPE = "test_the_bucket_recipe_on_this_page_trains_saves_and_resumes"
# What the page's script needs that its prose defines, and what it reports at the end.
TRAIN_SETUP = """
import json, keras, numpy as np, tfdist
def build_and_compile():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model
rng = np.random.default_rng(0)
train = tfdist.data.pipeline(
    (rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 3, 64)),
    per_replica_batch=8, seed=0)
"""
TRAIN_REPORT = """
steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
print(json.dumps({"initial_epoch": initial_epoch, "steps": steps}))
"""


def _page_blocks(name: str) -> dict[str, str]:
    """The fenced blocks of docs/buckets.md marked ``run by`` test ``name``, by language."""
    pattern = (
        rf"<!-- run by tests/checkpoint/test_object_store.py::{name} -->\n"
        r"```(\w+)\n(.*?)\n```"
    )
    return {lang: code for lang, code in re.findall(pattern, PAGE.read_text(), re.S)}


@pytest.mark.slow
def test_the_bucket_recipe_on_this_page_trains_saves_and_resumes(s3_bucket, tmp_path):
    """docs/buckets.md's commands as written (its endpoint swapped for the test
    server's, its bucket for the test's), twice: the first run trains 3 epochs and saves
    the model; the second, a VM after a preemption, starts from the end."""
    blocks = _page_blocks(RECIPE)
    assert set(blocks) == {"bash", "python"}, blocks
    script = blocks["python"].replace("s3://bucket/", s3_bucket.url() + "/")
    (tmp_path / "train.py").write_text(TRAIN_SETUP + script + "\n" + TRAIN_REPORT)
    commands = blocks["bash"].replace("http://127.0.0.1:5000", s3_bucket.env["AWS_ENDPOINT_URL"])
    # The block's exports are all the job gets: nothing of AWS's inherited from here.
    env = {k: v for k, v in child_env().items() if not k.startswith("AWS_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    results = []
    for _ in range(2):
        proc = subprocess.run(
            ["bash", "-euc", commands], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert results == [{"initial_epoch": 0, "steps": 24}, {"initial_epoch": 3, "steps": 24}]
    left = s3_bucket.names("")
    assert "model.keras" in left and "ckpt-3.keras" in s3_bucket.names("run"), left


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.multiworker
def test_two_jax_processes_write_sharded_checkpoints_to_s3_and_resume_after_kill_9(
    s3_bucket, sharded_reference, tmp_path
):
    """The default ``tfdist launch -n 2`` with KERAS_BACKEND=jax (2 processes x 1 device,
    global batch 4), sharded checkpoints in the bucket at the namespace's gateway: each
    process writes its shards, the chief commits. Both are killed by SIGKILL after step
    13; the restart resumes from the newest committed checkpoint and ends within 1e-5 of
    the uninterrupted 1-device run."""
    env = {
        **s3_bucket.env,
        "AWS_ENDPOINT_URL": namespace_endpoint(s3_bucket.env["AWS_ENDPOINT_URL"]),
    }
    proc = launch_cli(
        "-n", "2", "--max-restarts", "1", str(SCRIPTS / "ckpt_job.py"), "--dir",
        s3_bucket.url("run"), *JOB, *SHARDED, "--per-replica-batch", "2",
        "--sigkill-at-step", "13", timeout=420, TMPDIR=str(tmp_path), KERAS_BACKEND="jax", **env,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    for worker in ("w0", "w1"):
        (resumed,) = worker_results(proc, worker)
        assert resumed["restored"]["path"] in ("ckpt-1-10.orbax", "ckpt-1-5.orbax"), resumed
        assert resumed["iterations"] == 32 and resumed["replicas"] == 2
        equivalence.assert_close(sharded_reference["weights"], resumed["weights"], 1e-5, worker)
    assert sharded_names(s3_bucket, "run") == SHARDED_KEPT
