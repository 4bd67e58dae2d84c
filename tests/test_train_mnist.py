"""`tfdist train mnist`: argument handling, the restartable job on real MNIST, offline failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfdist.cli import build_parser
from tfdist.examples import mnist

from conftest import child_env

MNIST_ON_DISK = (
    Path(os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets"))
    .expanduser()
    .joinpath("mnist")
    .is_dir()
)


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


def _job(tmp_path, *extra):
    return [
        sys.executable, "-m", "tfdist", "train", "mnist", "--output", str(tmp_path / "run"),
        "--train-split", "train[:5%]", "--epochs", "2", "--save-freq", "5", "--verbose", "2",
        *extra,
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not MNIST_ON_DISK, reason="needs MNIST on disk (set TFDS_DATA_DIR)")
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

    out = tmp_path / "run"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from"] is not None  # it did not start again from scratch
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


def test_job_without_mnist_fails_fast_naming_tfds_data_dir(tmp_path):
    # A closed loopback port as proxy: a download attempt fails here, never on the network.
    env = child_env(
        TFDS_DATA_DIR=str(tmp_path / "empty"),
        HTTPS_PROXY="http://127.0.0.1:9",
        HTTP_PROXY="http://127.0.0.1:9",
        https_proxy="http://127.0.0.1:9",
        http_proxy="http://127.0.0.1:9",
    )
    start = time.monotonic()
    proc = subprocess.run(_job(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.monotonic() - start < 60  # tfds alone would retry for minutes
    assert "TFDS_DATA_DIR" in proc.stderr and "tfdist train: error" in proc.stderr
    assert not (tmp_path / "run" / "ckpt").exists()  # it failed before writing anything
