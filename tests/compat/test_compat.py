"""tfdist.compat: each fix reproduces its upstream failure without it, and is right with it.

The probes (tests/scripts/mw_*_probe.py) start with nothing patched, record what
upstream does, then apply the fixes and compare with the same model trained on one
device. When a test here fails because upstream no longer fails, upstream fixed the
defect: narrow that fix's version range.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tfdist import compat, launch
from tfdist.compat import tf_fixes
from tfdist.core import config, fix_registry, process
from tfdist.core.cluster import worker_tf_config

from conftest import REPO, SCRIPTS, child_env, equivalence, last_json_line, launch_cli, run_python

TOL = 1e-5


# ------------------------------------------------------------------ registry, guards


def test_every_fix_is_named_once_and_documented():
    names = compat.fix_names()
    assert len(names) == len(set(names)) >= 11
    for fix in compat.FIXES:
        assert fix.summary and fix.apply.__doc__
        # The docstring says what changes and why it is correct, not just a title.
        assert len(fix.apply.__doc__.split()) > 60, fix.name


def test_version_parsing_reads_leading_numbers():
    assert fix_registry._version_tuple("2.21.0rc1") == (2, 21, 0)
    assert fix_registry._version_tuple("3.15.1.dev2025") == (3, 15, 1)
    assert fix_registry._version_tuple("nightly") == ()


def test_apply_all_skips_other_versions_and_excluded_fixes(monkeypatch):
    calls = []

    def fix(name, applies):
        def apply():
            calls.append(name)

        return compat.Fix(name, "test fix", lambda: applies, apply)

    monkeypatch.setattr(compat, "FIXES", [fix("a", True), fix("old", False), fix("c", True)])
    monkeypatch.setattr(compat, "HOOKS", ())  # a hook's Keras import applies the fixes again
    monkeypatch.setattr(process, "_STATE", process.ProcessState())
    assert compat.apply_all(environ={"TFDIST_COMPAT_EXCLUDE": "c"}) == ["a"]
    assert compat.apply_all(environ={}) == ["a", "c"]
    assert compat.apply_all(environ={}) == ["a", "c"]
    assert calls == ["a", "c"]  # each applied once, "old" never
    process.reset()
    assert compat.apply_all(environ={"TFDIST_COMPAT_EXCLUDE": "all"}) == []
    assert compat.apply_all(exclude=[], environ={"TFDIST_COMPAT_EXCLUDE": "all"}) == ["a", "c"]


def test_fixes_are_recorded_per_package():
    tf_only = [fix.name for fix in compat.FIXES if fix.package == "tensorflow"]
    assert tf_only == [
        "tf_numpy_of_a_distributed_scalar",
        "tf_multi_worker_timeouts",
        "tf_multi_worker_logical_cpus",
        "tf_multi_worker_auto_shard",
        "tf_distribute_partial_batch_evenly",
        "tf_multi_device_iterators_end_promptly",
        "tf_mirrored_collective_keys_apart",
    ]
    assert {fix.package for fix in compat.FIXES} == {"tensorflow", "keras"}


def test_bad_exclusions_are_named():
    with pytest.raises(TypeError, match=r"exclude must be a list .* Use exclude=\['x'\]"):
        compat.apply_all(exclude="x")
    with pytest.raises(ValueError, match=r"exclude names unknown fixes \['nope'\]"):
        compat.apply_all(exclude=["nope"])
    with pytest.raises(ValueError, match=r"TFDIST_COMPAT_EXCLUDE names unknown fixes \['typo'\]"):
        compat.apply_all(environ={"TFDIST_COMPAT_EXCLUDE": "keras_tf_multi_worker_mean, typo"})


def test_fixes_apply_to_the_installed_versions_and_are_idempotent():
    from keras.src.backend.tensorflow import optimizer, trainer
    from keras.src.callbacks import progbar_logger
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    # TF 2.21 / Keras 3.15 are covered; the keras_jax_* fixes apply under JAX only.
    tf_fixes_ = [fix for fix in compat.FIXES if not fix.name.startswith("keras_jax")]
    assert all(fix.applies() for fix in tf_fixes_)
    assert compat.apply_all() == compat.apply_all()
    assert set(compat.applied()) == {fix.name for fix in tf_fixes_}
    targets = {
        "keras_tf_symbolic_build_from_spec": (trainer.TensorFlowTrainer, "_maybe_symbolic_build"),
        "keras_tf_multi_worker_mean": (trainer, "reduce_per_replica"),
        "keras_tf_gradient_accumulation": (optimizer.TFOptimizer, "_backend_apply_gradients"),
        "keras_tf_progbar_chief_only": (progbar_logger.ProgbarLogger, "set_params"),
        "tf_multi_worker_timeouts": (cars.CollectiveAllReduceExtended, "_initialize_multi_worker"),
        "tf_multi_worker_logical_cpus": (
            cars.CollectiveAllReduceExtended,
            "_initialize_local_devices",
        ),
        "tf_multi_worker_auto_shard": (
            cars.CollectiveAllReduceExtended,
            "_experimental_distribute_dataset",
        ),
    }
    before = {name: getattr(*target) for name, target in targets.items()}
    for fix in compat.FIXES:  # again, bypassing the registry: the patch itself is idempotent
        fix.apply()
    for name, (owner, attr) in targets.items():
        patched = getattr(owner, attr)
        assert patched is before[name], name
        # One layer per fix: a fix may wrap another fix's patch, never its own.
        assert patched.__tfdist_fix__ == name
        assert getattr(patched.__wrapped__, "__tfdist_fix__", None) != name


def test_the_timeouts_fix_reads_the_strategy_plan_then_the_environment(monkeypatch):
    monkeypatch.setattr(process, "_STATE", process.ProcessState())
    monkeypatch.setenv("TFDIST_HEARTBEAT_TIMEOUT", "7")
    assert tf_fixes._timeouts() == config.MultiWorkerTimeouts(heartbeat=7)
    process.state().multi_worker_timeouts = config.MultiWorkerTimeouts(register=9)
    assert tf_fixes._timeouts() == config.MultiWorkerTimeouts(register=9)


# ------------------------------------------------------------------ the bootstrap


def test_bootstrap_usage_and_missing_script_fail_without_loading_tensorflow():
    usage = subprocess.run(
        [sys.executable, "-m", "tfdist.bootstrap"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert usage.returncode == 2 and "python -m tfdist.bootstrap SCRIPT" in usage.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "tfdist.bootstrap", "nope.py"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "cannot open file 'nope.py'" in missing.stderr


@pytest.mark.devices
def test_bootstrap_applies_the_fixes_then_runs_the_script_or_module_as_main(tmp_path):
    report = """
        import json, sys
        import tensorflow as tf
        import keras
        from tfdist import compat
        print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                          "applied": compat.applied(),
                          "cpus": len(tf.config.list_logical_devices("CPU"))}))
    """
    (tmp_path / "job.py").write_text(textwrap.dedent(report))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(textwrap.dedent(report))
    env = child_env(TFDIST_CPU_DEVICES="2")
    procs = [  # both at once: most of their time is TensorFlow's import
        subprocess.Popen(
            [sys.executable, "-m", "tfdist.bootstrap", *target, "--epochs", "3"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for target in (["job.py"], ["-m", "pkg.job"])
    ]
    try:
        outputs = [proc.communicate(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    script, module = (last_json_line(out) for out, _ in outputs)
    for result in (script, module):
        assert result["name"] == "__main__" and result["argv"][1:] == ["--epochs", "3"]
        tf_names = [n for n in compat.fix_names() if not n.startswith("keras_jax")]
        assert result["applied"] == tf_names and result["cpus"] == 2
    assert script["argv"][0] == "job.py" and script["path0"] == str(tmp_path)
    assert module["argv"][0].endswith("job.py") and module["path0"] == str(tmp_path)


# ------------------------------------------------------------------ the probes


@pytest.mark.devices
@pytest.mark.slow
@pytest.mark.upstream_failure(
    "keras_tf_symbolic_build_from_spec",
    "keras_tf_gradient_accumulation",
    "keras_tf_compile_in_model_scope",
)
def test_mirrored_upstream_failures_and_fixes():
    proc = run_python(
        f"import runpy; runpy.run_path({str(SCRIPTS / 'mw_mirrored_probe.py')!r}, "
        "run_name='__main__')",
        TFDIST_CPU_DEVICES="2",
        TFDIST_COMPAT_EXCLUDE="all",  # nothing patched at import: the probe applies them
        timeout=300,
    )
    result = last_json_line(proc.stdout)
    assert result["replicas"] == 2
    # keras_tf_symbolic_build_from_spec: upstream starts an extra pass over the data
    assert result["iterations_unfixed"] == 3 and result["iterations_fixed"] == 2
    # keras_tf_gradient_accumulation: upstream cannot run it under MirroredStrategy ...
    assert "merge_call` called while defining a new graph" in result["accumulation_unfixed"]
    # ... fixed, it equals accumulation on one device (and accumulation did something)
    assert result["accumulation_diff"] < TOL
    assert result["accumulation_differs_from_plain"] > 1e-3
    # the spec fallback for an unknown rank builds the same model
    assert result["unknown_rank_diff"] < TOL
    # keras_tf_compile_in_model_scope: compiled outside the scope, upstream makes an optimizer
    # named by a string outside it, and Adam fails; made in the model's scope, it trains
    # as one device does (weights, History, steps)
    assert "Mixing different tf.distribute.Strategy objects" in result["adam_outside_unfixed"]
    assert result["adam_outside_diff"] < TOL


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.upstream_failure(
    "keras_tf_symbolic_build_from_spec",
    "keras_tf_multi_worker_mean",
    "tf_multi_worker_logical_cpus",
    "keras_tf_progbar_chief_only",
    "keras_tf_compile_in_model_scope",
)
def test_multi_worker_upstream_failures_and_fixes():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdist",
            "launch",
            "-n",
            "2",
            "--devices-per-worker",
            "2",
            "--no-fixes",
            str(SCRIPTS / "mw_compat_probe.py"),
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=420,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-3000:]}\n{proc.stderr[-5000:]}"
    results = {}
    for line in out.splitlines():
        prefix, _, rest = line.partition(" ")
        if rest.startswith("{"):
            results[prefix] = json.loads(rest)
    assert set(results) == {"[w0]", "[w1]"}
    for result in results.values():
        errors = result["errors"]
        assert "Attempt to convert a value (PerReplica" in errors["unfixed"]
        assert (
            "Invalid reduction dimension 0 for input with 0 dimensions"
            in (errors["symbolic_build_fixed"])
        )
        # tf_multi_worker_logical_cpus: upstream ignores the 2 logical CPUs per worker
        assert result["replicas"] == 2
        equivalence.assert_within(result["diffs"], TOL)
        assert result["trained"] > 1e-3
    recompiled = [result["recompiled"] for result in results.values()]
    assert_upstream_recompile_reports_each_workers_own_loss(recompiled)
    # keras_tf_progbar_chief_only: upstream prints the epoch lines on every worker
    for worker, expect_fixed in (("[w0]", True), ("[w1]", False)):
        lines = [line for line in out.splitlines() if line.startswith(worker)]
        stages = [i for i, line in enumerate(lines) if "STAGE" in line]
        unfixed = lines[stages[0] : stages[1]]
        fixed = lines[stages[1] : stages[2]]
        assert sum("/step - loss" in line for line in unfixed) == 2
        assert sum("/step - loss" in line for line in fixed) == (2 if expect_fixed else 0)


def assert_upstream_recompile_reports_each_workers_own_loss(workers):
    """keras_tf_compile_in_model_scope: compiled again outside the scope, upstream's loss
    tracker is plain variables: each worker's History loss is its own (their mean is one
    device's), while the metric, built in the scope, and the weights are right."""
    reference = workers[0]["reference"]
    losses = [w["unfixed"]["history"]["loss"] for w in workers]
    assert min(abs(a - b) for a, b in zip(*losses, strict=True)) > 1e-3
    mean = [sum(epoch) / len(epoch) for epoch in zip(*losses, strict=True)]
    equivalence.assert_close(mean, reference["history"]["loss"], TOL)
    for worker in workers:
        unfixed = worker["unfixed"]
        equivalence.assert_close(unfixed["history"]["mae"], reference["history"]["mae"], TOL)
        equivalence.assert_close(unfixed["weights"], reference["weights"], TOL)


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.upstream_failure("tf_multi_worker_timeouts")
def test_a_peer_that_never_starts_hangs_upstream_and_fails_clearly_with_the_fix():
    def lone_worker(*bootstrap: str, **env) -> subprocess.Popen:
        ports = launch.free_ports(2)
        config = worker_tf_config([f"127.0.0.1:{p}" for p in ports], 0)
        return subprocess.Popen(
            [sys.executable, *bootstrap, str(SCRIPTS / "mw_lone.py")],
            cwd=REPO,
            env=child_env(TF_CONFIG=config, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    upstream = lone_worker(TFDIST_COMPAT_EXCLUDE="all")
    # 12 s: one progress line (every 10 s) before the timeout.
    fixed = lone_worker("-m", "tfdist.bootstrap", TFDIST_REGISTER_TIMEOUT="12")
    try:
        out, _ = fixed.communicate(timeout=240)
        # Started first and given at least as long, upstream is still waiting for task 1.
        still_waiting = upstream.poll() is None
    finally:
        upstream.kill()
        fixed.kill()
        upstream.communicate(timeout=30)
    assert still_waiting
    assert fixed.returncode == 3
    error = next(line for line in out.splitlines() if line.startswith("ERROR"))
    assert "DeadlineExceededError" in error and "/job:worker/replica:0/task:1" in error
    # One line, naming the task and its address, saying what to do.
    assert error.count("task:") == 1 and "TFDIST_REGISTER_TIMEOUT" in error
    progress = [line for line in out.splitlines() if "waiting 10 s for" in line]
    assert len(progress) == 1 and "/job:worker/replica:0/task:1 (127.0.0.1:" in progress[0]


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_or_sigint_to_the_group_ends_the_start_up_wait_at_once(signum):
    """TensorFlow's preemption notifier holds the worker's SIGTERM during the wait; a
    SIGTERM or SIGINT (Ctrl-C) to its process group (what tfdist launch, a terminal and
    SLURM send) ends the wait within seconds, saying so, instead of after the 120 s
    timeout."""
    ports = launch.free_ports(2)
    config = worker_tf_config([f"127.0.0.1:{p}" for p in ports], 0)
    worker = subprocess.Popen(
        [sys.executable, "-m", "tfdist.bootstrap", str(SCRIPTS / "mw_lone.py")],
        cwd=REPO,
        env=child_env(TF_CONFIG=config, TFDIST_REGISTER_TIMEOUT="120"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        seen = []
        for line in worker.stdout:  # the first progress line: the worker is in the wait
            seen.append(line)
            if "waiting 10 s for" in line:
                break
        assert worker.poll() is None, "".join(seen)
        os.killpg(worker.pid, signum)
        # Well before the 120 s register timeout, or communicate raises.
        rest, _ = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert "ERROR" not in rest
    if worker.returncode == -signum:  # the signal's default action ended the worker itself
        return
    assert worker.returncode == -signal.SIGKILL  # the watcher ended it, not the timeout
    name = signal.Signals(signum).name
    assert f"worker 0 got {name} while waiting for the other workers; ending it." in rest


@pytest.mark.multiworker
def test_a_one_worker_job_whose_script_builds_its_strategy_gets_its_logical_cpus():
    """``tfdist launch -n 1 --devices-per-worker 2`` of a script whose first TensorFlow
    work is ``tf.distribute.MultiWorkerMirroredStrategy()``: 2 replicas (the strategy used
    to copy the device configuration before tfdist split the CPU: "TFDIST_CPU_DEVICES=2
    but TensorFlow has 1 logical CPU device(s)")."""
    proc = launch_cli("-n", "1", "--devices-per-worker", "2", str(SCRIPTS / "mw_lone.py"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[w0] READY 2" in proc.stdout, proc.stdout[-3000:]
