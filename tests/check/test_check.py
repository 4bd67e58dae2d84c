"""``tfdist check``: the corpus in tests/check/scripts/ run through the real command.

Each slow test runs ``python -m tfdist check`` on one corpus script (fresh processes per
topology, 2 workers through ``tfdist launch``) and reads its text or JSON report; the
quick ones check the command line's validation and the comparison without training.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfdist import cli
from tfdist.check import causes, compare, report, runner, topology, verdict

from conftest import REPO, child_env

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def check_cli(*argv: str, cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    """``python -m tfdist check *argv`` (run in ``cwd``), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "tfdist", "check", *argv],
        cwd=cwd,
        env=child_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _fail(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["no-such-script.py"], "script='no-such-script.py'"),
        ([], "script=None"),
        (["--steps", "0", "SCRIPT"], "--steps=0"),
        (["--topologies", "1 device,3 gpus", "SCRIPT"], "'3 gpus'"),
        (["--tolerance", "nan", "SCRIPT"], "--tolerance=nan"),
        (["--timeout", "-1", "SCRIPT"], "--timeout=-1.0"),
    ],
)
def test_bad_input_is_refused_naming_the_argument_and_what_was_received(argv, names, capsys):
    argv = [str(SCRIPTS / "correct.py") if a == "SCRIPT" else a for a in argv]
    assert cli.main(["check", *argv]) == 2
    error = capsys.readouterr().err
    assert error.startswith("tfdist check: error: check:"), error
    assert names in error and "Received:" in error


def test_a_non_number_for_steps_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["check", "--steps", "many", str(SCRIPTS / "correct.py")])
    assert exit_.value.code == 2
    assert "--steps: invalid int value: 'many'" in capsys.readouterr().err


def test_topologies_are_read_in_several_spellings_and_one_device_comes_first():
    got = topology.parse_topologies("2-workers, 2 devices,1device", "jax")
    assert [str(t) for t in got] == ["1 device", "2 processes", "2 devices"]


def test_a_nan_is_never_equal_and_a_shape_change_is_named():
    nan = compare.compare({"w": np.array([1.0])}, {"w": np.array([math.nan])})
    assert not nan.equal(1.0) and "not finite" in nan.reason
    shape = compare.compare({"w": np.zeros(2)}, {"w": np.zeros(3)})
    assert not shape.equal(1.0) and "shape" in shape.reason
    assert compare.compare({"w": np.ones(2)}, {"w": np.ones(2) + 1e-7}).equal(1e-5)


def _run(name: str, initial: float, final: float, steps_per_epoch: int = 10, ranks: int = 1):
    """A finished run as the hook would leave it: one variable ``w``, a 3-step loss."""
    which = topology.parse_topologies(name, "tensorflow")[-1]
    facts = {"steps": 3, "history": {"loss": [1.0, final, final]}, "unsynchronized": []}
    facts["steps_per_epoch"] = steps_per_epoch
    result = runner.Rank(facts, {"w": np.array([final])}, {"w": np.array([initial])})
    return runner.Run(which, 1.0, "done", 0, dict.fromkeys(range(ranks), result))


def _causes(*runs):
    reference = _run("1 device", 0.0, 0.5)
    judged = [verdict.judge(reference, r, 1e-5) for r in (reference, *runs)]
    found = causes.find(judged, reference, lambda t: pytest.fail("no re-run expected"), 1e-5)
    return judged, [c.cause for c in found]


def test_workers_that_start_from_other_weights_are_named_as_seeded_apart():
    judged, found = _causes(_run("2 devices", 0.0, 0.5), _run("2 workers", 0.3, 0.7, ranks=2))
    assert [v.status for v in judged] == ["equal", "equal", "differs"]
    assert found == ["worker_seeds"]
    text = report.render(report.Report("s.py", "tensorflow", 3, 1e-5, judged))
    assert "2 workers    DIFFERS: w by 2.0e-01 on process 0 (loss from step 2)" in text


def test_another_global_batch_or_no_seed_is_named_before_anything_else():
    _, found = _causes(_run("2 devices", 0.0, 0.9, steps_per_epoch=5))
    assert found == ["global_batch"]
    _, found = _causes(_run("2 devices", 0.2, 0.9))
    assert found == ["unseeded"]


