"""`tfdist train mnist`: argument handling, the restartable job on real MNIST, offline failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tfdist.cli import build_parser
from tfdist.core.config import ConfigError
from tfdist_examples import job, mnist

from conftest import child_env, run_python


def parse(*argv):
    return build_parser().parse_args(["train", "mnist", *argv])


def test_defaults_follow_the_recipe_and_output_names_it():
    config = mnist.config_from_args(parse("--recipe", "tutorial"))
    assert config.recipe == "tutorial" and config.epochs is None
    assert config.output == os.path.join("runs", "mnist-tutorial")
    assert config.ckpt_dir == os.path.join("runs", "mnist-tutorial", "ckpt")
    assert config.save_freq == 200


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--epochs", "0"], "--epochs must be a positive int. Received: --epochs=0"),
        (["--per-replica-batch", "-2"], "--per-replica-batch must be a positive int"),
        (["--devices", "0"], "--devices must be a positive int"),
        (["--save-freq", "0"], "--save-freq must be a positive number of steps or 'epoch'"),
        (["--save-freq", "often"], "Received: --save-freq='often'"),
    ],
)
def test_bad_arguments_are_named(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mnist.config_from_args(parse(*argv))


def test_workers_rerun_the_same_job_without_workers():
    config = mnist.config_from_args(
        parse(
            "--epochs", "3", "--per-replica-batch", "32", "--output", "out", "--save-freq", "epoch"
        )
    )
    again = mnist.config_from_args(build_parser().parse_args(mnist.worker_argv(config)))
    assert again == config


def test_bad_workers_is_an_error_before_anything_runs(capsys):
    from tfdist.cli import main

    assert main(["train", "mnist", "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err


def test_output_that_is_a_file_is_refused_at_once(tmp_path):
    afile = tmp_path / "results.txt"
    afile.write_text("not a folder")
    with pytest.raises(ValueError, match="--output must be a folder.*That path is a file"):
        mnist.config_from_args(parse("--output", str(afile)))
    with pytest.raises(ConfigError, match="--checkpoint-dir must be a folder"):
        mnist.config_from_args(parse("--checkpoint-dir", str(afile)))
    with pytest.raises(ConfigError, match="--output must be a local folder.*gs://b/out"):
        mnist.config_from_args(parse("--output", "gs://b/out"))
    assert mnist.config_from_args(parse("--checkpoint-dir", "gs://b/run")).ckpt_dir == "gs://b/run"


def test_help_explains_recipe_verbose_and_backend_with_defaults():
    text = build_parser()._subparsers._group_actions[0].choices["train"]
    text = text._subparsers._group_actions[0].choices["mnist"].format_help()
    for needle in ("(default: fast)", "(default: auto)", "--backend", "(default: 200)"):
        assert needle in " ".join(text.split()), needle


def test_backend_is_passed_to_the_workers():
    config = mnist.config_from_args(parse("--backend", "jax", "--output", "out"))
    assert config.backend == "jax"
    again = mnist.config_from_args(build_parser().parse_args(mnist.worker_argv(config)))
    assert again == config


def test_history_is_numbers_one_row_per_epoch(tmp_path):
    path = tmp_path / "history.csv"
    # Epoch 1 was logged, the run was killed before its checkpoint, and it ran again.
    path.write_text("epoch,accuracy,loss\n0,0.5,1.5\n1,0.7,0.9\n1,0.8,0.7\n")
    assert mnist._history_rows(str(path)) == [
        {"epoch": 0, "accuracy": 0.5, "loss": 1.5},
        {"epoch": 1, "accuracy": 0.8, "loss": 0.7},
    ]


def _folder_of_another_job(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "ckpt-1.keras").write_bytes(b"")
    identity = {
        "recipe": "fast", "replicas": 2, "per_replica_batch": 128, "global_batch": 256,
        "train_split": "train", "backend": "tensorflow",
    }  # fmt: skip
    record = {"identity": identity, "wall_time_s": 75.3, "runs": [{}], "partial_epochs": []}
    (ckpt / "job.json").write_text(json.dumps(record))
    return str(ckpt), identity


def test_checkpoints_of_another_job_are_refused_naming_both(tmp_path):
    ckpt, identity = _folder_of_another_job(tmp_path)
    other = dict(identity, replicas=1, global_batch=128)
    with pytest.raises(ConfigError) as info:
        job.open_record(ckpt, other)
    message = str(info.value)
    assert "global_batch=256 there, 128 now" in message and "replicas" not in message.split("(")[1]
    assert "To resume it on 1 replica(s), keep its global batch: --per-replica-batch 256" in message
    assert "--output" in message and "delete" in message


def test_the_same_global_batch_on_another_replica_count_resumes(tmp_path):
    ckpt, identity = _folder_of_another_job(tmp_path)  # 2 replicas x 128
    record = job.open_record(ckpt, dict(identity, replicas=4, per_replica_batch=64))
    assert record.data["wall_time_s"] == 75.3 and record.data["identity"]["replicas"] == 4


def test_a_rerun_adds_to_the_total_training_time(tmp_path):
    ckpt, identity = _folder_of_another_job(tmp_path)
    record = job.open_record(ckpt, identity)
    record.start_run(None, steps_per_epoch=10, start=time.perf_counter() - 18.1)
    saved = json.loads((tmp_path / "ckpt" / "job.json").read_text())
    assert saved["wall_time_s"] == pytest.approx(75.3 + 18.1, abs=1.0)
    assert len(saved["runs"]) == 2 and saved["runs"][-1]["wall_time_s"] >= 18.1
    # Without checkpoints there is nothing to resume: a new job, whatever the record says.
    os.remove(os.path.join(ckpt, "ckpt-1.keras"))
    assert job.open_record(ckpt, dict(identity, replicas=1)).data["wall_time_s"] == 0.0


def _job(tmp_path, *extra):
    return [
        sys.executable, "-m", "tfdist", "train", "mnist", "--output", str(tmp_path / "run"),
        "--train-split", "train[:5%]", "--epochs", "2", "--save-freq", "5", "--verbose", "2",
        *extra,
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.mnist
def test_job_killed_with_sigkill_resumes_and_writes_its_outputs(tmp_path):
    ckpt = tmp_path / "run" / "ckpt"
    job = subprocess.Popen(
        _job(tmp_path), env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while len(list(ckpt.glob("ckpt-*.keras"))) < 3:
            assert job.poll() is None, job.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoints within 300 s"
            time.sleep(0.1)
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
        job.stdout.close()
    assert job.returncode == -signal.SIGKILL

    done = subprocess.run(
        _job(tmp_path), env=child_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.startswith("test_accuracy=") and "epochs=2" in summary

    assert "tfdist train mnist: resuming from" in done.stdout  # said once, on stdout
    out = tmp_path / "run"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from"] is not None  # it did not start again from scratch
    assert metrics["runs"] == 2 and metrics["wall_time_s"] > metrics["this_run_wall_time_s"]
    if metrics["resumed_from"]["batch"]:  # killed mid-epoch: that epoch's row is partial
        assert metrics["partial_epochs"][0]["epoch"] == metrics["resumed_from"]["epoch"]
    assert all(isinstance(v, (int, float)) for r in metrics["history"] for v in r.values())
    assert metrics["test_accuracy"] > 0.9  # 2 epochs on 3,000 images
    assert f"test_accuracy={metrics['test_accuracy']:.4f}" in summary
    assert [int(r["epoch"]) for r in metrics["history"]] == [0, 1]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "ckpt" / "logs").rglob("events.out.tfevents.*")), "no TensorBoard logs"
    code = (
        f"import keras; m = keras.models.load_model({str(out / 'model.keras')!r}); "
        "print(m.output_shape)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert loaded.stdout.strip().endswith("(None, 10)"), loaded.stderr[-2000:]

    # The same command again only evaluates, and says so; the total time grows.
    again = subprocess.run(
        _job(tmp_path), env=child_env(), capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished 2 epochs: evaluating only" in again.stdout
    total = json.loads((out / "metrics.json").read_text())["wall_time_s"]
    assert total > metrics["wall_time_s"]

    # Another batch in the same folder is refused, naming both values.
    other = subprocess.run(
        _job(tmp_path, "--per-replica-batch", "64"),
        env=child_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert other.returncode == 2, other.stderr[-3000:]
    assert "global_batch=128 there, 64 now" in other.stderr


# `tfdist train mnist` in this process (forked warm), killed -9 after step KILL_AFTER
# when asked (a callback added to the standard set).
_IN_PROCESS = """
import os, signal, sys
import keras, tfdist
from tfdist.cli import main

