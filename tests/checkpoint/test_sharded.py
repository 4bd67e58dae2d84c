"""Sharded, asynchronous checkpoints (``checkpoint(..., sharded=True)``, JAX, Orbax).

tests/scripts/sharded_job.py checks, in one process on 4 CPU devices, a restore onto
other meshes, a damaged newest checkpoint and a model that does not fit; the kill -9,
SIGTERM and two-process cases are in tests/checkpoint/test_jax_checkpoint.py (ckpt_job.py
--sharded). Here also: what is refused, and the names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
import threading
import time

import pytest

from tfdist.checkpoint import sharded

from conftest import SCRIPTS, last_json_line, run_python

STEP_10 = 10  # the stopped run's newest checkpoint: epoch 1, batch 2 (ckpt-2-2.orbax)


@pytest.fixture(scope="module")
def job():
    proc = run_python(
        f"import runpy, sys; sys.argv = ['sharded_job.py']; "
        f"runpy.run_path({str(SCRIPTS / 'sharded_job.py')!r}, run_name='__main__')",
        timeout=400,
        KERAS_BACKEND="jax",
        TFDIST_CPU_DEVICES="4",
    )
    result = last_json_line(proc.stdout)
    output = proc.stdout + proc.stderr
    result["said"] = {
        "skipping": output.count("skipping checkpoint"),
        "event_loop_closed": output.count("Event loop is closed"),
    }
    return result


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
def test_a_checkpoint_saved_on_2x2_resumes_on_other_meshes_like_an_uninterrupted_run(job):
    assert job["stopped"] == ["ckpt-1-5.orbax", "ckpt-1.orbax", "ckpt-2-2.orbax"]
    assert job["reference_kept"] == ["ckpt-2-7.orbax", "ckpt-2.orbax"]  # max_to_keep=2
    for shape, resumed in job["resumed"].items():
        assert resumed["step"] == STEP_10, shape
        # the restored kernel lies on the new mesh, sharded over its model axis
        assert resumed["mesh"] == [int(n) for n in shape.split("x")], shape
        assert resumed["spec"] == "P(None, 'model')" and resumed["devices"] == 4, shape
        # the model is built again in this process: its variable paths differ from the
        # saved ones (keras#23251's case), and the weights still end like the reference
        assert resumed["diff"] <= 1e-5, shape


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
def test_the_writer_saves_uncompressed_with_its_threads_below_training(job):
    # What makes a save cheap beside training (docs/checkpoints.md, "Cost"): the arrays
    # are stored without compression, and tensorstore's writer threads run at nice 10.
    assert job["writer"]["compressors"] == ["None"]
    assert job["writer"]["nice"] and min(job["writer"]["nice"]) >= sharded.WRITER_NICE


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
def test_a_damaged_newest_falls_back_and_another_model_is_refused(job):
    damaged = job["damaged"]
    assert damaged["step"] == 8 and damaged["diff"] <= 1e-5  # from ckpt-1 (step 8)
    assert "ckpt-2-2.orbax.corrupt" in damaged["names"]
    # Said once (the warning), without Orbax's asyncio tracebacks after it.
    assert job["said"] == {"skipping": 1, "event_loop_closed": 0}
    other = job["other"]
    assert other is not None, "a model of another width was restored"
    assert "does not fit the model build_fn returns" in other["error"]
    assert re.search(r"dense_one/kernel \[\[6, 8\].*saved .*\[\[6, 16\]", other["error"])
    assert other["names"] == job["stopped"]  # nothing moved or deleted


def _restore_like_orbax() -> list[str]:
    """What Orbax does with a damaged checkpoint: a restore in a loop of its own, closed as
    soon as one read fails, while another read (a tensorstore future, completed by another
    thread) is still under way. Returns what that completion met."""
    loop = asyncio.new_event_loop()
    slow = loop.create_future()
    met = []

    def complete_later():
        time.sleep(0.5)
        try:
            loop.call_soon_threadsafe(slow.set_result, None)
        except RuntimeError as err:
            met.append(str(err))

    async def fails():
        raise ValueError("the first array's data file is cut in half")

    async def reads():
        await slow

    async def restore():  # each array's read a task, as Orbax's gather makes them
        await asyncio.gather(fails(), reads())

    thread = threading.Thread(target=complete_later)
    thread.start()
    try:
        with contextlib.suppress(ValueError):
            loop.run_until_complete(restore())
    finally:
        loop.close()
    thread.join()
    return met


def test_a_failed_restore_leaves_no_read_to_complete_into_a_closed_loop():
    assert _restore_like_orbax() == ["Event loop is closed"]  # what tensorstore printed
    with sharded.reads_finish_before_their_loop_closes():
        assert _restore_like_orbax() == []  # the loop waited for the read
    assert not isinstance(asyncio.get_event_loop_policy(), sharded._FinishingPolicy)


def test_a_checkpoint_that_does_not_fit_names_its_reader_and_the_differences():
    saved, mine = [["d/kernel", [6, 16], "float32"]], [["d/kernel", [6, 8], "float32"]]
    said = sharded._does_not_fit("ckpt/ckpt-1.orbax", saved, mine, "tfdist.loops.Checkpointer")
    assert said.startswith("tfdist.loops.Checkpointer: sharded checkpoint 'ckpt/ckpt-1.orbax'")
    assert "does not fit the loop's model and optimizer" in said
    assert "#0 d/kernel [[6, 8], 'float32'] vs saved d/kernel [[6, 16], 'float32']" in said


def test_sharded_names_are_apart_from_archives_and_unfinished_writes(tmp_path):
    assert sharded.sharded_name(2, 50) == "ckpt-3-50.orbax"
    assert sharded.sharded_name(1) == "ckpt-1.orbax"
    for name in ["ckpt-3.orbax.orbax-checkpoint-tmp", "ckpt-3.keras", "ckpt-0-1.orbax"]:
        assert sharded.parse_sharded_name(name) is None, name
    for name in ["ckpt-1.orbax", "ckpt-2-3.orbax", "ckpt-2.orbax.orbax-checkpoint-tmp"]:
        (tmp_path / name).mkdir()
    (tmp_path / "ckpt-1.keras").write_bytes(b"")
    assert [p.rsplit("/", 1)[1] for _, p in sharded.sharded_entries(str(tmp_path))] == [
        "ckpt-1.orbax",
        "ckpt-2-3.orbax",
    ]
    assert [p.rsplit("/", 1)[1] for p in sharded.stale_writes(str(tmp_path))] == [
        "ckpt-2.orbax.orbax-checkpoint-tmp"
    ]


def test_sharded_is_refused_on_tensorflow_with_urls_and_without_orbax(monkeypatch, tmp_path):
    import tfdist
    from tfdist.backends import tensorflow

    with pytest.raises(ValueError, match=r"sharded=True needs the JAX backend.*'tensorflow'"):
        tfdist.callbacks.checkpoint(tmp_path, sharded=True)
    with pytest.raises(ValueError, match=r"sharded=True needs the JAX backend"):
        tfdist.callbacks.standard(tmp_path, sharded=True)  # passed on to checkpoint
    with pytest.raises(TypeError, match="sharded"):
        tfdist.callbacks.checkpoint(tmp_path, sharded="yes")
    with pytest.raises(ValueError, match=r"local \(or mounted\).*s3:// or gs://.*hdfs://b/run"):
        sharded.check_sharded_target("hdfs://b/run", "here")
    monkeypatch.setattr(tensorflow, "saves_sharded", lambda: True)  # past the backend check
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    with pytest.raises(ImportError, match=r"pip install 'tfdist\[jax\]'"):
        sharded.check_sharded_target(str(tmp_path), "here")


def test_tensorflow_restores_leave_sharded_checkpoints_alone(tmp_path, caplog):
    import keras

    import tfdist

    (tmp_path / "ckpt-3.orbax").mkdir()

    def build():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        return model

    with caplog.at_level(logging.WARNING):
        model, initial_epoch = tfdist.make_or_restore(build, tmp_path)
    assert initial_epoch == 0 and tfdist.resume_state(model) is None
    assert "1 sharded checkpoint(s)" in caplog.text and "left alone" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-3.orbax"]


@pytest.mark.jax
def test_orbax_gives_s3_no_bucket_kvstore_and_remote_orbax_gives_it_tensorstores_s3_driver():
    # Upstream (Orbax 0.12): an s3:// path is normalized into s3:/... and not given a
    # bucket kvstore; when this fails, Orbax handles s3:// itself and remote_orbax's
    # _install_s3_kvstore can retire.
    code = (
        "import json, os\n"
        "from tfdist.core import upstream\n"
        "from tfdist.checkpoint import remote_orbax\n"
        "ts = upstream.orbax_tensorstore_utils()\n"
        "before = [ts._normalize_path('s3://b/run/k'), ts._use_gcs_driver('s3://b/run')]\n"
        "os.environ['AWS_ENDPOINT_URL'] = 'http://127.0.0.1:9'\n"
        "remote_orbax.prepare('s3://b/run')\n"
        "after = [ts._normalize_path('s3://b/run/k'), ts._use_gcs_driver('s3://b/run'),\n"
        "         upstream.orbax_gcs_utils().get_kvstore_for_gcs('s3://b/run/k'),\n"
        "         ts._use_gcs_driver('/local/run'), ts._normalize_path('/local//run')]\n"
        "print(json.dumps({'before': before, 'after': after}))\n"
    )
    result = last_json_line(run_python(code, timeout=120, KERAS_BACKEND="jax").stdout)
    assert result["before"] == ["s3:/b/run/k", False]
    spec = {"driver": "s3", "bucket": "b", "path": "run/k", "endpoint": "http://127.0.0.1:9"}
    assert result["after"][:2] == ["s3://b/run/k", True]
    assert {k: result["after"][2][k] for k in spec} == spec
    assert result["after"][3:] == [False, "/local/run"]  # local paths: Orbax's own
