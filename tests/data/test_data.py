"""Tests of tfdist.data: validation, epoch order and position (exact resume), map
placement, sharding, MNIST loading, and equivalence on 1 and 2 logical devices and on
2 real workers.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tfdist import data
from tfdist.core import process
from tfdist.core.cluster import worker_tf_config
from tfdist.core.position import Position
from tfdist.data import sharding

from conftest import (
    MNIST_DIR,
    MNIST_ON_DISK,
    REPO,
    SCRIPTS,
    child_env,
    equivalence,
    last_json_line,
    run_python,
)

needs_mnist = pytest.mark.mnist  # the rule: tests/conftest.py


@pytest.fixture(autouse=True)
def _position_zero():
    # Seeded pipelines start at the last position set in this process.
    data.set_position(0)
    yield
    data.set_position(0)


def ids(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def epochs(ds, k: int) -> list[list[list[int]]]:
    """k iterations of ``ds``: per epoch, per batch, the example ids."""
    return [[b.numpy().tolist() for b in ds] for _ in range(k)]


def flat(epoch) -> list[int]:
    return [i for batch in epoch for i in batch]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, -2])
def test_per_replica_batch_must_be_positive(bad):
    with pytest.raises(
        ValueError,
        match=rf"per_replica_batch must be a positive int\. Received: per_replica_batch={bad}\.",
    ):
        data.pipeline(ids(10), bad)


@pytest.mark.parametrize("bad", [2.5, "64", True])
def test_per_replica_batch_must_be_an_int(bad):
    with pytest.raises(
        TypeError, match=r"Received: per_replica_batch=" + repr(bad).replace(".", r"\.")
    ):
        data.pipeline(ids(10), bad)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"map_fn": 3}, TypeError, r"map_fn must be callable or None\. Received: map_fn=3"),
        ({"map_on": "rows"}, ValueError, r"map_on must be one of .* Received: map_on='rows'"),
        ({"cache": 1}, TypeError, r"cache must be True .* Received: cache=1"),
        ({"cache": ""}, ValueError, r"cache must be True .* Received: cache=''"),
        ({"shuffle": 0}, ValueError, r"shuffle must be a positive int .* Received: shuffle=0"),
        ({"shuffle": True}, TypeError, r"Received: shuffle=True"),
        ({"seed": -1}, ValueError, r"seed must be None or an int .* Received: seed=-1"),
        ({"seed": "7"}, TypeError, r"Received: seed='7'"),
        ({"drop_remainder": "yes"}, TypeError, r"Received: drop_remainder='yes'"),
        ({"strategy": "mirrored"}, TypeError, r"Received: strategy='mirrored'"),
    ],
)
def test_bad_options_name_the_argument_and_echo_it(options, error, message):
    with pytest.raises(error, match=message):
        data.pipeline(ids(10), 2, **options)


@pytest.mark.parametrize("bad", ["images.npy", [1, 2, 3], {"x": [1, 2]}, 42])
def test_dataset_must_be_a_dataset_or_arrays(bad):
    with pytest.raises(TypeError, match=r"dataset must be a tf\.data\.Dataset, a numpy array"):
        data.pipeline(bad, 2)


def test_arrays_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match=r"same number of examples .* Received lengths \[3, 4\]"):
        data.pipeline((np.zeros((4, 2)), np.zeros(3)), 2)


def test_a_repeating_dataset_is_refused():
    with pytest.raises(ValueError, match=r"must be finite.*Remove \.repeat\(\)"):
        data.pipeline(tf.data.Dataset.range(5).repeat(), 2)


def _examples() -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices((np.zeros((40, 3), "float32"), np.arange(40)))


@pytest.mark.parametrize(
    "batched",
    [
        lambda: _examples().cache().shuffle(40).batch(8).prefetch(2),  # the guides' pipeline
        lambda: _examples().batch(8, drop_remainder=True).map(lambda x, y: (x + 1, y)),
        lambda: _examples().map(lambda x, y: x).padded_batch(8),
        lambda: _examples().batch(8).with_options(tf.data.Options()),
    ],
    ids=["batch-prefetch", "batch-then-map", "padded-batch", "batch-then-options"],
)
def test_an_already_batched_dataset_is_refused_not_batched_twice(batched):
    """Upstream would silently yield batches of batches (shape (16, 8, 3) here)."""
    with pytest.raises(
        ValueError,
        match=r"dataset must be a dataset of single examples, but its elements are batches"
        r".*Received: dataset=.*Pass the dataset before its \.batch\(\).*\.unbatch\(\)",
    ):
        data.pipeline(batched(), 8)


@needs_mnist
def test_tfds_loaded_with_batch_size_is_refused():
    import tensorflow_datasets as tfds

    ds = tfds.load("mnist", split="test", as_supervised=True, batch_size=32, data_dir=MNIST_DIR)
    with pytest.raises(ValueError, match=r"its elements are batches \(made by PaddedBatch"):
        data.pipeline(ds, 8)


def test_examples_made_with_batch_then_unbatched_or_mapped_are_examples():
    """``.unbatch()``, and the text tutorial's sequences (``batch(seq_len + 1)`` mapped
    to fixed-size (input, target) pairs) are datasets of examples: accepted."""
    unbatched = _examples().batch(8).unbatch()
    sequences = (
        tf.data.Dataset.range(200).batch(11, drop_remainder=True).map(lambda s: (s[:-1], s[1:]))
    )
    _, labels = next(iter(data.pipeline(unbatched, 8, shuffle=None)))
    assert labels.numpy().tolist() == list(range(len(labels)))
    inputs, targets = next(iter(data.pipeline(sequences, 2, shuffle=None)))
    assert inputs.shape[1:] == (10,) and inputs[0].numpy().tolist() == list(range(10))
    assert targets[0].numpy().tolist() == list(range(1, 11))


def test_fewer_examples_than_one_dropped_batch_is_an_error_that_says_what_to_do():
    with pytest.raises(ValueError, match=r"has 5 examples, fewer than one global batch of 8"):
        data.pipeline(ids(5), 8)
    # Keeping the partial batch is the way out.
    assert epochs(data.pipeline(ids(5), 8, drop_remainder=False, shuffle=None), 1) == [
        [[0, 1, 2, 3, 4]]
    ]


def test_an_empty_dataset_is_an_error():
    empty = tf.data.Dataset.range(10).filter(lambda i: i > 100)
    with pytest.raises(ValueError, match=r"dataset is empty"):
        data.pipeline(empty, 2)


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((-1,), ValueError, r"epoch must be a non-negative int\. Received: epoch=-1"),
        ((1.5,), TypeError, r"Received: epoch=1\.5"),
        ((0, -3), ValueError, r"batch must be a non-negative int\. Received: batch=-3"),
        ((True, 0), TypeError, r"Received: epoch=True"),
    ],
)
def test_set_position_validates_its_arguments(args, error, message):
    with pytest.raises(error, match=message):
        data.set_position(*args)


def test_position_of_an_unseeded_or_foreign_dataset_is_an_error():
    with pytest.raises(ValueError, match=r"pipeline built with a seed"):
        data.position(data.pipeline(ids(10), 2))
    with pytest.raises(ValueError, match=r"pipeline built with a seed"):
        data.position(tf.data.Dataset.range(3))
    with pytest.raises(TypeError, match=r"pipeline built with a seed.*Received: dataset=3"):
        data.position(3)


# --------------------------------------------------------------------------- batches


def test_arrays_tuples_and_dicts_are_batched_with_the_global_batch():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    (xb, yb), *_ = data.pipeline((x, ids(6)), 4, shuffle=None)
    equivalence.assert_allclose(xb.numpy(), x[:4])
    assert yb.numpy().tolist() == [0, 1, 2, 3]
    first = next(iter(data.pipeline({"a": ids(6), "b": ids(6) * 10}, 3, shuffle=None)))
    assert first["b"].numpy().tolist() == [0, 10, 20]


def test_unshuffled_pipeline_keeps_order_and_the_partial_last_batch():
    ds = data.pipeline(ids(10), 4, shuffle=None)
    assert epochs(ds, 2) == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]] * 2
    assert int(ds.cardinality()) == 3


@pytest.mark.parametrize("cache", [True, False])
def test_shuffled_pipeline_drops_the_partial_batch_and_keeps_a_static_shape(cache):
    ds = data.pipeline(ids(20), 8, seed=1, cache=cache)
    assert ds.element_spec.shape == (8,)
    assert [len(b) for b in epochs(ds, 1)[0]] == [8, 8]
    assert int(ds.cardinality()) == 2


@pytest.mark.parametrize("seed", [None, 5])
@pytest.mark.parametrize("cache", [True, False])
def test_every_epoch_is_a_new_permutation_of_all_examples(seed, cache):
    ds = data.pipeline(ids(50), 8, seed=seed, shuffle=50, cache=cache, drop_remainder=False)
    first, second = epochs(ds, 2)
    assert sorted(flat(first)) == sorted(flat(second)) == list(range(50))
    assert flat(first) != flat(second)


def test_file_cache_is_written_and_reused(tmp_path):
    prefix = tmp_path / "cache" / "ids"
    ds = data.pipeline(ids(30), 4, seed=2, cache=str(prefix), drop_remainder=False)
    first, second = epochs(ds, 2)
    assert sorted(flat(first)) == sorted(flat(second)) == list(range(30))
    assert any(p.name.startswith("ids") for p in prefix.parent.iterdir())


# --------------------------------------------------------------------------- position contract


@pytest.mark.parametrize("cache", [True, False])
def test_set_position_gives_exactly_epoch_e_from_batch_s(cache):
    reference = data.pipeline(ids(40), 4, seed=11, shuffle=40, cache=cache)
    expected = epochs(reference, 4)  # epochs 0, 1, 2, 3 in order
    assert len({str(e) for e in expected}) == 4  # every epoch has its own order

    data.set_position(2, 3)
    resumed = data.pipeline(ids(40), 4, seed=11, shuffle=40, cache=cache)  # built after
    assert data.position(resumed) == Position(2, 3)
    assert epochs(resumed, 1)[0] == expected[2][3:]
    # The next iteration is the next epoch, complete.
    assert data.position(resumed) == Position(3, 0)
    assert epochs(resumed, 1)[0] == expected[3]
    # set_position also moves pipelines that already exist.
    data.set_position(1, 9)
    assert epochs(reference, 1)[0] == expected[1][9:]
    # A full epoch is still what cardinality() reports (Keras sizes its epochs by it).
    assert int(resumed.cardinality()) == 10


def test_creating_an_iterator_does_not_move_the_position():
    ds = data.pipeline(ids(16), 4, seed=3)
    iterator = iter(ds)
    assert data.position(ds) == Position(0, 0)
    next(iterator)
    assert data.position(ds) == Position(1, 0)


@pytest.mark.parametrize("cache", [True, False])
def test_order_depends_on_seed_and_epoch_only_not_on_the_global_seed(cache):
    expected = epochs(data.pipeline(ids(30), 5, seed=4, shuffle=30, cache=cache), 2)
    try:
        tf.random.set_seed(1234)
        data.set_position(0)
        again = epochs(data.pipeline(ids(30), 5, seed=4, shuffle=30, cache=cache), 2)
    finally:
        tf.random.set_seed(None)
    assert again == expected
    data.set_position(0)
    assert epochs(data.pipeline(ids(30), 5, seed=5, shuffle=30, cache=cache), 1)[0] != expected[0]


def test_unseeded_pipelines_ignore_set_position():
    validation = data.pipeline(ids(10), 4, shuffle=None)
    shuffled = data.pipeline(ids(12), 4, drop_remainder=False)
    data.set_position(5, 2)
    assert epochs(validation, 1)[0] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert sorted(flat(epochs(shuffled, 1)[0])) == list(range(12))


def test_the_registry_does_not_keep_dropped_pipelines_alive_but_a_derived_dataset_does():
    import gc

    def derived():
        return data.pipeline((ids(8), ids(8) * 2), 4, seed=1).map(lambda a, b: b)

    ds = derived()
    gc.collect()
    assert sorted(flat(epochs(ds, 1)[0])) == [2 * i for i in range(8)]
    before = len(process.state().pipelines)
    data.pipeline(ids(8), 4, seed=1)  # dropped at once
    gc.collect()
    assert len(process.state().pipelines) == before


# --------------------------------------------------------------------------- map_fn placement


def _minus_min(x):
    # Per example this is 0; applied to a whole batch it is not: tells them apart.
    return x - tf.reduce_min(x)


def test_auto_map_is_per_example_even_when_vectorised(caplog):
    with caplog.at_level(logging.INFO, logger="tfdist.data"):
        ds = data.pipeline(ids(12) + 100, 4, map_fn=_minus_min, shuffle=None)
    assert "map_fn applied vectorised" in caplog.text
    assert flat(epochs(ds, 1)[0]) == [0] * 12
    per_example = data.pipeline(ids(12) + 100, 4, map_fn=_minus_min, map_on="example")
    assert flat(epochs(per_example, 1)[0]) == [0] * 12


def test_a_batch_safe_map_fn_is_called_once_on_all_examples_with_the_same_result():
    calls = []

    def double(x):
        calls.append(x.shape.rank)
        return x * 2

    double.batch_safe = True  # as tfdist.data.scale is
    fast = data.pipeline(ids(12), 4, map_fn=double, shuffle=None)
    assert calls == [1]  # traced once, on the whole (1-D) batch of ids: no vectorising
    per_example = data.pipeline(ids(12), 4, map_fn=double, map_on="example", shuffle=None)
    expected = [[[0, 2, 4, 6], [8, 10, 12, 14], [16, 18, 20, 22]]]
    assert epochs(fast, 1) == epochs(per_example, 1) == expected
    assert data.scale.batch_safe is True


def test_map_on_batch_applies_map_fn_to_each_global_batch():
    ds = data.pipeline(ids(8), 4, map_fn=_minus_min, map_on="batch", shuffle=None)
    assert epochs(ds, 1)[0] == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_a_map_fn_that_cannot_be_vectorised_runs_per_example(caplog):
    def through_python(x):
        return tf.py_function(lambda v: v * 3, [x], tf.int64)

    with caplog.at_level(logging.INFO, logger="tfdist.data"):
        ds = data.pipeline(ids(6), 3, map_fn=through_python, shuffle=None)
    assert "cannot vectorise" in caplog.text and "map_fn applied per example" in caplog.text
    assert flat(epochs(ds, 1)[0]) == [0, 3, 6, 9, 12, 15]


def test_scale_maps_uint8_images_to_float32_in_0_1():
    images = np.array([[0, 51, 255]], dtype=np.uint8)
    scaled, label = data.scale(images, 7)
    assert scaled.dtype == tf.float32 and label == 7
    equivalence.assert_allclose(scaled.numpy(), [[0.0, 0.2, 1.0]], rtol=1e-7)  # float32


# --------------------------------------------------------------------------- sharding


def _write_ids(path: Path, values) -> str:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for v in values:
            feature = {"id": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v)]))}
            writer.write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )
    return str(path)


def test_shard_policy_is_file_only_with_a_file_per_worker(tmp_path):
    Policy = tf.data.experimental.AutoShardPolicy
    files = [_write_ids(tmp_path / f"part{k}.tfrecord", range(k, 30, 3)) for k in range(3)]
    by_file = tf.data.TFRecordDataset(files)
    interleaved = tf.data.Dataset.from_tensor_slices(files).interleave(tf.data.TFRecordDataset)
    one_file = tf.data.TFRecordDataset(files[:1])
    assert sharding.source_file_count(by_file) == 3
    assert sharding.source_file_count(interleaved) == 3
    assert sharding.source_file_count(tf.data.Dataset.range(3)) is None

    def policy(ds, workers, **kw):
        return sharding.shard_policy(
            ds, workers, **{"in_memory": False, "positioned": False, **kw}
        )[0]

    assert policy(by_file, 3) == Policy.FILE
    assert policy(by_file, 4) == Policy.DATA  # fewer files than workers: FILE would fail
    assert policy(one_file, 2) == Policy.DATA
    assert policy(by_file, 2, positioned=True) == Policy.DATA
    assert policy(by_file, 2, in_memory=True) == Policy.DATA
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = Policy.OFF
    assert policy(by_file.with_options(options), 2) == Policy.OFF  # the user's choice wins
    pipeline_options = data.pipeline(ids(10), 2).options().experimental_distribute
    assert pipeline_options.auto_shard_policy == Policy.DATA


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiworker
@pytest.mark.slow
def test_two_workers_see_every_example_once_in_the_single_process_order(tmp_path):
    one_file = _write_ids(tmp_path / "ids.tfrecord", range(100))
    files = [_write_ids(tmp_path / f"part{k}.tfrecord", range(k, 100, 3)) for k in range(3)]
    addresses = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    command = [sys.executable, str(SCRIPTS / "data_worker.py"), "--one-file", one_file]
    procs = [
        subprocess.Popen(
            [*command, "--files", *files],
            env=child_env(TF_CONFIG=worker_tf_config(addresses, i), TF_CPP_MIN_LOG_LEVEL="0"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, f"worker failed\n{out[-2000:]}\n{err[-6000:]}"
        # The policy is always set explicitly: tf.data never has to guess (and warn).
        assert "sharding policy" not in err
    workers = [last_json_line(out) for out, _ in outputs]
    assert [w["replicas"] for w in workers] == [2, 2]

    def union(key, epoch):
        return [
            sorted(a + b)
            for a, b in zip(workers[0][key][epoch], workers[1][key][epoch], strict=True)
        ]

    # The same global batches, in the same order, as one process with the same seed.
    reference = data.pipeline(
        tf.data.TFRecordDataset([one_file]).map(
            lambda r: tf.io.parse_single_example(r, {"id": tf.io.FixedLenFeature([], tf.int64)})[
                "id"
            ]
        ),
        16,
        seed=7,
        shuffle=1000,
        drop_remainder=False,
    )
    expected = [[sorted(b) for b in epoch] for epoch in epochs(reference, 2)]
    for epoch in range(2):
        assert union("seeded", epoch) == expected[epoch]
        assert [len(s) for s in workers[0]["seeded"][epoch]] == [8] * 6 + [2]
    assert union("seeded_skip", 0) == expected[0][2:]
    # A collective in every step, the short last one included.
    assert workers[0]["seeded_counts"] == workers[1]["seeded_counts"] == [16] * 6 + [4]
    # Unseeded: the workers shuffle alike, so each example is seen exactly once.
    for key, n_epochs in (("unseeded", 2), ("by_file", 1)):
        for epoch in range(n_epochs):
            seen = [i for step in union(key, epoch) for i in step]
            assert sorted(seen) == list(range(100)), key
    assert flat(union("unseeded", 0)) != flat(union("unseeded", 1))
    # FILE sharding: each worker read only its files (2 of the 3 and 1 of the 3) ...
    residues = [{i % 3 for s in w["by_file"][0] for i in s} for w in workers]
    assert residues == [{0, 2}, {1}]
    # ... so worker 1 ran out first and joined the last collectives with empty batches.
    assert sum(workers[0]["by_file_counts"]) == 100


# --------------------------------------------------------------------------- devices


def _devices_run(devices: int, *extra: str) -> dict:
    proc = run_python(
        "import runpy, sys; sys.argv = ['data_devices.py', *sys.argv[1:]];"
        f" runpy.run_path({str(SCRIPTS / 'data_devices.py')!r}, run_name='__main__')",
        TFDIST_CPU_DEVICES=str(devices),
        timeout=300,
    )
    return last_json_line(proc.stdout)


@pytest.fixture(scope="module")
def two_devices() -> dict:
    code = (
        "import runpy, sys; sys.argv = ['data_devices.py'"
        + (", '--mnist'" if MNIST_ON_DISK else "")
        + f"]; runpy.run_path({str(SCRIPTS / 'data_devices.py')!r}, run_name='__main__')"
    )
    env = {"TFDIST_CPU_DEVICES": "2"}
    if MNIST_ON_DISK:
        env["TFDS_DATA_DIR"] = str(MNIST_DIR)
    return last_json_line(run_python(code, timeout=300, **env).stdout)


def _max_difference(a, b) -> float:
    return equivalence.max_difference(a, b)


@pytest.mark.devices
@pytest.mark.slow
def test_fit_on_a_seeded_pipeline_is_the_same_on_1_and_2_devices_and_after_a_resume(two_devices):
    one_device = _devices_run(1)
    assert (one_device["replicas"], two_devices["replicas"]) == (1, 2)
    assert two_devices["strategy"] == "MirroredStrategy"
    assert _max_difference(one_device["weights"], two_devices["weights"]) < 1e-5
    for run in (one_device, two_devices):
        # Stopped after 3 batches, resumed with set_position(0, 3): the same training.
        assert _max_difference(run["weights"], run["resumed_weights"]) < 1e-6
        # Keras creates iterators it never reads: creating one must not use the position.
        assert run["position_after_iter"] == [0, 0]
        assert run["position_after_next"] == [1, 0]


@needs_mnist
@pytest.mark.devices
@pytest.mark.slow
def test_mnist_epoch_on_2_devices_is_global_batches_of_scaled_images(two_devices):
    mnist = two_devices["mnist"]
    assert mnist["shapes"] == [[128, 28, 28, 1]] and mnist["dtypes"] == ["float32"]
    assert mnist["min"] == 0.0 and mnist["max"] == 1.0
    assert mnist["per_replica"] == [[64, 28, 28, 1], [64, 28, 28, 1]]
    assert mnist["first_labels"][0] != mnist["first_labels"][1]  # a new order each epoch
    # Seeded: this process, with 1 replica and the same global batch, sees the same order.
    seeded = data.pipeline(data.mnist("train", data_dir=MNIST_DIR), 128, map_fn=data.scale, seed=5)
    labels = [b.numpy().tolist() for _, (_, b) in zip(range(3), seeded, strict=False)]
    assert labels == mnist["seeded_labels"]


# --------------------------------------------------------------------------- MNIST


@needs_mnist
def test_mnist_loads_from_the_data_dir_without_network():
    test = data.mnist("test", data_dir=MNIST_DIR)
    assert int(test.cardinality()) == 10_000
    image, label = test.element_spec
    assert (image.shape, image.dtype, label.dtype) == ((28, 28, 1), tf.uint8, tf.int64)
    with pytest.raises(ValueError, match=r"split must be one of \['test', 'train'\]"):
        data.mnist("validation", data_dir=MNIST_DIR)


@pytest.mark.timeout(60)  # tfds's own download retries for minutes: this must not
def test_mnist_not_on_disk_and_not_downloadable_fails_naming_tfds_data_dir(tmp_path, monkeypatch):
    # A closed port on loopback as the proxy: the download fails here, at once.
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"TFDS_DATA_DIR") as err:
        data.mnist()
    assert str(tmp_path) in str(err.value) and "cannot be downloaded" in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"download=False.*TFDS_DATA_DIR"):
        data.mnist(data_dir=tmp_path / "elsewhere", download=False)


@pytest.mark.parametrize("bad, error", [(3, TypeError), ("", ValueError)])
def test_mnist_split_must_be_a_name(bad, error):
    with pytest.raises(error, match=r"split must be a tfds split name"):
        data.mnist(bad)


@pytest.mark.devices
@needs_mnist
def test_loading_mnist_before_the_scope_still_gives_the_configured_devices():
    # Loading data starts TensorFlow; mnist() creates the strategy first so that
    # TFDIST_CPU_DEVICES (and multi-worker collectives) still take effect.
    proc = run_python(
        """
        import tfdist
        train = tfdist.data.mnist("train[:1%]")
        with tfdist.scope():
            pass
        print("replicas", tfdist.num_replicas())
        """,
        TFDIST_CPU_DEVICES="2",
    )
    assert proc.stdout.split()[-2:] == ["replicas", "2"]
