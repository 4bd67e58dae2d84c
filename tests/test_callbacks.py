"""tfdist.callbacks: decay, PrintLR, warmup, the linear scaling rule, standard()."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.core.cluster import worker_tf_config

from conftest import equivalence, last_json_line, run_python

X = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
Y = X.sum(axis=1, keepdims=True)


def build(learning_rate=0.01):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    return model


class RateLog(keras.callbacks.Callback):
    """The rate each step trained with, read at batch begin (after other callbacks set it)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(tfdist.callbacks.current_learning_rate(self.model.optimizer))


def fit(model, callbacks, epochs=3, initial_epoch=0):
    log = RateLog()
    model.fit(
        X,
        Y,
        batch_size=8,
        epochs=epochs,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        callbacks=[*callbacks, log],
    )
    return log.rates


# --------------------------------------------------------------------------- decay


def guides_decay(epoch):
    if epoch < 1:
        return 1e-3
    elif epoch < 2:
        return 1e-4
    return 1e-5


@pytest.mark.parametrize(
    "schedule",
    [guides_decay, {0: 1e-3, 1: 1e-4, 2: 1e-5}, lambda epoch, lr: [1e-3, 1e-4, 1e-5][epoch]],
    ids=["callable", "mapping", "epoch-and-rate"],
)
def test_decay_sets_each_epochs_rate(schedule):
    rates = fit(build(), [tfdist.callbacks.decay(schedule)])
    equivalence.assert_allclose(rates, [1e-3] * 4 + [1e-4] * 4 + [1e-5] * 4, rtol=1e-6)


def test_decay_mapping_keeps_the_optimizer_rate_before_its_first_key():
    rates = fit(build(0.05), [tfdist.callbacks.decay({1: 0.01})], epochs=2)
    equivalence.assert_allclose(rates, [0.05] * 4 + [0.01] * 4, rtol=1e-6)


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ({}, ValueError, "mapping of epoch boundaries to rates is empty"),
        ({-1: 0.1}, ValueError, r"keys must be epochs \(ints >= 0\).*-1"),
        ({0: 0.0}, ValueError, r"schedule\[0\] must be a positive finite number.*0.0"),
        ({0: "fast"}, TypeError, "schedule\\[0\\] must be a positive finite number"),
        (0.1, TypeError, r"schedule must be a callable .* Received: schedule=0.1"),
    ],
)
def test_decay_rejects_bad_schedules(bad, error, message):
    with pytest.raises(error, match=message):
        tfdist.callbacks.decay(bad)


def test_decay_schedule_returning_garbage_is_named():
    with pytest.raises(
        ValueError, match=r"must return a positive float.*schedule\(0\) returned -1"
    ):
        fit(build(), [tfdist.callbacks.decay(lambda epoch: -1)], epochs=1)


def test_decay_does_not_apply_twice_in_a_resumed_partial_epoch(tmp_path):
    """A rate of the form lr -> lr / 2 must not be halved again when resuming mid-epoch."""

    def halve(epoch, lr):
        return lr / 2

    reference = fit(build(0.08), [tfdist.callbacks.decay(halve)], epochs=2)
    model = build(0.08)
    fit(
        model,
        [tfdist.callbacks.decay(halve), tfdist.callbacks.checkpoint(tmp_path, save_freq=6)],
        epochs=2,
    )
    os.remove(tmp_path / "ckpt-1.keras")
    os.remove(tmp_path / "ckpt-2.keras")  # leave ckpt-2-2.keras: 2 batches into epoch 2
    restored, initial_epoch = tfdist.make_or_restore(
        lambda: build(0.08), tmp_path, strategy=tf.distribute.get_strategy()
    )
    assert initial_epoch == 1
    # the in-memory stand-in for the data position: numpy data replays the epoch, so
    # only the rate (not the weights) is compared here
    resumed = fit(restored, [tfdist.callbacks.decay(halve)], epochs=2, initial_epoch=1)
    equivalence.assert_allclose(resumed, reference[4:], rtol=1e-6)


# --------------------------------------------------------------------------- PrintLR


def test_print_lr_prints_the_rate_in_use_on_the_chief(capsys):
    fit(build(0.1), [tfdist.callbacks.decay({1: 0.05}), tfdist.callbacks.PrintLR()], epochs=2)
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert lines == ["Learning rate for epoch 1 is 0.1", "Learning rate for epoch 2 is 0.05"]


def test_print_lr_evaluates_a_schedule_at_the_current_step(capsys):
    keras.utils.set_random_seed(0)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=4, decay_rate=0.5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    fit(model, [tfdist.callbacks.PrintLR()], epochs=2)
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    # after 4 and 8 steps: 0.1 * 0.5 ** (4 / 4) and 0.1 * 0.5 ** (8 / 4)
    assert lines == ["Learning rate for epoch 1 is 0.05", "Learning rate for epoch 2 is 0.025"]


