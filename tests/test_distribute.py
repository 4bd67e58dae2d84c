import json
import subprocess
import sys

import numpy as np
import pytest

import tfdist
from tfdist.backends import tensorflow as strategy_mod
from tfdist.core import config

from conftest import REPO, SCRIPTS, child_env, equivalence, last_json_line, run_python


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


def test_a_jax_trainjob_on_tensorflow_says_it_needs_every_address():
    env = {"JAX_COORDINATOR_ADDRESS": "job-node-0-0.job:6666", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "0"}  # fmt: skip
    with pytest.raises(ValueError, match=r"coordinator only.*Received: JAX_COORDINATOR_ADDR.*"
                       r"KERAS_BACKEND=jax, or as a TFJob"):  # fmt: skip
        strategy_mod.plan("auto", environ=env)


def test_bad_cpu_devices_env_is_named():
    with pytest.raises(config.ConfigError, match="TFDIST_CPU_DEVICES"):
        config.cpu_devices(environ={"TFDIST_CPU_DEVICES": "0"})
    with pytest.raises(config.ConfigError, match="TFDIST_CPU_DEVICES.*'two'"):
        config.cpu_devices(environ={"TFDIST_CPU_DEVICES": "two"})


def test_plan_reads_cluster_without_starting_a_server():
    from tfdist.core.cluster import worker_tf_config

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


def run_fit(devices: int, **env) -> dict:
    """fit_equivalence.py (a global batch of 32, 2 epochs) on ``devices`` logical devices."""
    proc = run_python(
        f"import runpy, sys; sys.argv=['x', '--global-batch', '32', '--epochs', '2'];"
        f" runpy.run_path({str(SCRIPTS / 'fit_equivalence.py')!r}, run_name='__main__')",
        TFDIST_CPU_DEVICES=str(devices),
        **env,
    )
    return last_json_line(proc.stdout)


def check_fit_topology(result: dict, devices: int) -> None:
    """The process ran on ``devices`` replicas, and so did its model: one device without
    MirroredStrategy, more with it and the model's variables mirrored."""
    topology = (result["replicas"], result["strategy"], result["variable_type"])
    assert result["replicas"] == devices, topology
    if devices == 1:
        assert result["strategy"] != "MirroredStrategy", topology
    else:
        assert topology[1:] == ("MirroredStrategy", "MirroredVariable"), topology


def check_fit_weights(reference: dict, result: dict, devices: int) -> None:
    equivalence.assert_close(reference["weights"], result["weights"], 1e-5, f"{devices}")


