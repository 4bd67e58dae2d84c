"""tfdist.core.config and tfdist.core.validate: precedence, parsing, and the one error rule."""

from __future__ import annotations

import json
import math

import pytest

from tfdist.core import config, validate


def test_argument_wins_over_environment_wins_over_default():
    env = {"TFDIST_CPU_DEVICES": "2"}
    assert config.cpu_devices(4, environ=env) == 4
    assert config.cpu_devices(environ=env) == 2
    assert config.cpu_devices(environ={}) is None
    timeouts = config.MultiWorkerTimeouts.from_env({"TFDIST_REGISTER_TIMEOUT": "12"})
    assert (timeouts.register, timeouts.heartbeat) == (12.0, 10.0)


@pytest.mark.parametrize("text", ["0", "-1", "two", "1.5"])
def test_bad_environment_values_are_config_errors_naming_the_variable(text):
    with pytest.raises(config.ConfigError, match=rf"TFDIST_CPU_DEVICES='{text}'"):
        config.cpu_devices(environ={"TFDIST_CPU_DEVICES": text})


def test_launch_python_argument_then_environment_then_the_launchers_own(tmp_path, monkeypatch):
    import sys

    from tfdist.launch import LaunchOptions
    from tfdist.launch.environment import worker_command

    wrapper = tmp_path / "py"
    wrapper.write_text('#!/bin/sh\nexec python3 "$@"\n')
    wrapper.chmod(0o755)
    assert config.launch_python(environ={}) == sys.executable
    assert config.launch_python(environ={"TFDIST_LAUNCH_PYTHON": str(wrapper)}) == str(wrapper)
    assert config.launch_python("/x/py", environ={"TFDIST_LAUNCH_PYTHON": str(wrapper)}) == "/x/py"
    with pytest.raises(config.ConfigError, match=r"TFDIST_LAUNCH_PYTHON='/no/such/python'.*Unset"):
        config.launch_python(environ={"TFDIST_LAUNCH_PYTHON": "/no/such/python"})
    with pytest.raises(TypeError, match="python"):
        config.launch_python(3)  # type: ignore[arg-type]
    monkeypatch.setenv("TFDIST_LAUNCH_PYTHON", str(wrapper))
    command = worker_command(LaunchOptions(nproc=2, target="train.py"))
    assert command == [str(wrapper), "-m", "tfdist.bootstrap", "train.py"]


def test_config_error_is_a_value_error():
    assert issubclass(config.ConfigError, ValueError)


def test_restart_count_and_slurm_port_base():
    assert config.restart_count({}) == 0
    assert config.restart_count({"TFDIST_RESTART": "0"}) == 0  # a launcher's first start
    assert config.restart_count({"TFDIST_RESTART": "3"}) == 3
    assert config.slurm_port_base({"SLURM_JOB_ID": "40123"}) == 20000 + 40123 % 625 * 64
    # Jobs sharing a node: neighbouring ids get disjoint windows of 64 ports.
    bases = [config.slurm_port_base({"SLURM_JOB_ID": str(job)}) for job in range(1000, 1625)]
    assert len(set(bases)) == 625 and min(bases) >= 20000 and max(bases) + 64 <= 60000
    assert min(b - a for a, b in zip(sorted(bases), sorted(bases)[1:], strict=False)) == 64
    assert config.slurm_port_base({"TFDIST_SLURM_PORT_BASE": "31000"}) == 31000
    with pytest.raises(config.ConfigError, match="TFDIST_SLURM_PORT_BASE"):
        config.slurm_port_base({"TFDIST_SLURM_PORT_BASE": "80"})


def test_compat_exclude_is_a_comma_separated_list():
    assert config.compat_exclude({"TFDIST_COMPAT_EXCLUDE": " a, ,b "}) == ["a", "b"]
    assert config.compat_exclude({}) == []


def test_keras_backend_is_found_like_keras_finds_it(tmp_path):
    assert config.keras_backend({"KERAS_BACKEND": "jax"}) == "jax"
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "jax"}))
    assert config.keras_backend({"KERAS_HOME": str(tmp_path)}) == "jax"
    assert config.keras_backend({"KERAS_HOME": str(tmp_path / "none")}) == "tensorflow"


@pytest.mark.parametrize(
    ("value", "error"),
    [(True, TypeError), (2.0, TypeError), ("2", TypeError), (0, ValueError), (-1, ValueError)],
)
def test_positive_int_rule(value, error):
    with pytest.raises(error, match=r"^f: n must be a positive int\. Received: n="):
        validate.positive_int(value, "n", "f")


@pytest.mark.parametrize(
    ("value", "error"),
    [(True, TypeError), ("1", TypeError), (0, ValueError), (math.nan, ValueError)],
)
def test_positive_number_rule(value, error):
    with pytest.raises(error, match=r"f: t must be a positive number\. Received: t="):
        validate.positive_number(value, "t", "f", "Pass seconds.")


def test_messages_echo_the_value_and_say_what_to_do():
    with pytest.raises(ValueError) as info:
        validate.one_of("fats", ("fast", "tutorial"), "recipe", "train", "Use --recipe fast.")
    assert str(info.value) == (
        "train: recipe must be one of ('fast', 'tutorial'). Received: recipe='fats'. "
        "Use --recipe fast."
    )
    with pytest.raises(TypeError, match="a path"):
        validate.path_text(3, "path", "save")
    with pytest.raises(ValueError, match="a non-empty path"):
        validate.path_text(" ", "path", "save")


def test_the_jax_stall_watchdog_has_its_own_knob_and_its_default_is_unchanged(recwarn):
    assert config.jax_stall_timeout(environ={}) == config.JAX_STALL_TIMEOUT_DEFAULT == 45.0
    new = config.JAX_STALL_TIMEOUT_ENV
    assert config.jax_stall_timeout(environ={new: "12"}) == 12.0
    assert config.jax_stall_timeout(environ={new: "off"}) is None
    assert config.jax_stall_timeout(7, environ={new: "12"}) == 7.0
    # The new name wins over the old one, silently.
    assert config.jax_stall_timeout(environ={new: "12", "TFDIST_COLLECTIVE_TIMEOUT": "3"}) == 12
    with pytest.raises(config.ConfigError, match=r"Received: TFDIST_JAX_STALL_TIMEOUT='-2'"):
        config.jax_stall_timeout(environ={new: "-2"})
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_the_old_name_still_sets_the_jax_stall_watchdog_with_a_deprecation_line():
    old = {"TFDIST_COLLECTIVE_TIMEOUT": "30"}
    with pytest.warns(FutureWarning, match=r"set TFDIST_JAX_STALL_TIMEOUT=30 instead") as seen:
        assert config.jax_stall_timeout(environ=old) == 30.0
    assert len(seen) == 1 and "TFDIST_COLLECTIVE_TIMEOUT" in str(seen[0].message)
    with pytest.warns(FutureWarning):
        assert config.jax_stall_timeout(environ={"TFDIST_COLLECTIVE_TIMEOUT": "0"}) is None
    # TensorFlow's per-op limit reads the old name as before, without a warning.
    assert config.MultiWorkerTimeouts.from_env(old).collective == 30.0
