"""tfdist under SLURM: the step's parsing (fast, no scheduler), then a real scheduler.

The ``slurm`` fixture starts a one-node SLURM cluster on this machine (slurmctld, slurmd,
munged: tests/e2e/slurm_cluster.py) for the tests marked ``slurm``. They run what the SLURM
section of docs/slurm.md tells users to run, the batch script and the per-node
recipe read from that page, and compare every result with one process running the same
script: ``srun -n 2`` on TensorFlow and on JAX, a job preempted with
``scancel --signal=TERM`` that requeues itself and resumes, and a task killed with
``kill -9``. Where SLURM cannot start, those tests fail and say why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import slurm_cluster

from tfdist import startup
from tfdist.core import cluster, config, process

from conftest import REPO, SCRIPTS, child_env, equivalence, warm_start

TRAIN = SCRIPTS / "slurm_train.py"
DOCS = REPO / "docs" / "slurm.md"
TOLERANCE = 1e-5
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

# ------------------------------------------------------------------ the step's coordinator


def test_hostlists_expand_as_slurm_writes_them():
    assert cluster.expand_hostlist("vm") == ["vm"]
    hosts = ["node07", "node08", "node09", "node11", "gpu1"]
    assert cluster.expand_hostlist("node[07-09,11],gpu1") == hosts
    assert cluster.expand_hostlist("r[1-2]n[1,3]") == ["r1n1", "r1n3", "r2n1", "r2n3"]
    assert cluster.expand_hostlist("") == []
    for bad in ("node[1-", "node1]", "node[a-b]", "node[3-1]"):
        with pytest.raises(ValueError, match=r"SLURM host list: .*Received: "):
            cluster.expand_hostlist(bad)


def test_slurm_coordinator_is_task_0_on_the_first_node_at_the_tf_port():
    env = {"SLURM_STEP_NODELIST": "node[07-08]", "SLURM_JOB_ID": "40123"}
    assert cluster.slurm_coordinator(env) == "node07:27872"  # 20000 + 40123 % 625 * 64
    assert config.slurm_port_base(env) == 27872  # the port TensorFlow gives task 0
    assert cluster.slurm_coordinator({"SLURM_JOB_NODELIST": "a,b"}) == "a:20000"
    env = {"SLURM_NODELIST": "c1", "TFDIST_SLURM_PORT_BASE": "31000"}
    assert cluster.slurm_coordinator(env) == "c1:31000"
    with pytest.raises(ValueError, match=r"needs its node list .*SLURM_STEP_NODELIST=None"):
        cluster.slurm_coordinator({"SLURM_STEP_NUM_TASKS": "2"})


class _FakeJax:
    """Records what ``jax.distributed.initialize`` is called with."""

    def __init__(self):
        self.calls = []
        self.distributed = self

    def initialize(self, **kwargs):
        self.calls.append(kwargs)


@pytest.fixture
def fresh_process_state():
    process.reset()
    yield
    process.reset()


def test_jax_in_a_slurm_step_joins_task_0_not_index_error(monkeypatch, fresh_process_state):
    """The bug: ``srun -n 2`` under KERAS_BACKEND=jax died in ``import jax`` (IndexError)."""
    step = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_ID": "77"}
    for key, value in {**step, "SLURM_STEP_NODELIST": "node[3-4]"}.items():
        monkeypatch.setenv(key, value)
    info = cluster.cluster_from_env()
    assert (info.source, info.addresses) == ("SLURM", ())  # srun gives no addresses
    jax = _FakeJax()
    startup._initialize_jax_processes(jax, info)
    assert jax.calls[0]["coordinator_address"] == "node3:24928"  # 20000 + 77 % 625 * 64
    assert (jax.calls[0]["num_processes"], jax.calls[0]["process_id"]) == (2, 1)
    assert process.state().jax_initialized

    monkeypatch.delenv("SLURM_STEP_NODELIST")
    with pytest.raises(ValueError, match=r"needs its node list .* Start the tasks with `srun`"):
        startup._initialize_jax_processes(_FakeJax(), info)
    lone = cluster.ClusterInfo("TF_CONFIG", {}, "worker", 0, 2)  # no address at all
    with pytest.raises(ValueError, match=r"no coordinator address .*Received: cluster=\{\}"):
        startup._initialize_jax_processes(_FakeJax(), lone)


# ------------------------------------------------------------------ the real scheduler


@pytest.fixture(scope="module")
def slurm_daemons():
    try:
        running = slurm_cluster.start(timeout=90)
    except (slurm_cluster.SlurmUnavailable, OSError, subprocess.SubprocessError) as err:
        pytest.fail(f"SLURM could not start on this machine: {err}", pytrace=False)
    yield running
    running.stop()


@pytest.fixture
def slurm(slurm_daemons):
    """The module's cluster, emptied of jobs after each test (a failed one leaves none)."""
    yield slurm_daemons
    slurm_daemons.cancel_all()