if {kill_after}:
    standard = tfdist.callbacks.standard

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 == {kill_after}:
                os.kill(os.getpid(), signal.SIGKILL)

    tfdist.callbacks.standard = lambda *a, **k: standard(*a, **k) + [Kill()]
sys.exit(main({argv!r}))
"""


@pytest.mark.mnist
def test_checkpoint_dir_in_a_bucket_resumes_a_killed_job(tmp_path, s3_bucket):
    """``--checkpoint-dir s3://...`` (moto's S3 server): the job killed -9 after step 8
    (saves every 3 steps) resumes from ``ckpt-1-6.keras`` in the bucket, where job.json
    (read back: 2 runs, the partial epoch) lies beside the checkpoints; TensorBoard logs
    and the outputs stay local."""
    out, ckpt = tmp_path / "run", s3_bucket.url("run")
    argv = [
        "train", "mnist", "--output", str(out), "--checkpoint-dir", ckpt, "--epochs", "1",
        "--train-split", "train[:1%]", "--per-replica-batch", "32", "--save-freq", "3",
        "--verbose", "0",
    ]  # fmt: skip
    killed = run_python(
        _IN_PROCESS.format(kill_after=8, argv=argv), check=False, timeout=300, **s3_bucket.env
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-3000:]
    assert s3_bucket.names("run") == ["ckpt-1-3.keras", "ckpt-1-6.keras", "job.json"]

    done = run_python(_IN_PROCESS.format(kill_after=0, argv=argv), timeout=300, **s3_bucket.env)
    assert f"resuming from {ckpt}/ckpt-1-6.keras at epoch 1 of 1, batch 6 of 18" in done.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from"] == {
        "checkpoint": f"{ckpt}/ckpt-1-6.keras",
        "epoch": 0,
        "batch": 6,
    }
    assert metrics["runs"] == 2 and metrics["partial_epochs"][0]["resumed_at_batch"] == 6
    saved = json.loads(s3_bucket.fs.cat(f"{s3_bucket.name}/run/job.json"))
    assert saved["runs"][-1]["resumed_from"] == metrics["resumed_from"]
    assert "ckpt-1.keras" in s3_bucket.names("run")
    assert not [n for n in s3_bucket.names("run") if n.startswith(".tmp-")]
    assert list((out / "logs").rglob("events.out.tfevents.*")) and not (out / "ckpt").exists()


@pytest.mark.jax
@pytest.mark.slow
@pytest.mark.mnist
def test_backend_jax_trains_the_same_job(tmp_path):
    argv = _job(tmp_path, "--backend", "jax")
    argv[argv.index("2")] = "1"  # one epoch: this checks the backend, not the accuracy
    proc = subprocess.run(
        argv, env=child_env(KERAS_BACKEND=None), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["backend"] == "jax" and metrics["test_accuracy"] > 0.8


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
def test_job_without_mnist_fails_fast_naming_tfds_data_dir(tmp_path, workers):
    # A closed loopback port as proxy: a download attempt fails here, never on the network.
    env = child_env(
        TFDS_DATA_DIR=str(tmp_path / "empty"),
        HTTPS_PROXY="http://127.0.0.1:9",
        HTTP_PROXY="http://127.0.0.1:9",
        https_proxy="http://127.0.0.1:9",
        http_proxy="http://127.0.0.1:9",
    )
    start = time.monotonic()
    proc = subprocess.run(
        _job(tmp_path, *workers), env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "launching" not in proc.stdout  # with --workers: checked before any worker starts
    assert time.monotonic() - start < 60  # tfds alone would retry for minutes
    assert "TFDS_DATA_DIR" in proc.stderr and "tfdist train: error" in proc.stderr
    assert not (tmp_path / "run" / "ckpt").exists()  # it failed before writing anything
