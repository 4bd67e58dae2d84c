import json
import sys

import numpy as np
import pytest

import tfdist
from tfdist import config
from tfdist.backends import tensorflow as strategy_mod

from conftest import SCRIPTS, last_json_line, run_python


@pytest.mark.parametrize("bad", [0, -3])
def test_global_batch_size_rejects_non_positive(bad):
    with pytest.raises(
        ValueError, match=rf"per_replica must be a positive int\. Received: per_replica={bad}"
    ):
        tfdist.global_batch_size(bad)


@pytest.mark.parametrize("bad", [2.5, "64", True, None])
def test_global_batch_size_rejects_non_int(bad):
    with pytest.raises(TypeError, match=r"Received: per_replica=" + repr(bad).replace(".", r"\.")):
        tfdist.global_batch_size(bad)


def test_global_batch_size_accepts_numpy_int_on_one_device():
    assert tfdist.global_batch_size(np.int64(64)) == 64
    assert tfdist.num_replicas() == 1


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match=r"kind must be one of .* Received: kind='mirorred'"):
        strategy_mod.plan("mirorred")


def test_multi_worker_without_cluster_says_how_to_start_workers():
    with pytest.raises(ValueError, match="tfdist launch"):
        strategy_mod.plan("multi_worker", environ={})


def test_bad_cpu_devices_env_is_named():
    with pytest.raises(config.ConfigError, match="TFDIST_CPU_DEVICES"):
        config.cpu_devices(environ={"TFDIST_CPU_DEVICES": "0"})
    with pytest.raises(config.ConfigError, match="TFDIST_CPU_DEVICES.*'two'"):
        config.cpu_devices(environ={"TFDIST_CPU_DEVICES": "two"})


def test_plan_reads_cluster_without_starting_a_server():
    from tfdist.cluster import worker_tf_config

    env = {"TF_CONFIG": worker_tf_config(["127.0.0.1:1", "127.0.0.1:2"], 1)}
    p = strategy_mod.plan("auto", environ=env)
    assert (p.kind, p.num_workers, p.num_replicas) == ("multi_worker", 2, 2)


def test_strategy_is_created_once_and_other_kinds_are_refused():
    s = tfdist.strategy()
    assert s is tfdist.strategy() is tfdist.strategy("default")
    with tfdist.scope():
        pass
    with pytest.raises(RuntimeError, match="already has a 'default' strategy"):
        tfdist.strategy("mirrored", devices=["/cpu:0", "/cpu:1"])


def test_strategy_falls_back_to_the_open_scope():
    import tensorflow as tf

    other = tf.distribute.OneDeviceStrategy("/cpu:0")
    with other.scope():
        assert tfdist.num_replicas() == 1
        assert tfdist.global_batch_size(8, strategy=other) == 8
    with pytest.raises(TypeError, match="strategy must be a tf.distribute.Strategy"):
        tfdist.num_replicas(strategy="mirrored")


@pytest.mark.devices
def test_cpu_devices_env_gives_replicas_and_global_batch():
    proc = run_python(
        "import tfdist; print(tfdist.num_replicas(), tfdist.global_batch_size(64))",
        TFDIST_CPU_DEVICES="2",
    )
    assert proc.stdout.split()[-2:] == ["2", "128"]


@pytest.mark.devices
def test_devices_initialised_with_another_count_is_a_clear_error():
    proc = run_python(
        """
        import tensorflow as tf, tfdist
        tf.constant(1.0)  # initialises TensorFlow's devices with one CPU
        try:
            tfdist.strategy(cpu_devices=2)
        except RuntimeError as err:
            print("ERR", err)
        """
    )
    assert "ERR" in proc.stdout and "already initialised" in proc.stdout
    assert "TFDIST_CPU_DEVICES=2" in proc.stdout and "new process" in proc.stdout


@pytest.mark.devices
def test_explicit_argument_wins_over_environment():
    proc = run_python(
        "import tfdist; tfdist.strategy(cpu_devices=4); print(tfdist.num_replicas())",
        TFDIST_CPU_DEVICES="2",
    )
    assert proc.stdout.split()[-1] == "4"


@pytest.mark.devices
@pytest.mark.slow
def test_fit_gives_the_same_weights_on_1_2_and_4_logical_devices():
    results = {}
    for n in (1, 2, 4):
        proc = run_python(
            f"import runpy, sys; sys.argv=['x', '--global-batch', '32', '--epochs', '2'];"
            f" runpy.run_path({str(SCRIPTS / 'fit_equivalence.py')!r}, run_name='__main__')",
            TFDIST_CPU_DEVICES=str(n),
        )
        results[n] = last_json_line(proc.stdout)
    assert [results[n]["replicas"] for n in (1, 2, 4)] == [1, 2, 4]
    assert results[1]["strategy"] != "MirroredStrategy"
    assert results[2]["strategy"] == results[4]["strategy"] == "MirroredStrategy"
    assert results[2]["variable_type"] == "MirroredVariable"
    # training happened: the loss fell
    assert results[1]["loss"][-1] < results[1]["loss"][0]
    for n in (2, 4):
        for a, b in zip(results[1]["weights"], results[n]["weights"], strict=True):
            np.testing.assert_allclose(np.array(b), np.array(a), atol=1e-5, rtol=0)


def test_cli_help_does_not_import_tensorflow():
    proc = run_python(
        """
        import sys
        from tfdist.cli import main
        try:
            main(["--help"])
        except SystemExit as e:
            assert e.code == 0
        print("TF" if "tensorflow" in sys.modules else "NO-TF")
        """
    )
    assert proc.stdout.strip().endswith("NO-TF")
    assert "info" in proc.stdout


@pytest.mark.devices
def test_cli_info_json_reports_devices_strategy_and_cluster():
    proc = run_python(
        "import sys; from tfdist.cli import main; sys.exit(main(['info', '--json']))",
        TFDIST_CPU_DEVICES="2",
        TFDS_DATA_DIR="/data/tfds",
    )
    report = json.loads(proc.stdout)
    assert report["strategy"] == {
        "kind": "mirrored",
        "num_replicas": 2,
        "devices": ["/device:CPU:0", "/device:CPU:1"],
        "num_workers": 1,
    }
    assert report["cluster"]["source"] == "none" and report["cluster"]["is_chief"]
    assert report["TFDS_DATA_DIR"] == "/data/tfds"
    assert report["versions"]["tfdist"] == tfdist.__version__


@pytest.mark.devices
def test_cli_info_with_tf_config_plans_multi_worker_without_waiting_for_peers():
    from tfdist.cluster import worker_tf_config

    proc = run_python(
        "import sys; from tfdist.cli import main; sys.exit(main(['info']))",
        TF_CONFIG=worker_tf_config(["127.0.0.1:1", "127.0.0.1:2"], 1),
        timeout=120,
    )
    assert "multi_worker" in proc.stdout and "replicas=2" in proc.stdout
    assert "worker:1" in proc.stdout and "(chief)" not in proc.stdout


def test_cli_reports_bad_environment_as_one_line(capsys, monkeypatch):
    from tfdist.cli import main

    monkeypatch.setenv("TF_CONFIG", "{broken")
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tfdist info: error: TF_CONFIG") and "Traceback" not in err


def test_python_dash_m_tfdist_works():
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "tfdist", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"tfdist {tfdist.__version__}"


def test_a_keras_distribution_on_the_tensorflow_backend_is_warned_about():
    import keras

    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=["cpu:0"]))
    try:
        with pytest.warns(UserWarning, match="has no effect on the TensorFlow backend"):
            with tfdist.scope():
                pass
    finally:
        keras.distribution.set_distribution(None)