@pytest.mark.devices
@pytest.mark.slow
def test_fit_gives_the_same_weights_on_1_2_and_4_logical_devices():
    results = {n: run_fit(n) for n in (1, 2, 4)}
    for n in (1, 2, 4):
        check_fit_topology(results[n], n)
    # training happened: the loss fell
    assert results[1]["loss"][-1] < results[1]["loss"][0]
    for n in (2, 4):
        check_fit_weights(results[1], results[n], n)


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
        """,
        warm=False,  # what a fresh process imports is what is tested
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
    from tfdist.core.cluster import worker_tf_config

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

    try:
        data_parallel = keras.distribution.DataParallel(devices=["cpu:0"])
    except AttributeError as err:  # Keras < 3.12 cannot even build one on TensorFlow
        pytest.skip(f"keras {keras.__version__} refuses DataParallel on TensorFlow: {err}")
    keras.distribution.set_distribution(data_parallel)
    try:
        with pytest.warns(UserWarning, match="has no effect on the TensorFlow backend"):
            with tfdist.scope():
                pass
    finally:
        keras.distribution.set_distribution(None)


# --- communication options: TFDIST_ALLREDUCE / TFDIST_BYTES_PER_PACK / Communication(...) ---


def test_communication_defaults_leave_tensorflow_to_decide():
    comm = config.Communication.from_env({})
    assert (comm.implementation, comm.bytes_per_pack, comm.is_default) == ("auto", 0, True)


def test_communication_environment_is_read_and_checked():
    env = {"TFDIST_ALLREDUCE": "RING", "TFDIST_BYTES_PER_PACK": "65536"}
    assert config.Communication.from_env(env) == config.Communication("ring", 65536)
    with pytest.raises(config.ConfigError, match=r"TFDIST_ALLREDUCE must be one of .*'gloo'"):
        config.Communication.from_env({"TFDIST_ALLREDUCE": "gloo"})
    with pytest.raises(config.ConfigError, match=r"TFDIST_BYTES_PER_PACK.*Received.*'-1'"):
        config.Communication.from_env({"TFDIST_BYTES_PER_PACK": "-1"})


def test_communication_arguments_follow_the_validation_rule():
    with pytest.raises(
        ValueError, match=r"implementation must be one of .*Received: implementation='x'"
    ):
        config.Communication("x")
    with pytest.raises(TypeError, match=r"bytes_per_pack must be a non-negative int"):
        config.Communication(bytes_per_pack=1.5)
    with pytest.raises(TypeError, match=r"communication must be a tfdist.config.Communication"):
        strategy_mod.plan("default", communication="ring")


def test_communication_argument_wins_over_environment_in_the_plan():
    from tfdist.core.cluster import worker_tf_config

    env = {
        "TF_CONFIG": worker_tf_config(["127.0.0.1:1", "127.0.0.1:2"], 0),
        "TFDIST_BYTES_PER_PACK": "1024",
    }
    assert strategy_mod.plan("auto", environ=env).communication.bytes_per_pack == 1024
    chosen = config.Communication("ring", 4096)
    assert strategy_mod.plan("auto", communication=chosen, environ=env).communication == chosen


def test_multi_worker_refuses_a_mirrored_only_implementation():
    from tfdist.core.cluster import worker_tf_config

    env = {
        "TF_CONFIG": worker_tf_config(["127.0.0.1:1", "127.0.0.1:2"], 0),
        "TFDIST_ALLREDUCE": "reduce_to_one",
    }
    with pytest.raises(config.ConfigError, match="MultiWorkerMirroredStrategy takes 'auto'"):
        strategy_mod.plan("auto", environ=env)


def test_mirrored_cross_device_ops_follow_the_implementation():
    import tensorflow as tf

    def ops(impl, devices=("/device:CPU:0", "/device:CPU:1")):
        p = strategy_mod.StrategyPlan("mirrored", devices, communication=config.Communication(impl))
        return strategy_mod._mirrored_cross_device_ops(p)

    assert ops("auto") is None and ops("ring") is None  # TensorFlow's ring on CPUs
    assert isinstance(ops("reduce_to_one"), tf.distribute.ReductionToOneDevice)
    assert isinstance(ops("nccl", ("/device:GPU:0", "/device:GPU:1")), tf.distribute.NcclAllReduce)
    with pytest.raises(config.ConfigError, match="nccl and hierarchical_copy need GPUs"):
        ops("nccl")


@pytest.mark.multiworker
@pytest.mark.slow
def test_packing_and_ring_do_not_change_the_trained_weights():
    """1 device = 2 workers = 2 workers with 64 KiB packs on a ring, within 1e-5."""
    job = [str(SCRIPTS / "mw_bench_job.py"), "--steps", "12", "--warmup", "2", "--weights"]
    launch = [sys.executable, "-m", "tfdist", "launch", "-n", "2"]
    runs = {
        "one": [sys.executable, *job],
        "workers": [*launch, *job],
        "packed": [*launch, *job, "--bytes-per-pack", "65536", "--implementation", "ring"],
    }
    results = {}
    for name, cmd in runs.items():
        proc = subprocess.run(
            cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[name] = last_json_line(proc.stdout.replace("[w0] ", ""))
    assert [results[n]["replicas"] for n in runs] == [1, 2, 2]
    assert results["packed"]["communication"] == ["ring", 65536]
    assert results["workers"]["communication"] == ["auto", 0]
    for name in ("workers", "packed"):
        equivalence.assert_close(results["one"]["weights"], results[name]["weights"], 1e-5, name)
