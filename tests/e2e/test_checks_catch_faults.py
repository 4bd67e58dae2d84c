"""The tests of the tests: each check of an equivalence fails when its promise breaks.

The comparison every equivalence goes through (tests/scripts/equivalence.py) is checked
on its own: a NaN, an inf, a missing key, a changed shape. Then the test jobs run with an
injected fault (``TFDIST_TEST_FAULT``, tests/scripts/faults.py, read only by the jobs)
and the very checks the equivalence tests use must fail on it, while the same checks
pass without it:

- ``nan``: a NaN in a cell's weights fails the idiom matrix's comparison;
- ``one_device``: a "2 devices" cell run on one device fails its topology check (its
  numbers alone would pass: on JAX no idiom is expected to differ);
- ``outside_distribution``: a model built outside ``tfdist.scope()`` in a "2 devices"
  process trains on one device: the process's topology passes, the idiom's own fails;
- ``inert_callback``: a callback that does nothing fails the callback-acted check;
- ``late_resume``: a checkpoint resumed one step late fails the resume test's check.

The partial-batch and steps_per_execution jobs (tests/compat/test_partial_batches.py,
test_steps_per_execution.py) take ``nan``, ``one_device`` and ``outside_distribution`` too,
each caught by that file's own checks; so does the JAX custom loop
(tests/test_custom_loops.py). The TensorFlow custom loop takes ``nan`` and ``one_device``;
the jax-inputs job (tests/compat/test_jax_inputs.py) and the user-save job
(tests/compat/test_user_saves.py) ``nan`` and ``outside_distribution``: each job runs once
per fault on one case, and its file's own checks catch each fault. The SLURM and
Kubernetes job (tests/scripts/slurm_train.py) takes ``nan`` and ``outside_distribution``;
its fault tests live beside the clusters they need, in tests/e2e/test_slurm.py (an
``srun -n 2`` step per fault) and test_kubernetes.py (a TFJob per fault), each caught on
every worker by that file's ``check_result``. The Ray job (the docs' ``TensorflowTrainer``
code block, run by tests/scripts/ray_faults.py) takes ``nan``: tests/e2e/test_ray.py,
which runs only in CI's Ray stage, shows its equivalence check fail on it.

The equivalence jobs of the compat fixes and of ``fit`` take ``nan`` and one topology
fault each; each runs once per fault on its smallest case beside one reference run, and
its own file's checks catch each fault: ``outside_distribution`` by the case's own model in
the no-harm job (tests/compat/test_no_harm.py) and by the model's variable type in
fit_equivalence.py (tests/test_distribute.py); ``one_device`` by the process's replicas in
the optimizer-build loop (test_optimizer_build.py), the accumulation (test_accumulation.py),
clipping (test_clipping.py), BatchNormalization (tests/test_batchnorm.py), epoch-start
(test_epoch_start.py) and jit_compile (test_jit_compile.py: its ``nan`` is in predict's
outputs, which that file compares with one device's) jobs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import test_batchnorm as batchnorm
import test_custom_loops as loops
import test_distribute as distribute
import test_idioms
import test_resume_world_size as world_size

from conftest import REPO, SCRIPTS, equivalence

# tests/compat's suites, importable when this file runs alone too (pytest puts a test
# file's folder on sys.path only when it collects that file).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import test_accumulation as accumulation  # noqa: E402
import test_clipping as clipping  # noqa: E402
import test_epoch_start as epoch_start  # noqa: E402
import test_jax_inputs as jax_inputs  # noqa: E402
import test_jit_compile as jit_compile  # noqa: E402
import test_no_harm as no_harm  # noqa: E402
import test_optimizer_build as optimizer_build  # noqa: E402
import test_partial_batches as partial  # noqa: E402
import test_steps_per_execution as spe  # noqa: E402
import test_user_saves as user_saves  # noqa: E402

NotEquivalent = equivalence.NotEquivalent
CALLBACKS = sorted(test_idioms.ACTED)
BACKEND = "jax"  # the backend where no idiom is expected to differ between topologies
IDIOM = "numpy_batch_size"


# ------------------------------------------------------------------ the comparison


def test_a_nan_after_a_smaller_difference_is_not_dropped():
    # The hole: max([0.0, nan]) is 0.0 in Python.
    assert max([0.0, float("nan")]) == 0.0
    with pytest.raises(NotEquivalent, match=r"w: 1 non-finite value\(s\) in the result"):
        equivalence.assert_close({"w": [1.0, 2.0]}, {"w": [1.0, float("nan")]}, 1e-5)
    with pytest.raises(NotEquivalent, match="in the reference"):
        equivalence.max_difference([np.array([np.inf])], [np.array([1.0])])
    with pytest.raises(NotEquivalent, match="non-finite"):  # NaN on both sides is no match
        equivalence.max_difference({"a": float("nan")}, {"a": float("nan")})
    with pytest.raises(NotEquivalent, match="non-finite"):  # nor a reason to "differ"
        equivalence.assert_differs({"a": [0.0]}, {"a": [float("nan")]}, 1e-5)


def test_a_missing_key_or_a_changed_shape_fails():
    with pytest.raises(NotEquivalent, match=r"only in the reference \['b'\]"):
        equivalence.differences({"a": [1.0], "b": [2.0]}, {"a": [1.0]})
    with pytest.raises(NotEquivalent, match=r"only in the result \['c'\]"):
        equivalence.differences({"a": [1.0]}, {"a": [1.0], "c": [1.0]})
    with pytest.raises(NotEquivalent, match=r"shape \(3,\), the reference's \(2,\)"):
        equivalence.differences({"a": [1.0, 2.0]}, {"a": [1.0, 2.0, 3.0]})
    weights = [np.zeros((2, 3)), np.zeros(3), np.zeros(1)]  # a model's, one array each
    with pytest.raises(NotEquivalent, match=r"only in the reference \['\[2\]'\]"):
        equivalence.differences(weights, weights[:2])
    with pytest.raises(NotEquivalent, match="nothing to compare"):
        equivalence.differences({}, {})


def test_the_worst_key_and_its_difference_are_reported():
    class History:  # a keras.callbacks.History's shape
        history = {"loss": [1.0, 0.5], "val_loss": [2.0, 1.0]}

    other = {"loss": [1.0, 0.5], "val_loss": [2.0, 1.25]}
    assert equivalence.worst(History(), other) == ("val_loss", 0.25)
    nested = {"weights": [np.ones((2, 2)), np.ones(2)], "lr": 0.1}
    changed = {"weights": [np.ones((2, 2)), np.array([1.0, 1.5])], "lr": 0.1}
    assert equivalence.worst(nested, changed) == ("weights[1]", 0.5)
    with pytest.raises(NotEquivalent, match=r"weights\[1\] differs by 0.5 > 0.001"):
        equivalence.assert_close(nested, changed, 1e-3, "cell")
    assert equivalence.assert_differs(nested, changed, 1e-3) == 0.5
    with pytest.raises(NotEquivalent, match="expected a difference"):
        equivalence.assert_differs(nested, nested, 1e-3)


def test_differences_a_job_printed_fail_when_one_is_missing_or_not_finite():
    assert equivalence.assert_within({"a": 1e-7, "b": 0.0}, 1e-5) == "a"
    with pytest.raises(NotEquivalent, match="b differs by 0.1"):
        equivalence.assert_within({"a": 0.0, "b": 0.1}, 1e-5)
    for bad in (float("nan"), float("inf"), None):
        with pytest.raises(NotEquivalent, match="not a finite number"):
            equivalence.assert_within({"a": 0.0, "b": bad}, 1e-5)
    with pytest.raises(NotEquivalent, match="no differences"):
        equivalence.assert_within({}, 1e-5)


def test_tfdist_itself_reads_no_test_fault():
    found = subprocess.run(
        ["grep", "-rl", "TFDIST_TEST_FAULT", str(REPO / "tfdist")], capture_output=True, text=True
    )
    assert found.returncode == 1 and not found.stdout, found.stdout
    assert "TFDIST_TEST_FAULT" in (SCRIPTS / "faults.py").read_text()


# ------------------------------------------------------------------ injected faults


@pytest.fixture(scope="module")
def idiom_runs() -> dict[str, dict]:
    """The idiom job on JAX: a clean reference, and a run per fault (2 at a time)."""
    jobs = {
        "reference": ("1 device", [IDIOM, *CALLBACKS], {}),
        "nan": ("2 devices", [IDIOM], {"TFDIST_TEST_FAULT": "nan"}),
        "one_device": ("2 devices", [IDIOM], {"TFDIST_TEST_FAULT": "one_device"}),
        "outside": ("2 devices", [IDIOM], {"TFDIST_TEST_FAULT": "outside_distribution"}),
        "inert_callback": ("1 device", CALLBACKS, {"TFDIST_TEST_FAULT": "inert_callback"}),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {
            name: pool.submit(test_idioms.run_job, BACKEND, topology, *idioms, **env)
            for name, (topology, idioms, env) in jobs.items()
        }
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
def test_a_nan_in_a_cells_weights_fails_the_idiom_comparison(idiom_runs):
    reference, cell = idiom_runs["reference"], idiom_runs["nan"]
    test_idioms.check_topology(reference, "1 device")
    test_idioms.check_topology(cell, "2 devices")  # it did run on 2 devices
    with pytest.raises(NotEquivalent, match=r"weights: 1 non-finite value\(s\) in the result"):
        test_idioms.check_cell(IDIOM, BACKEND, "2 devices", reference[IDIOM], cell[IDIOM])


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
def test_a_cell_run_on_one_device_fails_the_topology_check(idiom_runs):
    reference, cell = idiom_runs["reference"], idiom_runs["one_device"]
    # Its numbers pass (one device gives one device's numbers): only the topology tells.
    test_idioms.check_cell(IDIOM, BACKEND, "2 devices", reference[IDIOM], cell[IDIOM])
    with pytest.raises(AssertionError, match="2 devices"):
        test_idioms.check_topology(cell, "2 devices")


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
def test_a_model_outside_the_distribution_fails_the_idioms_own_topology_check(idiom_runs):
    reference, cell = idiom_runs["reference"], idiom_runs["outside"]
    test_idioms.check_cell(IDIOM, BACKEND, "2 devices", reference[IDIOM], cell[IDIOM])
    assert cell["_topology"] == test_idioms.TOPOLOGY["2 devices"]  # the process ran on 2
    assert cell[IDIOM]["trained_on"] == [{"replicas": 1, "workers": 1}]
    with pytest.raises(AssertionError, match="numpy_batch_size on 2 devices: a model ran on"):
        test_idioms.check_topology(cell, "2 devices")


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
@pytest.mark.parametrize("idiom", CALLBACKS)
def test_an_inert_callback_fails_the_callback_acted_check(idiom_runs, idiom):
    test_idioms.check_callback_acted(idiom, idiom_runs["reference"][idiom])
    inert = idiom_runs["inert_callback"][idiom]
    with pytest.raises(NotEquivalent, match="the callback did not act"):
        test_idioms.check_callback_acted(idiom, inert)


@pytest.mark.slow
@pytest.mark.devices
def test_a_checkpoint_resumed_one_step_late_fails_the_resume_check(tmp_path):
    run = world_size.run_job
    reference = run(tmp_path / "reference", "1")
    died = run(tmp_path / "died", "1", "--die-after-step", str(world_size.DIE_AFTER))
    world_size.check_died(died, "1")
    shutil.copytree(tmp_path / "died", tmp_path / "late")
    world_size.check_resumed(run(tmp_path / "died", "1"), "1", reference)  # without the fault
    late = run(tmp_path / "late", "1", TFDIST_TEST_FAULT="late_resume")
    assert late["resumed_step"] == 10 and late["steps"] == 24  # the counts look right
    with pytest.raises(NotEquivalent, match="differs by"):
        world_size.check_resumed(late, "1", reference)


PARTIAL_CASE = "last 5 tf.data"  # 2 replicas cut its last batch 3 + 2
# A job's runs for the fault tests: {name: (topology, environment)}.
FAULT_RUNS = {
    "reference": ("1 device", {}),
    "clean": ("2 devices", {}),
    "nan": ("2 devices", {"TFDIST_TEST_FAULT": "nan"}),
    "one_device": ("2 devices", {"TFDIST_TEST_FAULT": "one_device"}),
    "outside": ("2 devices", {"TFDIST_TEST_FAULT": "outside_distribution"}),
}


@pytest.fixture(scope="module")
def partial_runs() -> dict[str, dict]:
    """The partial-batch job on TensorFlow, one case: a clean reference and a run per fault
    (2 at a time)."""
    with ThreadPoolExecutor(2) as pool:
        futures = {
            name: pool.submit(partial._run, topology, PARTIAL_CASE, **env)
            for name, (topology, env) in FAULT_RUNS.items()
        }
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
@pytest.mark.devices
def test_each_fault_in_the_partial_batch_job_fails_that_files_checks(partial_runs):
    reference, clean = partial_runs["reference"], partial_runs["clean"]
    partial._check_topology(reference, "tensorflow", "1 device")
    partial._check_topology(clean, "tensorflow", "2 devices")  # the checks pass without one
    partial._assert_equal_to_one_device(reference, clean)
    assert set(clean["cases"]) == {PARTIAL_CASE}

    nan = partial_runs["nan"]
    partial._check_topology(nan, "tensorflow", "2 devices")
    with pytest.raises(AssertionError, match="non-finite"):
        partial._assert_equal_to_one_device(reference, nan)

    # One device's numbers are one device's: only the topology checks tell.
    for fault, where in (("one_device", r"'replicas': 1"), ("outside", PARTIAL_CASE)):
        run = partial_runs[fault]
        partial._assert_equal_to_one_device(reference, run)
        with pytest.raises(AssertionError, match=where):
            partial._check_topology(run, "tensorflow", "2 devices")


SPE_CASE = "mlp numpy"


@pytest.fixture(scope="module")
def spe_runs(tmp_path_factory) -> dict[str, dict]:
    """The steps_per_execution job on TensorFlow, one case: a clean reference and a run per
    fault, side by side as that file runs its matrix."""
    tmp = tmp_path_factory.mktemp("spe_faults")
    procs = {
        name: spe._start("tensorflow", topology, f"{tmp}/{name}", SPE_CASE, **env)
        for name, (topology, env) in FAULT_RUNS.items()
    }
    return {name: spe._finish(proc) for name, proc in procs.items()}


@pytest.mark.slow
@pytest.mark.devices
def test_each_fault_in_the_steps_per_execution_job_fails_that_files_check(spe_runs):
    reference = spe_runs["reference"]

    def check(run):
        spe.check_cell(reference, run, "tensorflow", "2 devices", fixed=["mlp"])

    check(spe_runs["clean"])  # the check passes without a fault
    with pytest.raises(AssertionError, match="non-finite"):
        check(spe_runs["nan"])
    with pytest.raises(AssertionError, match=r"'replicas': 1"):
        check(spe_runs["one_device"])
    outside = spe_runs["outside"]
    assert outside["topology"]["replicas"] == 2  # the process ran on 2 devices, its model
    assert outside["cases"][SPE_CASE]["trained_on"] == [{"replicas": 1, "workers": 1}]
    with pytest.raises(AssertionError, match=r"'replicas': 2, .*'fixed': \[\]"):
        check(outside)  # on one: the fix never ran for it


SAVES_ROUNDS = "1"  # that file's 20 rounds look for races; one round shows a check fail
SAVES_FAULTS = {name: FAULT_RUNS[name][1] for name in ("clean", "nan", "outside")}


@pytest.fixture(scope="module")
def user_saves_runs(tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """The user-save job on 2 TensorFlow workers, one round: a clean run and a run per
    fault it honours (2 at a time), each as ``(results, its directory)``."""
    tmp = tmp_path_factory.mktemp("user_saves_faults")

    def run(name: str, env: dict) -> tuple[dict, Path]:
        directory = tmp / name
        directory.mkdir()
        proc = user_saves._run(directory, "tensorflow", SAVES_ROUNDS, **env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return user_saves._results(proc), directory

    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run, name, env) for name, env in SAVES_FAULTS.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
@pytest.mark.multiworker
def test_each_fault_in_the_user_save_job_fails_that_files_check(user_saves_runs):
    def check(name: str) -> None:
        results, directory = user_saves_runs[name]
        user_saves.check_saves(results, directory, "tensorflow")

    check("clean")  # the check passes without a fault
    with pytest.raises(AssertionError, match="non-finite"):  # a load that read a NaN
        check("nan")
    # Each worker's model trained alone: caught by what it ran on, before anything else.
    with pytest.raises(AssertionError, match=r"'trained_on', \[\{'replicas': 1, 'workers': 1"):
        check("outside")


JAX_INPUTS_KIND = "numpy"
# Not one_device: the setup line it would fail is the check the idiom job's fault shows
# failing; a model outside the scope is what only the kinds' own topology tells.
JAX_INPUTS_RUNS = {name: FAULT_RUNS[name] for name in ("reference", "clean", "nan", "outside")}


@pytest.fixture(scope="module")
def jax_inputs_runs() -> dict[str, dict]:
    """The jax-inputs job in one process, one kind: a clean reference on one device, a
    clean run on 2 devices and a run per fault (2 at a time)."""

    def run(topology: str, env: dict) -> dict:
        devices = 2 if topology == "2 devices" else None
        return jax_inputs._one_process(devices, JAX_INPUTS_KIND, **env)

    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run, *how) for name, how in JAX_INPUTS_RUNS.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
def test_each_fault_in_the_jax_inputs_job_fails_that_files_checks(jax_inputs_runs):
    reference = jax_inputs_runs["reference"]
    jax_inputs._assert_topology(reference, replicas=1, processes=1, devices=1)
    jax_inputs._assert_models_ran_on(reference, replicas=1, processes=1)

    def check_topology(run: dict) -> None:
        jax_inputs._assert_topology(run, replicas=2, processes=1, devices=2)
        jax_inputs._assert_models_ran_on(run, replicas=2, processes=1)

    def check_numbers(run: dict) -> None:
        jax_inputs._assert_same(reference, run, {JAX_INPUTS_KIND})

    clean = jax_inputs_runs["clean"]
    check_topology(clean)  # the checks pass without a fault
    check_numbers(clean)
    nan = jax_inputs_runs["nan"]
    check_topology(nan)
    with pytest.raises(AssertionError, match="non-finite"):
        check_numbers(nan)
    # One device's numbers are one device's, and the process ran on 2: only what the
    # kind's model ran on tells.
    outside = jax_inputs_runs["outside"]
    check_numbers(outside)
    jax_inputs._assert_topology(outside, replicas=2, processes=1, devices=2)
    with pytest.raises(AssertionError, match=r"\('numpy', \[\{'replicas': 1, 'workers': 1\}\]\)"):
        check_topology(outside)


# The custom loops' runs for the fault tests: each run trains its own one-device reference
# first (--one-device-too), so it needs no reference run besides.
LOOP_FAULTS = {name: FAULT_RUNS[name][1] for name in ("clean", "nan", "one_device", "outside")}


def loop_runs(job, tmp: Path, names) -> dict[str, dict]:
    """``job``'s single process (``run_single``, unchecked) clean and with each fault in
    ``names``, 2 at a time."""
    with ThreadPoolExecutor(2) as pool:
        futures = {
            name: pool.submit(loops.run_single, job, tmp / name, check=False, **LOOP_FAULTS[name])
            for name in ("clean", *names)
        }
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def tf_loop_runs(tmp_path_factory) -> dict[str, dict]:
    """The TensorFlow loop on 2 devices (a model built outside the strategy's scope is
    refused by TensorFlow itself: no fault to catch there)."""
    return loop_runs(loops.TF_LOOP, tmp_path_factory.mktemp("tf_loop"), ["nan", "one_device"])


@pytest.fixture(scope="module")
def jax_loop_runs(tmp_path_factory) -> dict[str, dict]:
    """The JAX loop on 4 devices."""
    names = ["nan", "one_device", "outside"]
    return loop_runs(loops.JAX_LOOP, tmp_path_factory.mktemp("jax_loop"), names)


def check_loop_faults(job, runs: dict[str, dict], one_device: str) -> None:
    """The clean run passes ``check_single``; the NaN fails its comparison, and a run on
    one device (whose weights are the reference's) fails its topology check with
    ``one_device``."""
    loops.check_single(job, runs["clean"])
    with pytest.raises(AssertionError, match="non-finite"):
        loops.check_single(job, runs["nan"])
    run = runs["one_device"]
    distributed, reference = run["distributed"], run["one_device"]
    assert loops.max_diff(distributed["weights"], reference["weights"]) <= loops.TOLERANCE
    with pytest.raises(AssertionError, match=one_device):
        loops.check_single(job, run)


@pytest.mark.slow
@pytest.mark.devices
def test_each_fault_in_the_tensorflow_loop_fails_that_files_check(tf_loop_runs):
    check_loop_faults(loops.TF_LOOP, tf_loop_runs, r"'distributed\.replicas', 1, 2")


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.devices
def test_each_fault_in_the_jax_loop_fails_that_files_check(jax_loop_runs):
    check_loop_faults(loops.JAX_LOOP, jax_loop_runs, r"'devices', 1, 4")
    outside = jax_loop_runs["outside"]
    distributed, reference = outside["distributed"], outside["one_device"]
    assert distributed["devices"] == 4  # the mesh it was given; it trained on one device
    assert loops.max_diff(distributed["weights"], reference["weights"]) <= loops.TOLERANCE
    with pytest.raises(AssertionError, match=r"'distributed\.state_devices', 1, 4"):
        loops.check_single(loops.JAX_LOOP, outside)


# ------------------------------------------------------------------ the equivalence jobs
# Each job runs once per fault on its smallest case, beside one reference run (none for
# bn_job.py, which trains its one-device variant in the same process); a check is shown
# to pass on the run whose fault it does not target (the NaN run ran on its topology, a
# run on one device has one device's numbers), so no clean run is needed besides.

FAULT = {name: env for name, (_, env) in FAULT_RUNS.items() if env}


def two_at_a_time(run, jobs: dict[str, tuple]) -> dict:
    """``run(*args)`` for each ``{name: args}``, 2 at a time: ``{name: result}``."""
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run, *args) for name, args in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


NO_HARM_CASE = "sample weights"  # a Dense regression: the job's smallest case


@pytest.fixture(scope="module")
def no_harm_runs() -> dict[str, dict]:
    """The no-harm job on TensorFlow, one case, each run as ``{worker: {case: result}}``."""

    def run(cell: str, env: dict) -> dict:
        return no_harm._reports(no_harm.run_cell(cell, [NO_HARM_CASE], **env))

    jobs = {
        "reference": ("1 device", {}),
        "nan": ("2 devices", FAULT["nan"]),
        "outside": ("2 devices", FAULT["outside"]),
    }
    return two_at_a_time(run, jobs)


@pytest.mark.slow
@pytest.mark.devices
def test_each_fault_in_the_no_harm_job_fails_that_files_checks(no_harm_runs):
    reference = no_harm_runs["reference"]
    no_harm.check_reports("1 device", reference)
    one = reference[0][NO_HARM_CASE]

    nan = no_harm_runs["nan"]
    no_harm.check_reports("2 devices", nan)  # its model ran on 2 devices
    with pytest.raises(NotEquivalent, match="non-finite"):
        no_harm.check_case("nan", one, nan[0][NO_HARM_CASE], NO_HARM_CASE)
    # One device's numbers in a process on 2: only what the case's own model ran on tells.
    outside = no_harm_runs["outside"]
    no_harm.check_case("outside", one, outside[0][NO_HARM_CASE], NO_HARM_CASE)
    with pytest.raises(AssertionError, match=r"\('2 devices', 0, 'sample weights', \(1, 1\)\)"):
        no_harm.check_reports("2 devices", outside)


OPTIMIZER_BUILD_CASE = "adam builds itself"  # the fix's own case


@pytest.fixture(scope="module")
def optimizer_build_runs() -> dict[str, dict]:
    """The optimizer-build loop on TensorFlow, one case, on the file's "4 devices"."""

    def run(topology: str, env: dict) -> dict:
        return optimizer_build._run(topology, OPTIMIZER_BUILD_CASE, **env)

    jobs = {
        "reference": ("1 device", {}),
        "nan": ("4 devices", FAULT["nan"]),
        "one_device": ("4 devices", FAULT["one_device"]),
    }
    return two_at_a_time(run, jobs)


@pytest.mark.slow
@pytest.mark.devices
def test_each_fault_in_the_optimizer_build_loop_fails_that_files_checks(optimizer_build_runs):
    reference = optimizer_build_runs["reference"]
    optimizer_build.check_topology(reference, 1, 1)
    one, cases = reference["cases"], [OPTIMIZER_BUILD_CASE]

    nan = optimizer_build_runs["nan"]
    optimizer_build.check_topology(nan, 4, 1)
    with pytest.raises(NotEquivalent, match="non-finite"):
        optimizer_build.check_cases(nan, one, cases)
    run = optimizer_build_runs["one_device"]
    optimizer_build.check_cases(run, one, cases)  # one device's numbers are one device's
    with pytest.raises(AssertionError, match=r"'replicas': 1"):
        optimizer_build.check_topology(run, 4, 1)


@pytest.fixture(scope="module")
def accumulation_runs() -> dict[str, dict]:
    """The gradient-accumulation job (every variant: it takes no case) on TensorFlow."""

    def run(env: dict) -> dict:
        return accumulation.run_side_by_side({"run": env})["run"]

    jobs = {
        "reference": ({"TFDIST_CPU_DEVICES": "1"},),
        "nan": ({"TFDIST_CPU_DEVICES": "2", **FAULT["nan"]},),
        "one_device": ({"TFDIST_CPU_DEVICES": "2", **FAULT["one_device"]},),
    }
    return two_at_a_time(run, jobs)


@pytest.mark.slow
@pytest.mark.devices
def test_each_fault_in_the_accumulation_job_fails_that_files_checks(accumulation_runs):
    reference = accumulation_runs["reference"]
    accumulation.check_topology(reference, 1)

    nan = accumulation_runs["nan"]
    accumulation.check_topology(nan, 2)
    with pytest.raises(NotEquivalent, match="non-finite"):
        accumulation.assert_like_one_device(nan, reference)
    run = accumulation_runs["one_device"]
    assert accumulation.max_diff(run["weights"], reference["weights"]) < accumulation.TOL
    with pytest.raises(AssertionError, match="ran on 1 replica"):
        accumulation.check_topology(run, 2)


CLIP_VARIANT = "global_clipnorm"


@pytest.fixture(scope="module")
def clip_runs() -> dict[str, dict]:
    """The clipping job on TensorFlow under tfdist.scope(), one variant."""

    def run(devices: str, env: dict) -> dict:
        return clipping.run_job("--variants", CLIP_VARIANT, TFDIST_CPU_DEVICES=devices, **env)

    jobs = {
        "reference": ("1", {}),
        "nan": ("2", FAULT["nan"]),
        "one_device": ("2", FAULT["one_device"]),
    }
    return two_at_a_time(run, jobs)


@pytest.mark.slow
@pytest.mark.devices
def test_each_fault_in_the_clipping_job_fails_that_files_checks(clip_runs):
    reference = clip_runs["reference"]
    assert reference["replicas"] == 1  # as that file's one_device fixture asserts
    one = reference["weights"]

    nan = clip_runs["nan"]
    clipping.check_mirrored(nan)
    with pytest.raises(NotEquivalent, match="non-finite"):
        clipping.check_weights(nan, one, "nan")
    run = clip_runs["one_device"]
    clipping.check_weights(run, one, "one_device")  # one device's numbers are one device's
    with pytest.raises(AssertionError, match=r"\(1, '"):
        clipping.check_mirrored(run)


@pytest.fixture(scope="module")
def batchnorm_runs() -> dict[str, dict]:
    """bn_job.py on TensorFlow, a run per fault (its one-device variant is its reference)."""

    def run(env: dict) -> dict:
        return batchnorm._bn_job(KERAS_BACKEND="tensorflow", **env)

    return two_at_a_time(run, {name: (FAULT[name],) for name in ("nan", "one_device")})


@pytest.mark.slow
@pytest.mark.devices
def test_each_fault_in_the_batchnorm_job_fails_that_files_checks(batchnorm_runs):
    nan = batchnorm_runs["nan"]
    batchnorm.check_replicas(nan)
    with pytest.raises(NotEquivalent, match="non-finite"):
        batchnorm.check_synced_equals_one_device(nan)
    # Every variant trained on one device: each equals the one-device variant.
    run = batchnorm_runs["one_device"]
    for variant in batchnorm.TF_REPLICAS:
        assert batchnorm._max_difference(run, variant) < 1e-5, variant
    with pytest.raises(AssertionError, match=r"'synced': 1"):
        batchnorm.check_replicas(run)


@pytest.fixture(scope="module")
def epoch_start_runs() -> dict[str, dict]:
    """The epoch-start job on 2 devices: upstream's run (the file's reference: the fix
    changes no number), and a run per fault with the fix."""
    jobs = {
        "upstream": (lambda: epoch_start.run(2, exclude=epoch_start.FIX),),
        "nan": (lambda: epoch_start.run_job(2, **FAULT["nan"]),),
        "one_device": (lambda: epoch_start.run_job(2, **FAULT["one_device"]),),
    }
    return two_at_a_time(lambda job: job(), jobs)


@pytest.mark.slow
@pytest.mark.devices
def test_each_fault_in_the_epoch_start_job_fails_that_files_checks(epoch_start_runs):
    upstream = epoch_start_runs["upstream"]
    nan = epoch_start_runs["nan"]
    epoch_start.check_topology(nan, 2)
    with pytest.raises(NotEquivalent, match="non-finite"):
        epoch_start.check_training_unchanged(upstream, nan)
    with pytest.raises(AssertionError, match=r"'replicas': 1"):
        epoch_start.check_topology(epoch_start_runs["one_device"], 2)


@pytest.fixture(scope="module")
def fit_runs() -> dict[str, dict]:
    """fit_equivalence.py as tests/test_distribute.py runs it."""
    jobs = {
        "reference": (1, {}),
        "nan": (2, FAULT["nan"]),
        "outside": (2, FAULT["outside"]),
    }
    return two_at_a_time(lambda devices, env: distribute.run_fit(devices, **env), jobs)


@pytest.mark.slow
@pytest.mark.devices
def test_each_fault_in_the_fit_job_fails_that_files_checks(fit_runs):
    reference = fit_runs["reference"]
    distribute.check_fit_topology(reference, 1)

    nan = fit_runs["nan"]
    distribute.check_fit_topology(nan, 2)
    with pytest.raises(NotEquivalent, match="non-finite"):
        distribute.check_fit_weights(reference, nan, 2)
    # One device's numbers, in a process on 2: only the model's variables tell.
    outside = fit_runs["outside"]
    distribute.check_fit_weights(reference, outside, 2)
    assert (outside["replicas"], outside["strategy"]) == (2, "MirroredStrategy")
    with pytest.raises(AssertionError, match=r"\(2, 'MirroredStrategy', '(?!MirroredVariable)"):
        distribute.check_fit_topology(outside, 2)


@pytest.fixture(scope="module")
def jit_compile_runs() -> dict[str, dict]:
    """The jit_compile job on TensorFlow."""
    jobs = {
        "reference": ("1 device", {}),
        "nan": ("2 devices", FAULT["nan"]),
        "one_device": ("2 devices", FAULT["one_device"]),
    }
    return two_at_a_time(lambda topology, env: jit_compile._run(topology, **env), jobs)


@pytest.mark.slow
@pytest.mark.devices
def test_each_fault_in_the_jit_compile_job_fails_that_files_checks(jit_compile_runs):
    reference = jit_compile_runs["reference"]
    jit_compile.check_topology(reference, 1, 1)

    nan = jit_compile_runs["nan"]
    jit_compile.check_topology(nan, 2, 1)
    with pytest.raises(NotEquivalent, match="non-finite"):
        jit_compile.check_refused(nan, reference, 2)
    run = jit_compile_runs["one_device"]
    equivalence.assert_close(reference["predictions"], run["predictions"], 1e-5)
    with pytest.raises(AssertionError, match=r"'replicas': 1"):
        jit_compile.check_topology(run, 2, 1)


def test_the_mnist_rule_is_only_conftests():
    """Every test that reads MNIST says so with @pytest.mark.mnist (tests/conftest.py
    skips it, or fails it in CI); no test file guards MNIST its own way."""
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            guard = "skipif" in line or "pytest.skip(" in line
            assert not (guard and ("MNIST" in line or "TFDS" in line)), f"{path.name}:{number}"