def job_env(slurm, **overrides) -> dict[str, str]:
    """A test child's environment for SLURM clients, with this venv's python and tfdist."""
    env = slurm.client_env(child_env(**overrides))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])
    return env


def results(text: str) -> list[dict]:
    """The JSON result lines (those with weights) of one process, or of ``tfdist launch``
    (which forwards whole lines); srun's output may interleave long lines: see
    ``result_files``."""
    found = []
    for line in text.splitlines():
        line = re.sub(r"^\[w\d+\] ", "", line.strip())
        if line.startswith("{") and '"weights"' in line:
            found.append(json.loads(line))
    return found


def result_files(directory: Path) -> dict[tuple[int, int], dict]:
    """slurm_train.py's ``--results`` files: (attempt, rank) -> result."""
    found = {}
    for path in directory.glob("*.json"):
        attempt, rank = (int(n) for n in path.stem.split("-"))
        found[attempt, rank] = json.loads(path.read_text())
    return found


def first_steps(text: str) -> list[dict]:
    """The ``--report-first-step`` lines (rank, pid, time of the first step), in order.

    ``text`` may be a file still being written: a last line without its newline is
    not read yet.
    """
    lines = text.splitlines(keepends=True)
    return [
        json.loads(line)["first_step"]
        for line in lines
        if line.endswith("\n") and line.startswith('{"first_step"')
    ]


def max_diff(a, b) -> float:
    return equivalence.max_difference(a, b)


