"""``compile(steps_per_execution=4)`` on several replicas equals one device with the same K.

``tests/scripts/spe_job.py`` trains, in one process per topology and backend, an MLP on
numpy arrays and on a ``tf.data`` of unknown length (TensorFlow only), a Conv2D + MaxPooling2D model on a ``tf.data`` and a BatchNormalization
model with gradient accumulation and ``global_clipnorm``: 6 steps per epoch (K = 4: one
execution of 4 steps, one of 2; the last batch 8 of 16), validation and evaluation data
ending with a batch of 12, predict; plus ``tfdist.callbacks.checkpoint(save_freq=3)``.
Each cell must equal one device within ``TOLERANCE`` (weights, History, every batch-end
index and logs the callbacks saw, evaluate, predict, the checkpoint files) and reports
the topology it ran. ``tests/scripts/ckpt_job.py`` with K = 4 on 2 workers is killed -9
mid-epoch, or gets SIGTERM inside an execution, and is resumed by ``tfdist launch
--max-restarts 1``.

Without ``keras_tf_steps_per_execution_under_strategy`` the first ``fit`` on 2 devices fails
with the placeholder error of keras#19246.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import SCRIPTS, equivalence, last_json_line, launch_cli, popen_python, tagged_reports

JOB = SCRIPTS / "spe_job.py"
FIX = "keras_tf_steps_per_execution_under_strategy"
TOLERANCE = 1e-5
TF_KINDS = ["bn", "conv", "mlp"]  # the model kinds whose fit ran the fix's function
CELLS = {
    ("tensorflow", "2 devices"): {"replicas": 2, "workers": 1, "fixed": TF_KINDS},
    ("tensorflow", "2 workers"): {"replicas": 2, "workers": 2, "fixed": TF_KINDS},
    ("jax", "2 workers"): {"replicas": 2, "workers": 2, "fixed": []},
}
# Keras on JAX with several processes takes only tf.data input.
JAX_CASES = ("conv tf.data", "bn accumulation clipnorm tf.data", "checkpoint save_freq 3")


def _report(stdout: str) -> dict:
    """The chief's report, with every worker's (the chief's too) under ``workers``."""
    found = tagged_reports(stdout, "SPE", "rank")
    if 0 not in found:
        pytest.fail(f"the steps_per_execution job printed no result:\n{stdout[-3000:]}")
    return {**found[0], "workers": found}


def _start(backend: str, topology: str, tmp: str, *cases: str, **env) -> subprocess.Popen:
    """The job on ``topology``, started (the cells run side by side: each mostly waits)."""
    env.update(KERAS_BACKEND=backend, SPE_CKPT_DIR=f"{tmp}/{backend}-{topology}")
    if topology == "2 workers":
        return popen_python(
            "-m", "tfdist", "launch", "-n", "2", str(JOB), *cases, warm=False, **env
        )
    if topology == "2 devices":
        env["TFDIST_CPU_DEVICES"] = "2"
    return popen_python(str(JOB), *cases, **env)


def _finish(proc: subprocess.Popen) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"the steps_per_execution job timed out:\n{stdout[-3000:]}{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return _report(stdout)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """``{(backend, topology): report}`` for one device and every cell, run side by side."""
    tmp = str(tmp_path_factory.mktemp("spe"))
    runs = [(backend, "1 device") for backend in ("tensorflow", "jax")] + list(CELLS)
    procs = {
        (backend, topology): _start(
            backend, topology, tmp, *(JAX_CASES if backend == "jax" else ())
        )
        for backend, topology in runs
    }
    procs["log reductions"] = _start("tensorflow", "2 workers", tmp, SPE_COUNT_REDUCTIONS="1")
    reports = {}
    try:
        for key, proc in procs.items():
            reports[key] = _finish(proc)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return reports


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.multiworker
@pytest.mark.parametrize("backend, topology", list(CELLS))
def test_steps_per_execution_matches_one_device(matrix, backend, topology):
    reference, cell = matrix[backend, "1 device"], matrix[backend, topology]
    assert len(reference["cases"]) == (len(JAX_CASES) if backend == "jax" else 5)
    check_cell(reference, cell, backend, topology)


def check_cell(
    reference: dict, cell: dict, backend: str, topology: str, fixed: list | None = None
) -> None:
    """The cell ran on ``topology`` (every worker, every case's models) and each of its
    workers' cases equals one device's (tests/e2e/test_checks_catch_faults.py injects a
    fault for each of these checks). ``fixed``: the model kinds whose ``fit`` ran the fix
    (default: the cell's, for every case)."""
    one = {"backend": backend, "replicas": 1, "workers": 1, "steps_per_execution": 4}
    assert reference["topology"] == {**one, "fixed": []}  # one replica: upstream's function
    expected = dict(CELLS[backend, topology])
    if fixed is not None:
        expected["fixed"] = fixed
    want = {key: expected[key] for key in ("replicas", "workers")}
    assert sorted(cell["workers"]) == list(range(want["workers"]))
    for rank, worker in cell["workers"].items():  # every worker's, not the chief's alone
        assert worker["topology"] == {**one, **expected}, f"worker {rank}: {worker['topology']}"
        for name, case in worker["cases"].items():  # what each case's models ran on
            assert case.get("trained_on") == [want], (rank, name, case.get("trained_on"))
        failures = equivalence.case_failures(reference["cases"], worker["cases"], TOLERANCE)
        assert not failures, f"worker {rank}:\n" + "\n".join(failures)


@pytest.mark.slow
@pytest.mark.devices
def test_callbacks_and_checkpoints_see_one_call_per_execution(matrix):
    """Keras's own K > 1 behaviour, kept: one ``on_*_batch_end`` per execution with the
    last step's logs and index K - 1, 2K - 1 (7 also for the epoch's 2-step execution);
    ``save_freq=3`` saves at the end of the execution in which the step passed a multiple
    of 3 (steps 4 and 10: batch 4 of each epoch), then at each epoch end."""
    values = matrix["tensorflow", "2 devices"]["cases"]["mlp numpy"]["values"]
    batches = {kind: [call["batch"] for call in values[f"{kind} batch ends"].values()]
               for kind in ("train", "test", "predict")}  # fmt: skip
    # test: 2 validations, then evaluate (92 examples: 6 batches, 2 executions each)
    assert batches == {"train": [3, 7, 3, 7], "test": [3, 7] * 3, "predict": [3, 7]}
    assert values["train batch ends"]["3"]["loss"] > 0
    files = matrix["tensorflow", "2 devices"]["cases"]["checkpoint save_freq 3"]["values"]["files"]
    assert sorted(files) == ["ckpt-1-4.keras", "ckpt-1.keras", "ckpt-2-4.keras", "ckpt-2.keras"]


@pytest.mark.slow
@pytest.mark.multiworker
def test_logs_are_averaged_across_workers_once_per_execution(matrix):
    """Keras returns only an execution's last logs for K > 1: 2 workers average them
    once per call (4 executions in 12 steps), not once per step as with K = 1."""
    report = matrix["log reductions"]
    assert (report["topology"]["replicas"], report["topology"]["workers"]) == (2, 2)
    per_step, per_execution = report["counts"]
    assert (per_step["steps_per_execution"], per_step["reductions"]) == (1, 12)
    assert (per_execution["steps_per_execution"], per_execution["reductions"]) == (4, 4)


@pytest.mark.devices
@pytest.mark.upstream_failure("keras_tf_steps_per_execution_under_strategy")
def test_upstream_fails_with_a_placeholder_error(tmp_path):
    proc = _start("tensorflow", "2 devices", str(tmp_path), "mlp numpy", TFDIST_COMPAT_EXCLUDE=FIX)
    report = _finish(proc)
    assert report["topology"]["replicas"] == 2
    error = report["cases"]["mlp numpy"].get("error", "")
    assert error.startswith("InvalidArgumentError") and "while/cond/Placeholder" in error, error
    assert "You must feed a value for placeholder tensor" in error, error


CKPT_JOB = ("--save-freq", "7", "--epochs", "2", "--per-replica-batch", "2", "--examples", "54")
CKPT_JOB += ("--steps-per-execution", "4")  # 13 steps per epoch: executions of 4, 4, 4, 1


def _two_workers_and_reference(tmp_path, *faults: str) -> tuple[dict, subprocess.CompletedProcess]:
    """``ckpt_job.py`` with ``CKPT_JOB`` under ``tfdist launch -n 2 --max-restarts 1`` with
    ``faults``, and, side by side (each mostly waits), the same job never interrupted on
    2 logical devices in one process: (its result, the launcher's process)."""
    script = [sys.executable, str(SCRIPTS / "ckpt_job.py"), *CKPT_JOB]
    temp = tmp_path / "tmp"  # where worker 1 stages its discarded copy of each save
    temp.mkdir()
    reference = popen_python(
        *script[1:], "--dir", str(tmp_path / "reference"), TFDIST_CPU_DEVICES="2"
    )
    try:
        proc = launch_cli(
            "-n", "2", "--max-restarts", "1", *script[1:], "--dir", str(tmp_path / "ckpt"),
            *faults, timeout=600, TMPDIR=str(temp),
        )  # fmt: skip
        out, err = reference.communicate(timeout=300)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    assert reference.returncode == 0, err[-4000:]
    result = last_json_line(out)
    assert result["replicas"] == 2 and result["iterations"] == 26
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return result, proc


def _worker_results(stdout: str, worker: str) -> list[dict]:
    """The result lines worker ``worker`` printed, one per attempt."""
    return [json.loads(line.partition(" ")[2]) for line in stdout.splitlines()
            if line.startswith(f"[{worker}] {{") and '"weights"' in line]  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_workers_killed_mid_epoch_resume_exactly(tmp_path):
    """K = 4 on 2 workers; worker 1 is killed -9 after step 25 (epoch 1, batch 12); the
    launcher restarts both from the step-21 checkpoint (epoch 1, batch 8: saved at the
    end of the execution in which step 21 = 3 x 7 fell) and the job ends with the weights
    of a run never interrupted (2 logical devices, one process)."""
    reference, proc = _two_workers_and_reference(
        tmp_path, "--sigkill-at-step", "25", "--sigkill-rank", "1"
    )
    assert '[w1] {"dying_at_step": 25}' in proc.stdout
    for worker in ("w0", "w1"):
        resumed = _worker_results(proc.stdout, worker)[-1]
        assert resumed["replicas"] == 2 and resumed["exit_code"] == 0
        assert resumed["restored"] == {"path": "ckpt-2-8.keras", "epoch": 1, "batch": 8, "step": 21}
        assert [step for *_, step in resumed["trained"]] == [25, 26]
        assert resumed["iterations"] == 26
        equivalence.assert_close(reference["weights"], resumed["weights"], TOLERANCE, worker)


@pytest.mark.slow
@pytest.mark.multiworker
def test_sigterm_inside_an_execution_saves_at_an_agreed_boundary_and_resumes_exactly(tmp_path):
    """K = 4 on 2 workers (executions end at steps 4, 8, 12, 13 of the first epoch).
    Worker 1 sends itself SIGTERM from inside step 6, while the execution of steps 5-8
    runs. Its handler runs when that execution returns; at the step-8 boundary it
    announces "save after step 9", so both workers save at the end of the execution
    holding step 9 (step 12: epoch 0, batch 12) and exit 75; the launcher's restart
    resumes there and ends with the weights of a run never interrupted."""
    reference, proc = _two_workers_and_reference(
        tmp_path, "--sigterm-in-step", "6", "--sigterm-rank", "1"
    )
    output = proc.stdout + proc.stderr
    assert '[w1] {"sigterm_in_step": 6}' in proc.stdout  # sent while step 6 ran
    assert '[w0] {"sigterm_in_step"' not in proc.stdout
    assert "[w1] tfdist: SIGTERM received" in output
    assert "[w0] tfdist: SIGTERM received" not in output
    assert "exited with code 75 (saved, restart requested)" in proc.stderr
    for worker in ("w0", "w1"):
        preempted, resumed = _worker_results(proc.stdout, worker)
        assert preempted["exit_code"] == 75 and preempted["iterations"] == 12
        # the batch ends before the save: step 6 fell inside an execution, not at its end
        assert [step for *_, step in preempted["trained"]] == [4, 8]
        assert preempted["checkpoints"] == ["ckpt-1-12.keras", "ckpt-1-8.keras"]  # save_freq 7: 8
        assert resumed["replicas"] == 2 and resumed["exit_code"] == 0
        assert resumed["restored"] == {
            "path": "ckpt-1-12.keras",
            "epoch": 0,
            "batch": 12,
            "step": 12,
        }
        assert [step for *_, step in resumed["trained"]] == [13, 17, 21, 25, 26]
        assert resumed["iterations"] == 26
        equivalence.assert_close(reference["weights"], resumed["weights"], TOLERANCE, worker)