@pytest.mark.slow
def test_a_correct_script_is_equal_on_every_topology_and_stops_after_fit(tmp_path):
    keep = tmp_path / "runs"
    proc = check_cli("--steps", "8", "--keep", str(keep), str(SCRIPTS / "correct.py"), cwd=tmp_path)
    assert proc.returncode == 0, _fail(proc)
    lines = proc.stdout.splitlines()
    assert any(line.split()[:3] == ["2", "devices", "equal"] for line in lines), proc.stdout
    assert any(line.split()[:3] == ["2", "workers", "equal"] for line in lines), proc.stdout
    assert "reference: 8 steps" in proc.stdout
    # The process ended when fit returned: the script's save after fit never ran.
    assert (keep / "1-device" / "work").is_dir()
    assert not list(keep.glob("*/work/never-written.keras"))
    for name in ("1 device", "2 devices", "2 workers"):
        assert f"tfdist check: {name}: done in" in proc.stderr


@pytest.mark.slow
def test_unsynchronized_batchnorm_is_named_and_synchronizing_it_removes_the_difference(tmp_path):
    script = str(SCRIPTS / "correct.py")
    argv = ("--steps", "8", "--topologies", "2 devices", "--json", script, "--bn", "plain")
    proc = check_cli(*argv, cwd=tmp_path)
    assert proc.returncode == 1, _fail(proc)
    report = json.loads(proc.stdout)
    assert report["topologies"][1]["status"] == "differs"
    assert report["topologies"][1]["weight_difference"] > 1e-3
    (cause,) = report["causes"]
    assert cause["cause"] == "batchnorm"
    assert "['batch_normalization']" in cause["evidence"]
    assert "2 devices with them synchronized: equal" in cause["evidence"]
    assert "sync_batchnorm=True" in cause["fix"]


@pytest.mark.slow
def test_the_synchronized_twin_is_equal_on_two_workers(tmp_path):
    argv = ("--steps", "8", "--topologies", "2 workers", str(SCRIPTS / "correct.py"))
    proc = check_cli(*argv, "--bn", "sync", cwd=tmp_path)
    assert proc.returncode == 0, _fail(proc)
    assert "likely causes" not in proc.stdout


@pytest.mark.slow
def test_workers_seeded_from_their_index_differ_where_devices_do_not(tmp_path):
    proc = check_cli("--steps", "8", str(SCRIPTS / "worker_seeds.py"), cwd=tmp_path)
    assert proc.returncode == 1, _fail(proc)
    assert any(line.split()[:3] == ["2", "devices", "equal"] for line in proc.stdout.splitlines())
    assert "2 workers    DIFFERS" in proc.stdout
    assert "worker_data: 2 devices equal but 2 workers not" in proc.stdout
    assert "keras.utils.set_random_seed(0)" in proc.stdout


@pytest.mark.slow
def test_a_barrier_only_the_chief_reaches_is_named_as_a_hang(tmp_path):
    argv = ("--topologies", "2 workers", "--timeout", "30", str(SCRIPTS / "chief_barrier.py"))
    proc = check_cli(*argv, cwd=tmp_path)
    assert proc.returncode == 1, _fail(proc)
    assert "2 workers    TIMEOUT" in proc.stdout
    assert "hang: 2 workers did not finish within" in proc.stdout
    assert 'process 0 waiting at chief_barrier.py:20: tfdist.barrier("files written")' in (
        proc.stdout
    )


@pytest.mark.slow
def test_a_script_without_fit_cannot_be_stopped_and_says_so(tmp_path):
    proc = check_cli(str(SCRIPTS / "custom_loop.py"), cwd=tmp_path)
    assert proc.returncode == 2, _fail(proc)
    assert "could not stop this script: on 1 device it ended" in proc.stdout
    assert "without calling keras.Model.fit" in proc.stdout


@pytest.mark.slow
@pytest.mark.jax
def test_a_correct_script_is_equal_on_jax_devices_and_processes(tmp_path):
    argv = ("--backend", "jax", "--steps", "8", "--json", str(SCRIPTS / "correct.py"))
    proc = check_cli(*argv, cwd=tmp_path)
    assert proc.returncode == 0, _fail(proc)
    report = json.loads(proc.stdout)
    got = {t["topology"]: t["status"] for t in report["topologies"]}
    assert got == {"1 device": "reference", "2 devices": "equal", "2 processes": "equal"}
    assert all(t["weight_difference"] <= 1e-5 for t in report["topologies"])
