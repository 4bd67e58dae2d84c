"""tfdist in Kubernetes pods as the Kubeflow operators start them, on this machine.

The manifests are the ones docs/kubernetes.md shows (docs/k8s/*.yaml, each shown there
verbatim): from them tests/e2e/k8s_pods.py builds each pod's environment as the operator
would (a TFJob's ``TF_CONFIG`` with service DNS names; a TrainJob's ``JAX_*`` variables
and ``JOB_COMPLETION_INDEX``), and runs each pod in its own network, UTS and mount
namespaces (its host name, its /etc/hosts with the job's DNS names). Each job runs
tests/scripts/slurm_train.py and ends with the weights of one process. Then a worker
gets SIGTERM (every worker saves after one agreed step and exits 75) and, in the
restarted job, ``kill -9`` (the other worker's collectives abort when it comes back);
kubelet restarts the pods each time (``restartPolicy: OnFailure``, with its back-off,
shortened tenfold), and the job resumes from its checkpoints to the weights of an
uninterrupted run. A JAX pod killed with ``kill -9`` fails its Job, and JobSet creates
all the pods again (``failurePolicy.maxRestarts``), which resume to the same weights.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import k8s_pods
import pytest
import yaml

from tfdist.core import config

from conftest import REPO, SCRIPTS, child_env, equivalence, warm_start

TRAIN = SCRIPTS / "slurm_train.py"
DOCS = REPO / "docs" / "kubernetes.md"
MANIFESTS = REPO / "docs" / "k8s"
TOLERANCE = 1e-5

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]


def manifest(name: str, kind: str) -> dict:
    """The ``kind`` document of docs/k8s/``name``, which docs/kubernetes.md shows verbatim."""
    text = (MANIFESTS / name).read_text()
    assert text.strip() in DOCS.read_text(), f"docs/kubernetes.md does not show docs/k8s/{name}"
    found = [doc for doc in yaml.safe_load_all(text) if doc and doc.get("kind") == kind]
    assert len(found) == 1, f"docs/k8s/{name}: no one {kind} document"
    return found[0]


def host_env() -> dict[str, str]:
    """What a pod's image provides besides the operator's variables: this venv's python
    on PATH, and the datasets."""
    env = {"PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin:/bin"])}
    env["PATH"] += ":/usr/sbin:/sbin"  # hostname, mount
    if os.environ.get("TFDS_DATA_DIR"):
        env["TFDS_DATA_DIR"] = os.environ["TFDS_DATA_DIR"]
    return env


def in_pods(pods: list[k8s_pods.Pod], ckpt: Path, *args: str) -> None:
    """The containers' commands with this machine's paths: the image's python and
    /app/train.py, the shared volume at /ckpt; ``args`` appended (the container's args)."""
    paths = {"python": sys.executable, "/app/train.py": str(TRAIN), "/ckpt": str(ckpt)}
    for pod in pods:
        pod.command = [paths.get(word, word) for word in pod.command] + list(args)


def one_process(workdir: Path, backend: str) -> dict:
    """The reference: slurm_train.py alone, outside any pod (forked from the warm
    interpreter, tests/warm_start.py)."""
    proc = warm_start.run(
        [str(TRAIN), "--dir", str(workdir / "ckpt"), "--results", str(workdir)],
        env=child_env(KERAS_BACKEND=backend), base_env=child_env(), cwd=workdir, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((workdir / "0-0.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(backend)``: one process, uninterrupted (computed once per backend)."""
    cache = {}

    def get(backend: str) -> dict:
        if backend not in cache:
            cache[backend] = one_process(tmp_path_factory.mktemp(f"ref-{backend}"), backend)
            assert (cache[backend]["replicas"], cache[backend]["iterations"]) == (1, 64)
        return cache[backend]

    return get


@pytest.fixture
def root_and_ip():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.fail(
            "the Kubernetes pod tests need root and iproute2 and util-linux (ip netns, "
            f"unshare); euid={os.geteuid()}, ip={shutil.which('ip')}, "
            f"unshare={shutil.which('unshare')}. CI runs them as root."
        )


def last_results(directory: Path) -> dict[int, dict]:
    """slurm_train.py's ``--results`` files: each rank's last (highest attempt)."""
    found: dict[int, tuple[int, dict]] = {}
    for path in directory.glob("*.json"):
        attempt, rank = (int(n) for n in path.stem.split("-"))
        if rank not in found or attempt > found[rank][0]:
            found[rank] = (attempt, json.loads(path.read_text()))
    return {rank: result for rank, (_, result) in found.items()}


def check_dns(cluster: k8s_pods.Cluster) -> None:
    """Inside every pod: its host name, and every job DNS name resolves to its pod."""
    names = {name: p.address for p in cluster.pods for name in p.dns_names}
    code = (
        "import json, socket, sys; print(json.dumps([socket.gethostname(), "
        "{n: socket.gethostbyname(n) for n in sys.argv[1:]}]))"
    )
    for pod in cluster.pods:
        proc = cluster.exec(pod, [sys.executable, "-c", code, *names])
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == [pod.hostname, names], proc.stdout


def engine_in(cluster: k8s_pods.Cluster, pod: k8s_pods.Pod) -> dict:
    """What ``tfdist info`` reports as the engine (``tfdist.core.engines``), read in ``pod``."""
    code = "import json; from tfdist.core import engines; print(json.dumps(engines.detect().summary()))"
    proc = cluster.exec(pod, [sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def run_job(pods, tmp_path, backoff_limit, *args: str, before=None, timeout: float = 300):
    """Starts the pods, waits until all succeeded; returns the cluster's pods and results.
    ``backoff_limit``: training-operator's (an int or None), or a TrainJob's
    ``k8s_pods.JobSetPolicy``. ``before(cluster)`` runs once the pods' namespaces exist,
    before they start."""
    in_pods(pods, tmp_path / "ckpt", "--results", str(tmp_path / "results"), *args)
    with k8s_pods.running(pods, host_env(), tmp_path) as cluster:
        check_dns(cluster)
        if before is not None:
            before(cluster)
        cluster.start_all()
        if isinstance(backoff_limit, k8s_pods.JobSetPolicy):
            codes = cluster.wait_jobset(backoff_limit, timeout)
        else:
            codes = cluster.wait_done(timeout, backoff_limit)
    assert set(codes.values()) == {0}, cluster.log_tails()
    return cluster, last_results(tmp_path / "results")


TWO_WORKERS = [{"replicas": 2, "workers": 2}]  # what the model of a 2-pod job trains on


def check_result(result: dict, alone: dict) -> None:
    """One pod's result of a job that trained to its end: the process was one of 2
    workers, its model's own ``fit`` ran on both (``trained_on``), every step, to the
    weights of one process (``alone``)."""
    assert (result["backend"], result["workers"], result["replicas"]) == (
        alone["backend"], 2, 2,
    )  # fmt: skip
    trained = result["trained_on"]
    assert trained == TWO_WORKERS, f"worker {result['rank']}: its model trained on {trained}"
    assert result["iterations"] == 64
    equivalence.assert_close(alone["weights"], result["weights"], TOLERANCE)


def assert_like_one_process(cluster: k8s_pods.Cluster, found: dict, alone: dict) -> None:
    """Both pods trained every step as 2 workers (processes), to ``alone``'s weights,
    and none was restarted."""
    assert sorted(found) == [0, 1], cluster.log_tails()
    for result in found.values():
        check_result(result, alone)
    assert [p.restarts for p in cluster.pods] == [0, 0], cluster.log_tails()


def test_tfjob_pods_train_like_one_process(root_and_ip, reference, tmp_path):
    tfjob = manifest("tfjob.yaml", "TFJob")
    pods = k8s_pods.tfjob_pods(tfjob)
    assert [p.name for p in pods] == ["mnist-worker-0", "mnist-worker-1"]
    config = json.loads(pods[1].env["TF_CONFIG"])
    assert config["cluster"]["worker"] == [
        "mnist-worker-0.default.svc:2222",
        "mnist-worker-1.default.svc:2222",
    ]
    assert (config["task"], pods[1].restart_policy) == ({"type": "worker", "index": 1}, "OnFailure")
    engines = []
    limit = tfjob["spec"]["runPolicy"]["backoffLimit"]
    cluster, found = run_job(pods, tmp_path, limit, before=lambda c: engines.append(
        engine_in(c, pods[1])))  # fmt: skip
    assert (engines[0]["name"], engines[0]["read"]["HOSTNAME"]) == ("tfjob", "mnist-worker-1")
    assert engines[0]["read"]["TF_CONFIG"]["task"] == "worker:1"
    assert_like_one_process(cluster, found, reference("tensorflow"))


@pytest.mark.jax
def test_trainjob_pods_on_jax_train_like_one_process(root_and_ip, reference, tmp_path):
    trainjob = manifest("trainjob-jax.yaml", "TrainJob")
    runtime = manifest("trainjob-jax.yaml", "TrainingRuntime")
    pods = k8s_pods.trainjob_pods(trainjob, runtime=runtime)
    assert [p.name for p in pods] == ["mnist-jax-node-0-0", "mnist-jax-node-0-1"]
    assert "TF_CONFIG" not in pods[1].env and pods[1].env["KERAS_BACKEND"] == "jax"
    engines = []
    policy = k8s_pods.jobset_policy(runtime)
    cluster, found = run_job(pods, tmp_path, policy, before=lambda c: engines.append(
        engine_in(c, pods[1])))  # fmt: skip
    read = engines[0]["read"]
    assert (engines[0]["name"], read["JAX_PROCESS_ID"], read["HOSTNAME"]) == (
        "trainjob", "1", "mnist-jax-node-0-1",
    )  # fmt: skip
    assert_like_one_process(cluster, found, reference("jax"))
    assert [p.labels[k8s_pods.RESTART_ATTEMPT] for p in pods] == ["0", "0"]  # no JobSet restart
    # tfdist gave jax every parameter: jax's own Kubernetes detection never ran
    assert "Kubernetes environment detected" not in cluster.log_tails(100_000)


# Each fault slurm_train.py honours (tests/scripts/faults.py), and what check_result says.
FAULTS = {
    "nan": "non-finite",
    "outside_distribution": r"worker \d: its model trained on \[\{'replicas': 1, 'workers': 1\}\]",
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_in_the_tfjob_fails_that_tests_check_in_every_pod(
    root_and_ip, reference, fault, tmp_path
):
    """The tests of the tests (tests/e2e/test_checks_catch_faults.py) for Kubernetes: the
    TFJob test_tfjob_pods_train_like_one_process runs, with a fault in both pods'
    environment, fails its ``check_result`` in each pod. The checks run in order, so a
    NaN's failure shows the topology passed; a model outside the scope trains on each
    worker alone, which the process's own report (2 workers, 2 replicas) does not show."""
    tfjob = manifest("tfjob.yaml", "TFJob")
    pods = k8s_pods.tfjob_pods(tfjob)
    for pod in pods:
        pod.env["TFDIST_TEST_FAULT"] = fault
        if fault == "outside_distribution":
            # A model built outside any scope trains on the job by default
            # (TFDIST_UNSCOPED_MODELS=job); upstream's one replica per worker is the fault.
            pod.env["TFDIST_UNSCOPED_MODELS"] = "local"
    cluster, found = run_job(pods, tmp_path, tfjob["spec"]["runPolicy"]["backoffLimit"])
    assert sorted(found) == [0, 1] and [p.restarts for p in pods] == [0, 0], cluster.log_tails()
    for result in found.values():
        with pytest.raises(AssertionError, match=FAULTS[fault]):
            check_result(result, reference("tensorflow"))


def first_steps(text: str) -> list[dict]:
    """slurm_train.py's ``--report-first-step`` lines (complete lines only)."""
    return [
        json.loads(line)["first_step"]
        for line in text.splitlines(keepends=True)
        if line.endswith("\n") and line.startswith('{"first_step"')
    ]


def _wait(probe, timeout: float, what: str, cluster: k8s_pods.Cluster):
    """Polls ``probe()`` until it is true; fails naming ``what`` with the pods' logs."""
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s{cluster.log_tails()}"
        time.sleep(0.1)


def _epoch_checkpoints(ckpt: Path, since: float) -> list[Path]:
    return [p for p in ckpt.glob("ckpt-*.keras") if p.stat().st_mtime > since]


def _preempt_then_kill(cluster: k8s_pods.Cluster, ckpt: Path, limit: int) -> dict[str, int]:
    """SIGTERM to worker 1 early in the first epoch; once the restarted job wrote an epoch
    checkpoint, ``kill -9`` of worker 1; then waits for the job's end."""
    pods = cluster.pods
    _wait(lambda: all(first_steps(cluster.log(p.name)) for p in pods), 240, "first steps", cluster)
    time.sleep(1.0)
    cluster.signal("mnist-worker-1", signal.SIGTERM)  # a preempted or evicted pod's container
    _wait(lambda: all(len(p.exit_codes) >= 1 and p.proc.poll() is None and p.restarts >= 1
                      for p in pods), 120, "restart after the preemption", cluster)  # fmt: skip
    restarted = time.time()
    _wait(lambda: _epoch_checkpoints(ckpt, restarted), 240, "epoch checkpoint", cluster)
    cluster.signal("mnist-worker-1", signal.SIGKILL)  # an OOM kill, a crash
    return cluster.wait_done(300, limit)


def test_tfjob_preempted_then_killed_9_restarts_onfailure_and_resumes_exactly(
    root_and_ip, reference, tmp_path
):
    """Worker 1 gets SIGTERM (both save after one agreed step and exit 75), then, in the
    restarted job, ``kill -9``; kubelet restarts the pods (``OnFailure``) each time."""
    tfjob = manifest("tfjob.yaml", "TFJob")
    pods = k8s_pods.tfjob_pods(tfjob)
    ckpt, results = tmp_path / "ckpt", tmp_path / "results"
    in_pods(pods, ckpt, "--results", str(results), "--step-sleep", "0.15", "--report-first-step")
    start = time.monotonic()
    # kubelet's back-off, a tenth (1 s, then 2 s): the claim is the restarts and the resume,
    # not kubelet's wait before each (20 s of the job's time at its own scale)
    with k8s_pods.running(pods, host_env(), tmp_path, backoff_scale=0.1) as cluster:
        cluster.start_all()
        codes = _preempt_then_kill(cluster, ckpt, tfjob["spec"]["runPolicy"]["backoffLimit"])
    took = time.monotonic() - start
    exits = [(p.name, p.exit_codes) for p in pods]
    assert set(codes.values()) == {0}, cluster.log_tails()
    # kubelet restarted both pods after each failure: the killed one, and the one that lost it
    assert pods[1].exit_codes == [75, -9, 0] and pods[0].exit_codes[0] == 75, exits
    assert pods[0].exit_codes[1] not in (0, 75) and pods[0].exit_codes[-1] == 0, exits
    preempted = [json.loads((results / f"0-{rank}.json").read_text()) for rank in (0, 1)]
    step = preempted[0]["iterations"]
    assert [r["exit_code"] for r in preempted] == [75, 75] and 0 < step < 64, preempted
    assert preempted[1]["iterations"] == step  # both saved after the same step
    final = last_results(results)
    assert sorted(final) == [0, 1], cluster.log_tails()
    restored = {r["restored_step"] for r in final.values()}
    assert len(restored) == 1 and step < min(restored) < 64, (step, restored)  # an epoch's
    for result in final.values():
        assert result["exit_code"] == 0
        check_result(result, reference("tensorflow"))  # 2 workers, 64 steps, its weights
    print(
        f"\nkubernetes: preempted after step {step}, killed after the checkpoint of step "
        f"{min(restored)}; exits {exits}; the job took {took:.1f} s"
    )


# jax's line when its coordination service declared a process dead (it then aborts).
JAX_ABORT = "Terminating process because the JAX distributed service detected fatal errors"


@pytest.mark.jax
def test_trainjob_pod_killed_9_jobset_restarts_all_pods_and_resumes_exactly(
    root_and_ip, reference, tmp_path
):
    """Once an epoch checkpoint exists, ``kill -9`` of JAX pod 1: its Job fails
    (``backoffLimit: 0``), the other pod is deleted (it ends within its grace period), and
    JobSet creates both pods again (``failurePolicy.maxRestarts``), which resume exactly."""
    runtime = manifest("trainjob-jax.yaml", "TrainingRuntime")
    trainjob = manifest("trainjob-jax.yaml", "TrainJob")
    assert trainjob["spec"]["runtimeRef"] == {"name": "jax-restartable", "kind": "TrainingRuntime"}
    policy = k8s_pods.jobset_policy(runtime)
    assert policy == k8s_pods.JobSetPolicy(max_restarts=3, backoff_limit=0, restart_policy="Never")
    pods = k8s_pods.trainjob_pods(trainjob, runtime=runtime)
    ckpt, results = tmp_path / "ckpt", tmp_path / "results"
    in_pods(pods, ckpt, "--results", str(results), "--step-sleep", "0.1")
    start = time.monotonic()
    with k8s_pods.running(pods, host_env(), tmp_path) as cluster:
        cluster.start_all()
        since = time.time()
        _wait(lambda: _epoch_checkpoints(ckpt, since), 240, "epoch checkpoint", cluster)
        cluster.signal("mnist-jax-node-0-1", signal.SIGKILL)  # an OOM kill, a crash
        killed = time.monotonic()
        codes = cluster.wait_jobset(policy, 300)
    took = time.monotonic() - start
    exits = [(p.name, p.exit_codes) for p in pods]
    assert set(codes.values()) == {0}, cluster.log_tails()
    # new pods for both (no container restarts), in JobSet's first restart
    assert [(p.restarts, p.labels[k8s_pods.RESTART_ATTEMPT]) for p in pods] == [(0, "1")] * 2
    assert pods[1].exit_codes == [-signal.SIGKILL, 0], exits
    # pod 0, deleted with the failed Job (SIGTERM), ended itself within its grace period,
    # naming process 1. Where the kill found it decides how: in a collective, tfdist's
    # watchdog ends it (exit 69, "lost process 1"); waiting in the coordination service
    # (a checkpoint's barrier), jax's own service declares process 1 dead after the
    # heartbeat timeout and aborts it (SIGABRT), as tfdist.core.watchdog says.
    survivor_s = pods[0].exit_times[0] - killed
    first_run = cluster.log(pods[0].name).split("attempt 1\n")[0]
    ended = pods[0].exit_codes[0]
    if ended == -signal.SIGABRT:
        assert JAX_ABORT in first_run, f"{exits}\n{first_run[-3000:]}"
        assert "stopped sending heartbeats):\n1\n" in first_run, first_run[-3000:]
    else:
        assert ended == config.WATCHDOG_EXIT_CODE, f"{exits}\n{first_run[-3000:]}"
        assert "lost process 1 (" in first_run, first_run[-3000:]
    assert survivor_s < k8s_pods.TERMINATION_GRACE_S, survivor_s
    final = last_results(results)
    assert sorted(final) == [0, 1], cluster.log_tails()
    restored = {r["restored_step"] for r in final.values()}
    assert len(restored) == 1 and 0 < min(restored) < 64, restored  # an epoch's
    for result in final.values():
        assert result["exit_code"] == 0
        check_result(result, reference("jax"))  # jax, 2 workers, 64 steps, its weights
    print(
        f"\nkubernetes: pod 1 killed after the checkpoint of step {min(restored)}; pod 0 "
        f"ended {survivor_s:.1f} s later; exits {exits}; the job took {took:.1f} s"
    )