def one_process(script: Path, workdir: Path, *args: str, **env) -> dict:
    """The reference: ``script`` alone, without srun, in ``workdir`` (forked from the warm
    interpreter, tests/warm_start.py)."""
    proc = warm_start.run(
        [str(script), *args], env=child_env(**env), base_env=child_env(), cwd=workdir,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return results(proc.stdout)[-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(backend)``: slurm_train.py in one process, uninterrupted (computed once)."""
    cache = {}

    def get(backend: str) -> dict:
        if backend not in cache:
            workdir = tmp_path_factory.mktemp(f"reference-{backend}")
            cache[backend] = one_process(TRAIN, workdir, KERAS_BACKEND=backend)
            assert (cache[backend]["replicas"], cache[backend]["iterations"]) == (1, 64)
        return cache[backend]

    return get


def docs_block(marker: str) -> str:
    """The code block of docs/slurm.md that contains ``marker``."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), flags=re.S)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"docs/slurm.md: no one block with {marker!r}"
    return found[0]


def srun(slurm, *argv: str, timeout: float = 240, **env) -> subprocess.CompletedProcess:
    """``srun *argv`` (a job of its own, 5 minutes at most) from the repository; must exit 0."""
    proc = subprocess.run(
        ["srun", "--time=5", *argv],
        cwd=REPO,
        env=job_env(slurm, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def srun_2_tasks(slurm, directory: Path, backend: str, **env) -> dict[int, dict]:
    """slurm_train.py as ``srun -n 2`` (checkpoints and results in ``directory``), to its
    end: each task's result by rank."""
    argv = [sys.executable, str(TRAIN), "--dir", str(directory), "--results", str(directory)]
    proc = srun(slurm, "-n", "2", *argv, KERAS_BACKEND=backend, **env)
    found = result_files(directory)
    assert sorted(found) == [(0, 0), (0, 1)], proc.stdout[-3000:]
    return {rank: result for (_, rank), result in found.items()}


TWO_WORKERS = [{"replicas": 2, "workers": 2}]  # what the model of a 2-task step trains on


def check_result(result: dict, reference: dict, backend: str) -> None:
    """One task's result of a 2-task step that trained to its end: the process was one of
    2 workers, its model's own ``fit`` ran on both (``trained_on``), every step, to the
    weights of one process (``reference``)."""
    assert (result["backend"], result["workers"], result["replicas"]) == (backend, 2, 2)
    trained = result["trained_on"]
    assert trained == TWO_WORKERS, f"task {result['rank']}: its model trained on {trained}"
    assert result["iterations"] == 64
    assert max_diff(result["weights"], reference["weights"]) <= TOLERANCE


@pytest.mark.slurm
@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("jax", marks=pytest.mark.jax)])
def test_srun_2_tasks_end_with_the_weights_of_one_process(slurm, reference, backend, tmp_path):
    for result in srun_2_tasks(slurm, tmp_path, backend).values():
        check_result(result, reference(backend), backend)


# Each fault slurm_train.py honours (tests/scripts/faults.py), and what check_result says.
SRUN_FAULTS = {
    "nan": "non-finite",
    "outside_distribution": r"task \d: its model trained on \[\{'replicas': 1, 'workers': 1\}\]",
}


@pytest.mark.slurm
@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(SRUN_FAULTS))
def test_a_fault_in_the_srun_job_fails_that_tests_check_on_every_task(
    slurm, reference, fault, tmp_path
):
    """The tests of the tests (tests/e2e/test_checks_catch_faults.py) for SLURM: the step
    test_srun_2_tasks_end_with_the_weights_of_one_process runs, with a fault injected,
    fails its ``check_result`` on each task. The checks run in order, so a NaN's failure
    shows the topology passed; a model outside the scope trains on each worker alone,
    which the process's own report (2 workers, 2 replicas) does not show."""
    found = srun_2_tasks(slurm, tmp_path, "tensorflow", TFDIST_TEST_FAULT=fault)
    for result in found.values():
        with pytest.raises(AssertionError, match=SRUN_FAULTS[fault]):
            check_result(result, reference("tensorflow"), "tensorflow")


def _submit_docs_batch_script(slurm, workdir: Path) -> tuple[str, float]:
    """The docs' batch script, for this CPU-only node, submitted from ``workdir``."""
    script = docs_block("#SBATCH --requeue")
    assert "srun python train.py --epochs 12" in script
    script = "\n".join(line for line in script.splitlines() if "--gpus-per-task" not in line)
    script = script.replace(
        "train.py --epochs 12",
        "train.py --epochs 4 --step-sleep 0.1 --report-first-step --results results",
    )
    (workdir / "job.sh").write_text(script + "\n")
    shutil.copy(TRAIN, workdir / "train.py")
    for helper in ("faults.py", "trained_on.py"):  # what train.py imports besides tfdist
        shutil.copy(SCRIPTS / helper, workdir / helper)
    env = job_env(slurm, KERAS_BACKEND="tensorflow")
    submitted = time.time()
    proc = slurm.run(
        "sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--time=5",
        f"--chdir={workdir}", str(workdir / "job.sh"), env=env,
    )  # fmt: skip
    return proc.stdout.strip().split(";")[0], submitted


def _wait_for(probe, timeout: float, what: str, explain=lambda: ""):
    """``probe()``'s first true value; after ``timeout``, fails naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout:.0f} s{explain()}")


@pytest.mark.slurm
@pytest.mark.multiworker
@pytest.mark.slow
def test_sbatch_job_preempted_saves_exits_75_requeues_and_resumes(slurm, reference, tmp_path):
    """The docs' batch script; ``scancel --signal=TERM`` while it trains."""
    job, submitted = _submit_docs_batch_script(slurm, tmp_path)
    out = tmp_path / f"slurm-{job}.out"

    def read() -> str:
        return out.read_text(errors="replace") if out.exists() else ""

    def explain() -> str:
        return f" (job {job}: {slurm.job_state(job)})\n{read()[-3000:]}{slurm.log_tails()}"

    _wait_for(lambda: len(first_steps(read())) >= 2, 180, "first step of both tasks", explain)
    firsts = first_steps(read())[:2]
    slurm.run("scancel", "--signal=TERM", job)
    preempted_at = time.time()
    try:
        state = slurm.wait_job(job, FINAL, 180, "the preempted, requeued job to finish")
    except TimeoutError as err:
        pytest.fail(f"{err}\n{read()[-3000:]}")
    text = read()
    assert state == "COMPLETED", f"job {job} ended {state}:\n{text[-4000:]}"
    assert slurm.job_field(job, "Restarts") == "1", text[-4000:]
    found = result_files(tmp_path / "results")
    assert sorted(found) == [(0, 0), (0, 1), (1, 0), (1, 1)], text[-4000:]
    preempted = [found[0, rank] for rank in (0, 1)]
    resumed = [found[1, rank] for rank in (0, 1)]
    # Both tasks saved after the same step, mid-training, and asked to be restarted.
    assert [r["exit_code"] for r in preempted] == [75, 75], text[-4000:]
    step = preempted[0]["iterations"]
    assert 0 < step < 64 and preempted[1]["iterations"] == step, text[-4000:]
    assert re.search(r"srun: error: \S+: tasks? [\d,-]+: Exited with exit code 75", text), text
    # The requeued run resumed there and ended as the uninterrupted one.
    for result in resumed:
        assert (result["exit_code"], result["restored_step"]) == (0, step), text[-4000:]
        check_result(result, reference("tensorflow"), "tensorflow")
    again = first_steps(text)[2:]  # the requeued run's
    print(
        f"\nslurm: sbatch to the first training step "
        f"{max(f['unix'] for f in firsts) - submitted:.1f} s; scancel after step {step} to "
        f"the requeued run's first step {max(f['unix'] for f in again) - preempted_at:.1f} s"
    )


class _Lines:
    """Collects a child's output lines on a thread, so waiting on them never blocks."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)


@pytest.mark.slurm
@pytest.mark.multiworker
@pytest.mark.slow
def test_kill_9_of_one_task_ends_the_step_naming_it_within_60_s(slurm, tmp_path):
    """``kill -9`` of task 1's process (from outside, as the OOM killer would) mid-training."""
    argv = [
        "srun", "--time=5", "-n", "2", sys.executable, str(TRAIN), "--dir", str(tmp_path),
        "--epochs", "1000", "--step-sleep", "0.1", "--report-first-step",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=REPO, env=job_env(slurm, KERAS_BACKEND="tensorflow"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output = _Lines(proc.stdout)
    try:
        _wait_for(
            lambda: len(first_steps(output.text)) >= 2 or proc.poll() is not None,
            180,
            "first step of both tasks",
            lambda: f"\n{output.text[-3000:]}",
        )
        assert proc.poll() is None, f"the step ended before training:\n{output.text[-3000:]}"
        victim = {f["rank"]: f["pid"] for f in first_steps(output.text)}[1]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the step still runs 90 s after the kill:\n{output.text[-3000:]}")
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = output.text
    assert took <= 60, f"the step took {took:.0f} s to end after the kill\n{text[-3000:]}"
    assert proc.returncode != 0
    assert re.search(r"srun: error: \S+: task 1: Killed", text), text[-3000:]
    # the survivor's own error names the dead task
    assert re.search(r"/job:worker/replica:0/task:1\b", text), text[-3000:]
    print(f"\nslurm: the step ended {took:.1f} s after kill -9 of task 1")


@pytest.mark.slurm
@pytest.mark.multiworker
@pytest.mark.slow
def test_per_node_launcher_recipe_for_a_script_with_its_own_strategy(slurm, tmp_path):
    """``srun --ntasks-per-node=1 ... tfdist launch ...`` from the docs, on one node."""
    recipe = docs_block("tfdist launch -n 4")
    assert recipe.count(" -n 4 ") == 1
    shutil.copy(SCRIPTS / "slurm_own_strategy.py", tmp_path / "train.py")
    proc = subprocess.run(
        ["bash", "-c", recipe.replace(" -n 4 ", " -n 2 ")],
        cwd=tmp_path,
        env=job_env(slurm, KERAS_BACKEND="tensorflow"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    found = results(proc.stdout)
    assert sorted(r["task"] for r in found) == [0, 1] and {r["replicas"] for r in found} == {2}
    alone = one_process(tmp_path / "train.py", tmp_path, KERAS_BACKEND="tensorflow")
    assert alone["replicas"] == 1
    for result in found:
        assert max_diff(result["weights"], alone["weights"]) <= TOLERANCE