def test_print_lr_is_silent_on_other_workers(capsys, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", worker_tf_config(["127.0.0.1:1", "127.0.0.1:2"], 1))
    fit(build(0.1), [tfdist.callbacks.PrintLR()], epochs=1)
    assert "Learning rate" not in capsys.readouterr().out


def test_current_learning_rate_rejects_non_optimizers():
    with pytest.raises(TypeError, match=r"optimizer must be a keras.optimizers.Optimizer.*'adam'"):
        tfdist.callbacks.current_learning_rate("adam")


# --------------------------------------------------------------------------- warm-up


def test_warmup_ramps_linearly_then_hands_over_to_decay():
    warm = tfdist.callbacks.warmup(0.08, steps=4, start_factor=0.5)
    rates = fit(build(0.01), [tfdist.callbacks.decay({1: 0.02}), warm], epochs=2)
    # steps 0-3 warm up from 0.5 * 0.08 to 0.08; epoch 2 belongs to decay
    expected = [0.08 * (0.5 + 0.5 * (s + 1) / 4) for s in range(4)] + [0.02] * 4
    equivalence.assert_allclose(rates, expected, rtol=1e-6)


def test_warmup_continues_from_the_restored_step(tmp_path):
    reference = fit(build(), [tfdist.callbacks.warmup(0.1, steps=8)], epochs=2)
    fit(build(), [tfdist.callbacks.warmup(0.1, steps=8), tfdist.callbacks.checkpoint(tmp_path)], 1)
    restored, initial_epoch = tfdist.make_or_restore(
        build, tmp_path, strategy=tf.distribute.get_strategy()
    )
    resumed = fit(restored, [tfdist.callbacks.warmup(0.1, steps=8)], 2, initial_epoch)
    equivalence.assert_allclose(resumed, reference[4:], rtol=1e-6)
    equivalence.assert_allclose(reference, [0.1 * (s + 1) / 8 for s in range(8)], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target": 0, "steps": 10}, r"target must be a positive finite number.*target=0"),
        ({"target": 0.1, "steps": 0}, r"steps must be a positive int.*steps=0"),
        ({"target": 0.1, "steps": 5, "start_factor": 1.0}, r"start_factor must be .*\[0, 1\)"),
    ],
)
def test_warmup_rejects_bad_arguments(kwargs, message):
    target, steps = kwargs.pop("target"), kwargs.pop("steps")
    with pytest.raises(ValueError, match=message):
        tfdist.callbacks.warmup(target, steps, **kwargs)


def test_warmup_refuses_a_schedule_optimizer():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    with pytest.raises(TypeError, match="CosineDecay"):
        fit(model, [tfdist.callbacks.warmup(0.1, 4)], epochs=1)


def test_scale_learning_rate_validates():
    with pytest.raises(ValueError, match=r"base_lr must be a positive finite number.*-1"):
        tfdist.callbacks.scale_learning_rate(-1)


# --------------------------------------------------------------------------- standard


