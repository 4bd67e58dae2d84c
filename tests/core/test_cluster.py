import json

import pytest

from tfdist.core.cluster import (
    ClusterInfo,
    cluster_from_env,
    parse_tf_config,
    worker_tf_config,
)
from tfdist.core.roles import is_chief

TWO = ["127.0.0.1:2222", "127.0.0.1:2223"]


def test_no_cluster_is_single_chief():
    info = cluster_from_env({})
    assert info == ClusterInfo()
    assert info.is_chief and not info.is_multi_worker and info.num_workers == 1


def test_worker_tf_config_round_trips_for_each_worker():
    infos = [parse_tf_config(worker_tf_config(TWO, i)) for i in range(2)]
    assert [i.task_index for i in infos] == [0, 1]
    assert [i.is_chief for i in infos] == [True, False]
    assert all(i.num_workers == 2 and i.is_multi_worker for i in infos)
    assert infos[1].cluster == {"worker": tuple(TWO)}


def test_chief_job_makes_workers_non_chief_and_counts_as_training_task():
    cfg = {
        "cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"]},
        "task": {"type": "worker", "index": 0},
    }
    info = parse_tf_config(json.dumps(cfg))
    assert not info.is_chief and info.num_workers == 3 and info.rank == 1
    cfg["task"] = {"type": "chief", "index": 0}
    assert parse_tf_config(cfg).is_chief


def test_evaluator_is_not_a_training_task_nor_chief():
    cfg = {
        "cluster": {"worker": ["h:1"], "evaluator": ["h:9"]},
        "task": {"type": "evaluator", "index": 0},
    }
    info = parse_tf_config(cfg)
    assert info.num_workers == 1 and not info.is_chief


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"cluster": {"worker": "h:1"}, "task": {"type": "worker", "index": 0}}', "at least one"),
        (
            '{"cluster": {"worker": ["nohostport"]}, "task": {"type": "worker", "index": 0}}',
            "host:port",
        ),
        ('{"cluster": {"wrkr": ["h:1"]}, "task": {"type": "wrkr", "index": 0}}', "unknown job"),
        ('{"cluster": {"worker": ["h:1"]}, "task": {"type": "chief", "index": 0}}', "task.type"),
        (
            '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 1}}',
            "out of range",
        ),
        (
            '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": "0"}}',
            "must be an int",
        ),
    ],
)
def test_bad_tf_config_is_named_and_echoed(value, fragment):
    with pytest.raises(ValueError, match="TF_CONFIG") as err:
        parse_tf_config(value)
    assert fragment in str(err.value)
    assert "Received: TF_CONFIG=" in str(err.value)


def test_empty_tf_config_means_no_cluster():
    assert cluster_from_env({"TF_CONFIG": "  "}).source == "none"
    assert parse_tf_config("{}").source == "none"


def test_slurm_step_with_several_tasks_is_a_cluster():
    info = cluster_from_env({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"})
    assert (info.source, info.num_workers, info.task_index, info.is_chief) == ("SLURM", 4, 2, False)
    assert cluster_from_env({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0"}).is_chief
    # a batch script running one process is not a cluster
    assert cluster_from_env({"SLURM_NTASKS": "4"}).source == "none"
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        cluster_from_env({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "x"})


def test_tf_config_wins_over_slurm():
    env = {"TF_CONFIG": worker_tf_config(TWO, 1), "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0"}
    assert cluster_from_env(env).source == "TF_CONFIG"
    assert not is_chief(env)


@pytest.mark.parametrize(
    "addresses, index", [([], 0), ("h:1", 0), (TWO, 2), (TWO, -1), (TWO, True)]
)
def test_worker_tf_config_rejects_bad_input(addresses, index):
    with pytest.raises(ValueError, match="worker_tf_config"):
        worker_tf_config(addresses, index)


# What Kubeflow Trainer's JAX runtime gives pod 1 of a 2-node TrainJob (tests/e2e/k8s_pods.py).
TRAINJOB_POD_1 = {
    "JAX_COORDINATOR_ADDRESS": "job-node-0-0.job:6666",
    "JAX_NUM_PROCESSES": "2",
    "JAX_PROCESS_ID": "1",
    "JOB_COMPLETION_INDEX": "1",
}


def test_jax_coordinator_variables_of_a_trainjob_are_a_cluster():
    info = cluster_from_env(TRAINJOB_POD_1)
    assert (info.source, info.num_workers, info.rank, info.is_chief) == (
        "JAX_COORDINATOR", 2, 1, False
    )  # fmt: skip
    assert info.addresses == ("job-node-0-0.job:6666",)  # jax's coordinator
    # the Indexed Job's completion index stands in for a missing JAX_PROCESS_ID
    env = {**TRAINJOB_POD_1, "JAX_PROCESS_ID": "", "JOB_COMPLETION_INDEX": "0"}
    assert cluster_from_env(env).is_chief
    # one process is not a cluster; TF_CONFIG and Keras's variables win
    assert cluster_from_env({**TRAINJOB_POD_1, "JAX_NUM_PROCESSES": "1"}).source == "none"
    env = {**TRAINJOB_POD_1, "TF_CONFIG": worker_tf_config(TWO, 0)}
    assert cluster_from_env(env).source == "TF_CONFIG"


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"JAX_NUM_PROCESSES": "two"}, r"JAX_NUM_PROCESSES must be an integer\. Received: "),
        ({"JAX_COORDINATOR_ADDRESS": "nohost"}, r"must be the coordinator's host:port"),
        ({"JAX_COORDINATOR_ADDRESS": ""}, r"JAX_COORDINATOR_ADDRESS=''"),
        ({"JAX_PROCESS_ID": "2"}, r"JAX_PROCESS_ID must be in \[0, JAX_NUM_PROCESSES\)"),
        ({"JAX_PROCESS_ID": "", "JOB_COMPLETION_INDEX": ""}, r"JAX_PROCESS_ID \(or JOB_COMP"),
        ({"JAX_PROCESS_ID": "x"}, r"JAX_PROCESS_ID must be an integer.*TrainJob"),
    ],
)
def test_bad_jax_coordinator_variables_are_named_and_echoed(change, fragment):
    with pytest.raises(ValueError, match=fragment):
        cluster_from_env({**TRAINJOB_POD_1, **change})
