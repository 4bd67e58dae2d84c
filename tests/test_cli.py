"""The ``tfdist`` command's error contract: a ConfigError is one line and exit code 2;
anything else is a bug or an unexpected failure and keeps its traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tfdist import cli
from tfdist.cli import launch as launch_command
from tfdist.core.config import ConfigError

from conftest import REPO, child_env


def _failing_launch(monkeypatch, error: BaseException) -> None:
    def fail(_args):
        raise error

    monkeypatch.setattr(launch_command, "run", fail)  # build_parser binds it at each main()


def test_a_config_error_is_one_line_and_exit_code_2(monkeypatch, capsys):
    _failing_launch(monkeypatch, ConfigError("launch: nproc must be a positive int."))
    assert cli.main(["launch", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err == "tfdist launch: error: launch: nproc must be a positive int.\n"


@pytest.mark.parametrize("error", [ValueError("bug"), TypeError("bug"), RuntimeError("bug")])
def test_any_other_error_is_not_swallowed(monkeypatch, capsys, error):
    _failing_launch(monkeypatch, error)
    with pytest.raises(type(error), match="bug"):
        cli.main(["launch", "t.py"])
    assert capsys.readouterr().err == ""


def test_an_unexpected_error_prints_its_traceback():
    code = """
        from tfdist import cli
        from tfdist.cli import launch
        def fail(_args):
            raise RuntimeError("something unexpected")
        launch.run = fail
        cli.console_main()
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), "launch", "t.py"],
        env=child_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().endswith("RuntimeError: something unexpected")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["launch", "-n", "0", "t.py"], "nproc must be a positive int. Received: nproc=0"),
        (["launch", "--max-restarts", "-1", "t.py"], "max_restarts must be a non-negative int"),
        (["launch", "--grace", "0", "t.py"], "grace must be a positive number of seconds"),
        (["launch", "--nnodes", "2", "--hosts", "127.0.0.1", "t.py"], "one address per node (2)"),
    ],
)
def test_bad_launch_flags_are_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tfdist launch: error: launch: ") and message in err
    assert err.count("\n") == 1


def test_importing_the_cli_and_the_launcher_stays_light():
    code = """
        import sys
        import tfdist.cli, tfdist.launch
        heavy = [m for m in ("tensorflow", "keras", "jax", "numpy") if m in sys.modules]
        print("HEAVY", heavy)
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "HEAVY []", proc.stderr