def test_standard_is_the_walkthrough_set_and_writes_logs_under_the_checkpoint_dir(tmp_path):
    callbacks = tfdist.callbacks.standard(tmp_path, decay=guides_decay)
    assert [type(c).__name__ for c in callbacks] == [
        "ResumableCheckpoint",
        "Decay",
        "PrintLR",
        "TensorBoard",
    ]
    fit(build(), callbacks, epochs=1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1.keras", "logs"]
    assert os.listdir(tmp_path / "logs")  # TensorBoard event files


def test_standard_leaves_tensorboard_to_the_chief(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", worker_tf_config(["127.0.0.1:1", "127.0.0.1:2"], 1))
    callbacks = tfdist.callbacks.standard(tmp_path)
    assert [type(c).__name__ for c in callbacks] == ["ResumableCheckpoint", "PrintLR"]
    with pytest.raises(TypeError, match=r"warmup must be a callback from tfdist.callbacks.warmup"):
        tfdist.callbacks.standard(tmp_path, warmup=0.1)


def test_standard_refuses_a_log_dir_tensorflow_cannot_write_at_once_on_every_worker(
    tmp_path, monkeypatch
):
    """TensorBoard writes through TensorFlow's file system, which has gs:// but no s3://
    (upstream: Keras's callback fails as fit starts, before the first batch, and only on
    the chief, the one worker standard() gives it). standard() refuses such a log_dir when
    it is called, on the chief and the other workers alike, before the checkpoint
    callback touches the store; a local log_dir, a gs:// one or tensorboard=False are
    what it asks for."""
    assert "gs" in tf.io.gfile.get_registered_schemes()
    assert "s3" not in tf.io.gfile.get_registered_schemes()
    log = RateLog()
    with pytest.raises(tf.errors.UnimplementedError, match=r"scheme 's3' not implemented"):
        board = keras.callbacks.TensorBoard("s3://bucket/run/logs")
        build().fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[log, board])
    assert log.rates == []  # no batch trained

    default = (
        r"TensorBoard cannot write its logs to 's3://bucket/run/logs' \(checkpoint_dir/logs, "
        r"the default\): TensorFlow's file system has no 's3' scheme \(it writes local paths "
        r"and .*gs://.*\)\. Received: log_dir=None, checkpoint_dir='s3://bucket/run'\. Pass "
        r"log_dir= a local directory .* or a gs:// URL, or tensorboard=False"
    )
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    for rank in (0, 1):  # the chief, and a worker that would not even build TensorBoard
        monkeypatch.setenv("TF_CONFIG", worker_tf_config(addresses, rank))
        assert tfdist.is_chief() == (rank == 0)
        with pytest.raises(ValueError, match=default):
            tfdist.callbacks.standard("s3://bucket/run")
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(ValueError, match=r"'s3://b/logs': .*Received: log_dir='s3://b/logs'"):
        tfdist.callbacks.standard(tmp_path, log_dir="s3://b/logs")

    bucket = f"memory://{tmp_path.name}/run"  # no more writable by TensorFlow than s3://
    with pytest.raises(ValueError, match=r"no 'memory' scheme"):
        tfdist.callbacks.standard(bucket)
    local = tfdist.callbacks.standard(bucket, log_dir=tmp_path / "logs")
    assert local[-1].log_dir == str(tmp_path / "logs")
    assert tfdist.callbacks.standard(tmp_path, log_dir="gs://b/logs")[-1].log_dir == "gs://b/logs"
    kinds = [type(c).__name__ for c in tfdist.callbacks.standard(bucket, tensorboard=False)]
    assert kinds == ["ResumableCheckpoint", "PrintLR"]


@pytest.mark.devices
def test_callbacks_on_two_logical_devices(tmp_path):
    proc = run_python(
        f"""
        import json, numpy as np, tfdist, keras
        tfdist.strategy()
        lr = tfdist.callbacks.scale_learning_rate(0.05)
        with tfdist.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
        x = np.ones((16, 4), "float32")
        callbacks = tfdist.callbacks.standard({str(tmp_path)!r}, decay={{1: lr / 10}},
                                              warmup=tfdist.callbacks.warmup(lr, 2))
        model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
        print(json.dumps({{"replicas": tfdist.num_replicas(), "lr": lr}}))
        """,
        TFDIST_CPU_DEVICES="2",
    )
    result = last_json_line(proc.stdout)
    assert result == {"replicas": 2, "lr": 0.1}  # the linear scaling rule: 0.05 x 2
    assert "Learning rate for epoch 1 is 0.1\n" in proc.stdout
    assert "Learning rate for epoch 2 is 0.01\n" in proc.stdout
    assert {"ckpt-1.keras", "ckpt-2.keras", "logs"} <= set(os.listdir(tmp_path))


# --------------------------------------------------------------------------- preemption protocol


class DictStore:
    """The coordination store's two calls, in memory (shared by the workers of a test)."""

    def __init__(self):
        import threading

        self.values: dict[str, str] = {}
        self.changed = threading.Condition()

    def set(self, key, value):
        with self.changed:
            if key in self.values:
                return False
            self.values[key] = value
            self.changed.notify_all()
            return True

    def get(self, key, timeout_ms):
        with self.changed:
            self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000)
            return self.values.get(key)


def _watches(store, ranks, timeout=10.0):
    import threading

    from tfdist.checkpoint.preemption import PreemptionWatch

    watches = []
    for rank in range(2):
        watch = PreemptionWatch(
            multi_worker=True, rank=rank, num_workers=2, key="k", timeout=timeout, store=store
        )
        if rank in ranks:  # start() without the SIGTERM handler: only the watcher thread
            threading.Thread(target=watch._watch_peers, daemon=True).start()
        watches.append(watch)
    return watches


def test_preemption_workers_agree_on_the_step_after_the_notice():
    """Worker 1 gets SIGTERM after step 4: every worker saves after step 5, none earlier."""
    store = DictStore()
    first, second = _watches(store, ranks=(0, 1))
    second._received.set()  # what the SIGTERM handler does
    assert [first.should_save(4), second.should_save(4)] == [False, False]
    assert store.values == {"k": "5", "k/ack/0": "1", "k/ack/1": "1"}
    assert [first.should_save(5), second.should_save(5)] == [True, True]
    for watch in (first, second):
        watch.stop()


def test_preemption_without_an_acknowledgement_saves_anyway_after_the_timeout(caplog):
    store = DictStore()
    first, second = _watches(store, ranks=(1,), timeout=0.2)  # worker 0 never answers
    second._received.set()
    assert not second.should_save(4)
    assert second.should_save(5)
    assert "worker 0 did not acknowledge" in caplog.text
    for watch in (first, second):
        watch.stop()
