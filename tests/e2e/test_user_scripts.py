"""Real users' scripts under multi-worker TensorFlow: their own pipelines and metrics.

Each script builds ``tf.distribute.MultiWorkerMirroredStrategy()`` itself and runs under
``tfdist launch -n 2`` (real processes). Without the fix named in each test, upstream
fails; with it, every worker trains on its own share of every epoch, and custom
metrics give the one-device values.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import tensorflow as tf

from tfdist.compat import tf_fixes
from tfdist.core import shard_policy

from conftest import MNIST_DIR, SCRIPTS, launch_cli


def launch(*argv: str, **env) -> subprocess.CompletedProcess:
    return launch_cli("-n", "2", *argv, timeout=400, TFDS_DATA_DIR=str(MNIST_DIR), **env)


def results(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    found = []
    for line in proc.stdout.splitlines():
        _, _, rest = line.partition(" ")
        if rest.startswith("{"):
            found.append(json.loads(rest))
    assert len(found) == 2, proc.stdout[-3000:]
    return sorted(found, key=lambda r: r["worker"])


def write_single_tfrecord(directory: Path, count: int = 256) -> None:
    with tf.io.TFRecordWriter(str(directory / "single.tfrecord")) as writer:
        for i in range(count):
            feature = tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))
            example = tf.train.Example(features=tf.train.Features(feature={"id": feature}))
            writer.write(example.SerializeToString())


# ------------------------------------------------------------------ the policy itself


def test_policy_is_file_with_a_file_per_worker_data_otherwise(tmp_path):
    Policy = tf.data.experimental.AutoShardPolicy
    files = [str(tmp_path / f"{i}.tfrecord") for i in range(3)]
    reader = tf.data.TFRecordDataset(files).batch(4)
    assert shard_policy.auto_shard_policy(reader, 3)[0] == Policy.FILE
    assert shard_policy.auto_shard_policy(reader, 4) == (Policy.DATA, "3 file(s) for 4 workers")
    in_memory = tf.data.Dataset.range(8).batch(2)
    assert shard_policy.auto_shard_policy(in_memory, 2) == (Policy.DATA, "no file reader")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = Policy.OFF
    assert shard_policy.auto_shard_policy(reader.with_options(options), 4)[0] is None
    # What the fix hands to TensorFlow: the policy set, the user's choice untouched.
    chosen = tf_fixes.explicit_shard_policy(reader, 4).options().experimental_distribute
    assert chosen.auto_shard_policy == Policy.DATA
    kept = tf_fixes.explicit_shard_policy(reader.with_options(options), 4)
    assert kept.options().experimental_distribute.auto_shard_policy == Policy.OFF


def test_unseeded_shuffle_is_detected():
    tf.random.set_seed(None)  # earlier tests in this process may have set a global seed
    assert shard_policy.unseeded_shuffle(tf.data.Dataset.range(8).shuffle(8).batch(2))
    assert not shard_policy.unseeded_shuffle(tf.data.Dataset.range(8).shuffle(8, seed=3))
    assert not shard_policy.unseeded_shuffle(tf.data.Dataset.range(8))


@pytest.mark.parametrize("workers", [0, 1.5, "2"])
def test_bad_worker_count_names_the_argument(workers):
    with pytest.raises((TypeError, ValueError), match="num_workers") as info:
        shard_policy.auto_shard_policy(tf.data.Dataset.range(2), workers)
    assert repr(workers) in str(info.value) or str(workers) in str(info.value)


# ------------------------------------------------------------------ real processes


def assert_each_worker_sees_its_share(workers: list[dict]) -> None:
    every = set(workers[0]["every_id"])
    assert len(every) == 256
    for epoch in range(2):
        shares = [set(w["epochs"][epoch]) for w in workers]
        assert all(len(s) == len(w["epochs"][epoch]) for s, w in zip(shares, workers, strict=True))
        assert not shares[0] & shares[1], f"epoch {epoch}: seen on both workers"
        assert shares[0] | shares[1] == every, f"epoch {epoch}: some never seen"
        assert len(shares[0]) == len(shares[1]) == 128
    assert all(w["predicted"] == 256 for w in workers)


@pytest.mark.slow
@pytest.mark.mnist
def test_tutorial_pipeline_on_tfds_mnist_is_sharded_by_data_across_workers(tmp_path):
    proc = launch(str(SCRIPTS / "mw_user_sharding.py"), "mnist", str(tmp_path))
    workers = results(proc)
    assert [w["error"] for w in workers] == [None, None]
    assert_each_worker_sees_its_share(workers)
    said = "sharding the input pipeline by DATA (1 file(s) for 2 workers)"
    assert (proc.stdout + proc.stderr).count(said) == 2  # once per worker


@pytest.mark.slow
@pytest.mark.upstream_failure("tf_multi_worker_auto_shard")
def test_single_tfrecord_fails_upstream_and_is_sharded_with_the_fix(tmp_path):
    write_single_tfrecord(tmp_path)
    script = str(SCRIPTS / "mw_user_sharding.py")
    upstream = results(launch(script, "tfrecord", str(tmp_path), **_without("auto_shard")))
    # One worker hits it; the other then loses its peer in the next collective.
    assert all(w["error"] for w in upstream)
    assert any("Could not apply FILE based sharding" in w["error"] for w in upstream)
    assert_each_worker_sees_its_share(results(launch(script, "tfrecord", str(tmp_path))))


def _without(fix: str) -> dict[str, str]:
    return {"TFDIST_COMPAT_EXCLUDE": f"tf_multi_worker_{fix}"}


@pytest.mark.slow
def test_custom_metrics_give_the_one_device_values_on_two_workers():
    script = str(SCRIPTS / "mw_user_metrics.py")
    upstream = results(launch(script, TFDIST_COMPAT_EXCLUDE="keras_tf_multi_worker_mean"))
    assert all(w["compiled"]["error"] for w in upstream)
    for worker in results(launch(script)):
        compiled, tracked = worker["compiled"], worker["tracked"]
        assert compiled["error"] is None and tracked["error"] is None
        assert compiled["keys"] == ["loss", "mean_pred", "positive_rate", "seen", "tp"]
        for result in (compiled, tracked):
            assert result["history"] < 1e-5 and result["evaluate"] < 1e-5
            assert result["weights"] < 1e-5
        assert compiled["tp"] > 0
        # Upstream scales compute_loss() by 1/replicas under any strategy, so the guide's
        # own tracker recorded half of one device's loss; in a train_step of the user's own
        # tfdist scales no loss and averages the gradients instead
        # (keras_tf_custom_train_step_averages_gradients): the tracker records one device's.
        assert abs(tracked["loss_ratio"] - 1.0) < 1e-5
