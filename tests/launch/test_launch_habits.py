"""`tfdist launch` with torchrun's habits, and quiet by default (issue 14 items 2, 5, 6).

torchrun's variables and Keras's (JAX) in each worker's environment, --nproc-per-node,
--standalone, --log-dir/--tee, --config/--write-config, the noise filter and progress-bar
redraws on pipes, and every option's help naming its default. Worker scripts here do not
import TensorFlow, so each real launch takes about a second.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from tfdist import launch
from tfdist.cli import build_parser, launch_config, main
from tfdist.cli import launch as launch_command
from tfdist.core import cluster
from tfdist.launch import LaunchOptions
from tfdist.launch.workers import Route, prefix_lines

from conftest import REPO, child_env

HARMLESS = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "E0000 00:00:1.0 1 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: "
    "Failed call to cuInit: UNKNOWN ERROR (303)",
    "WARNING:tensorflow:Using CollectiveAllReduceStrategy eagerly has significant overhead "
    "currently.",
    "W0000 00:00:1.0 1 dataset.cc:997] Input of GeneratorDatasetOp::Dataset will not be "
    "optimized because the dataset does not implement the AsGraphDefInternal() method",
    "INFO:tensorflow:Collective all_reduce tensors: 1 all_reduces, num_devices = 2, "
    "Reduce to /job:worker/replica:0/task:0/device:CPU:0 then broadcast to "
    "('/job:worker/replica:0/task:0/device:CPU:0',).",
]
REAL = [
    "E0000 00:00:1.0 1 coordination_service.cc:1] The following tasks are unhealthy "
    "(stopped sending heartbeats): /job:worker/replica:0/task:1",
    "ValueError: Input 0 of layer dense is incompatible with the layer",
]
WARNING = (
    "/x/epoch_iterator.py:74: UserWarning: `shuffle=True` was passed, but will be ignored "
    "since the data `x` was provided as a tf.data.Dataset.\n"
    "  self.data_adapter = data_adapters.get_data_adapter(\n"
)


# ------------------------------------------------------------------ environment


def test_workers_get_torchrun_and_keras_distribution_variables():
    opts = LaunchOptions(
        nproc=2, target="t.py", nnodes=2, node_rank=1, port=7000,
        hosts=("127.0.0.1", "127.0.0.2"),
    )  # fmt: skip
    addresses = launch.cluster_addresses(opts)
    envs = launch.worker_envs(opts, addresses, environ={})
    for local, (rank, env) in enumerate(zip((2, 3), envs, strict=True)):
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(local))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("4", "2")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "7000")
        assert env["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == ",".join(addresses)
        assert env["KERAS_DISTRIBUTION_NUM_PROCESSES"] == "4"
        assert env["KERAS_DISTRIBUTION_PROCESS_ID"] == str(rank)
        # Keras's variables alone describe the same cluster as TF_CONFIG.
        from_tf = cluster.cluster_from_env(env)
        keras_only = {k: v for k, v in env.items() if k != "TF_CONFIG"}
        from_keras = cluster.cluster_from_env(keras_only)
        assert from_keras.addresses == from_tf.addresses == tuple(addresses)
        assert from_keras.task_index == from_tf.task_index == rank


def test_workers_get_tf_cpp_min_log_level_2_unless_verbose_or_set():
    addresses = ["127.0.0.1:1"]
    quiet = launch.worker_envs(LaunchOptions(nproc=1, target="t.py"), addresses, environ={})
    assert quiet[0]["TF_CPP_MIN_LOG_LEVEL"] == "2"
    verbose = LaunchOptions(nproc=1, target="t.py", verbose=True)
    assert "TF_CPP_MIN_LOG_LEVEL" not in launch.worker_envs(verbose, addresses, environ={})[0]
    chosen = {"TF_CPP_MIN_LOG_LEVEL": "0"}
    opts = LaunchOptions(nproc=1, target="t.py")
    assert launch.worker_envs(opts, addresses, environ=chosen)[0]["TF_CPP_MIN_LOG_LEVEL"] == "0"


# ------------------------------------------------------------------ output: filter, redraws


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _copy(data: str, stream, route: Route) -> str:
    read, write = os.pipe()
    os.write(write, data.encode())
    os.close(write)
    prefix_lines(os.fdopen(read, "rb"), stream, "[w0] ", threading.Lock(), route=route)
    return stream.getvalue()


def test_harmless_lines_are_dropped_real_problems_kept_and_verbose_keeps_all():
    data = "\n".join(HARMLESS + REAL) + "\n" + WARNING + "real output\n"
    shown = _copy(data, io.StringIO(), Route(verbose=False))
    assert shown == "".join(f"[w0] {line}\n" for line in [*REAL, "real output"])
    everything = _copy(data, io.StringIO(), Route(verbose=True))
    assert everything.count("[w0] ") == len(HARMLESS) + len(REAL) + 3


def test_progress_redraws_reach_a_terminal_but_not_a_pipe_or_a_log():
    bar = "1/2 [==>..]\b\b\b\r2/2 [=====]\n"
    assert _copy(bar, _Terminal(), Route()) == "[w0] 1/2 [==>..]\b\b\b\r[w0] 2/2 [=====]\n"
    assert _copy(bar, io.StringIO(), Route()) == "[w0] 2/2 [=====]\n"
    log = io.StringIO()
    assert _copy(bar, io.StringIO(), Route(console=False, log=log)) == ""
    assert log.getvalue() == "2/2 [=====]\n"


# ------------------------------------------------------------------ real launches

WORKER = """\
import os, sys
print("RANK", os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"])
print({harmless!r}, file=sys.stderr)
print({real!r}, file=sys.stderr)
"""


def _launch(tmp_path, *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "worker.py"
    path.write_text(WORKER.format(harmless=HARMLESS[1], real=REAL[0]))
    out, err = io.StringIO(), io.StringIO()
    argv = ["launch", "--no-fixes", *flags, str(path)]
    args = build_parser().parse_args(argv)
    args = launch_config.with_config(build_parser(), args, argv)
    code = launch.run(launch_command.launch_options(args), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_nproc_per_node_and_standalone_start_the_workers(tmp_path):
    code, out, err = _launch(tmp_path, "--standalone", "--nproc-per-node", "2")
    assert code == 0
    assert sorted(out.splitlines()) == ["[w0] RANK 0 0 2", "[w1] RANK 1 1 2"]
    assert f"[w0] {REAL[0]}" in err and HARMLESS[1] not in err


def test_log_dir_writes_every_line_and_tee_also_prints(tmp_path):
    logs = tmp_path / "logs"
    code, out, err = _launch(tmp_path, "-n", "2", "--log-dir", str(logs))
    assert code == 0 and out == "" and err == ""
    for rank in (0, 1):
        text = (logs / f"worker-{rank}.log").read_text()
        # stdout and stderr are read by two threads: lines of the two may interleave.
        assert sorted(text.splitlines()) == sorted([f"RANK {rank} {rank} 2", HARMLESS[1], REAL[0]])
    code, out, err = _launch(tmp_path, "-n", "2", "--log-dir", str(logs), "--tee")
    assert code == 0 and "[w1] RANK 1 1 2" in out and f"[w1] {REAL[0]}" in err
    assert "RANK 1 1 2\n" in (logs / "worker-1.log").read_text()


def test_verbose_shows_the_noise(tmp_path):
    code, _, err = _launch(tmp_path, "-n", "1", "--verbose")
    assert code == 0 and f"[w0] {HARMLESS[1]}" in err


# ------------------------------------------------------------------ CLI


@pytest.mark.parametrize(
    ("value", "visible", "expected"),
    [("3", "", 3), ("auto", "", 1), ("auto", "0,1", 2), ("gpu", "0,1,2", 3)],
)
def test_nproc_per_node_numbers_auto_and_gpu(monkeypatch, value, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    args = build_parser().parse_args(["launch", "--nproc-per-node", value, "t.py"])
    assert launch_command.launch_options(args).nproc == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc-per-node", "gpu"], "--nproc-per-node gpu needs a GPU"),
        (["--standalone", "--hosts", "127.0.0.1,127.0.0.2"], "--standalone runs a single-node"),
        (["-n", "1", "--tee"], "tee must be False without log_dir"),
    ],
)
def test_contradictory_launch_flags_are_one_line_errors(monkeypatch, capsys, argv, message):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["launch", *argv, "t.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tfdist launch: error: ") and message in err and err.count("\n") == 1


def test_nproc_per_node_rejects_other_words(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--nproc-per-node", "many", "t.py"])
    assert "must be an int, auto or gpu" in capsys.readouterr().err


def _parsed(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    return launch_config.with_config(parser, parser.parse_args(argv), argv)


def test_config_file_sets_options_and_flags_override_it(tmp_path):
    config = tmp_path / "launch.toml"
    config.write_text('nproc-per-node = 2\nmax_restarts = 3\nlog-dir = "logs"\ntee = true\n')
    args = _parsed(["launch", "--config", str(config), "--max-restarts", "1", "t.py"])
    assert (args.nproc, args.max_restarts, args.log_dir, args.tee) == (2, 1, "logs", True)
    written = tmp_path / "written.toml"
    assert main(["launch", "--config", str(config), "-n", "4", "--write-config", str(written)]) == 0
    again = _parsed(["launch", "--config", str(written), "t.py"])
    assert (again.nproc, again.max_restarts, again.log_dir, again.tee) == (4, 3, "logs", True)
    assert vars(again) | {"config": None} == vars(_parsed(["launch", "-n", "4", "t.py"])) | {
        "max_restarts": 3, "log_dir": "logs", "tee": True, "config": None,
        "launch_parser": again.launch_parser,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("workers = 2\n", "config keys must be long option names"),
        ('script = "x.py"\n', "config keys must be long option names"),
        ('tee = "yes"\n', "tee must be true or false"),
        ("nproc = [\n", "config must be a readable TOML file"),
        # A value of the wrong type: LaunchOptions's TypeError, one line too.
        ("nnodes = 1.5\n", "launch: nnodes must be a positive int. Received: nnodes=1.5"),
        ('hosts = ["127.0.0.1"]\n', "launch: hosts must be a comma-separated list"),
    ],
)
def test_bad_config_files_are_one_line_errors(tmp_path, capsys, text, message):
    config = tmp_path / "launch.toml"
    config.write_text(text)
    assert main(["launch", "--config", str(config), "t.py"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_option_has_help_that_names_its_default():
    parser = build_parser()
    launch_parser = parser.parse_args(["launch", "t.py"]).launch_parser
    for command, sub in (("tfdist", parser), ("tfdist launch", launch_parser)):
        text = sub.format_help().replace("\n", " ")
        for action in _options(sub):
            assert action.help, f"{command} {action.option_strings} has no help"
            if action.default is not argparse.SUPPRESS:
                assert "default" in sub._get_formatter()._get_help_string(action), action.dest
        assert text.count("(default") + text.count("default:") >= len(_options(sub)) - 1


def test_the_cli_itself_runs_quiet():
    code = "import os; from tfdist.cli import shared; shared.quiet_tensorflow(); "
    code += "print(os.environ['TF_CPP_MIN_LOG_LEVEL'])"
    env = {k: v for k, v in child_env().items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, timeout=60
    )
    assert proc.stdout.decode().strip() == "2", proc.stderr.decode()


def test_kill_message_matches_the_exit_status():
    from tfdist.launch import supervise

    outcome = launch.Outcome("failed", 1, -9)
    assert f"exit status {supervise.exit_code(outcome)}" in supervise.exit_meaning(-9)
    assert json.dumps(supervise.exit_meaning(-15)).count("SIGTERM") == 1


def test_launch_help_mentions_the_torchrun_flags():
    text = textwrap.dedent(
        build_parser().parse_args(["launch", "t.py"]).launch_parser.format_help()
    )
    for flag in ("--nproc-per-node", "--standalone", "--log-dir", "--tee", "--config"):
        assert flag in text


# ------------------------------------------------------------------ real frameworks

TFDIST = [sys.executable, "-c", "import sys; from tfdist.cli import main; sys.exit(main())"]
ISSUE_NOISE = (
    "This TensorFlow binary is optimized",
    "failed call to cuInit",
    "Using CollectiveAllReduceStrategy eagerly has significant overhead",
    "GeneratorDatasetOp",
    "then broadcast to",
    "All log messages before absl::InitializeLog",
)


@pytest.mark.slow
def test_a_tensorflow_job_under_launch_shows_none_of_the_known_noise(tmp_path):
    # TF_CPP_MIN_LOG_LEVEL=0: TensorFlow prints all its noise, so the filter alone must
    # hide it from the console; the unfiltered log files show it was there.
    env = child_env(TF_CPP_MIN_LOG_LEVEL="0", KERAS_BACKEND="tensorflow")
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [*TFDIST, "launch", "-n", "2", "--log-dir", str(logs)]
        + ["--tee", "tests/scripts/noise_job.py"],
        env=env, cwd=REPO, capture_output=True, timeout=300,
    )  # fmt: skip
    console = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 0, console
    assert "[w0] DONE" in console and "[w1] DONE" in console
    logged = (logs / "worker-0.log").read_text() + (logs / "worker-1.log").read_text()
    seen = [noise for noise in ISSUE_NOISE if noise in logged]
    assert len(seen) >= 3, logged  # the job did print the noise
    assert [noise for noise in ISSUE_NOISE if noise in console] == []
    # Not a terminal: the progress bar's last state only, no redraws.
    assert "\r" not in console and "Epoch 2/2" in console


@pytest.mark.jax
@pytest.mark.slow
def test_a_jax_script_that_initializes_keras_distribution_itself(tmp_path):
    path = tmp_path / "jax_init.py"
    path.write_text(
        "import jax, keras\n"
        "keras.distribution.initialize()\n"
        "print('PROCS', jax.process_count(), jax.process_index(), flush=True)\n"
    )
    # --no-fixes: only the launcher's KERAS_DISTRIBUTION_* variables tell jax the job.
    proc = subprocess.run(
        [*TFDIST, "launch", "-n", "2", "--no-fixes", str(path)],
        env=child_env(KERAS_BACKEND="jax"), cwd=REPO, capture_output=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()
    assert sorted(line for line in out.splitlines() if "PROCS" in line) == [
        "[w0] PROCS 2 0", "[w1] PROCS 2 1"
    ]  # fmt: skip


@pytest.mark.slow
def test_tfdist_info_prints_none_of_the_known_noise():
    env = child_env(TF_CPP_MIN_LOG_LEVEL=None, KERAS_BACKEND="tensorflow")
    proc = subprocess.run(
        [*TFDIST, "info"], env=env, cwd=REPO, capture_output=True, timeout=300
    )  # fmt: skip
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "strategy:" in proc.stdout.decode(), err
    assert [noise for noise in ISSUE_NOISE if noise in err] == []


def test_a_workers_last_lines_reach_a_launcher_output_read_late(tmp_path):
    """Each worker prints a 50 KB line (its pipe holds it) and exits; the launcher's
    stdout (a pipe, 64 KB) is read only after 8 s, longer than the launcher waits for a
    reader stuck on a worker's pipe (5 s). Every line still arrives whole: before, the
    launcher exited 0 with a result line cut (measured at 4.6 KB of 57 KB)."""
    script = tmp_path / "long_line.py"
    script.write_text("import os\nprint(os.environ['RANK'] * 50_000, flush=True)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfdist", "launch", "-n", "2", str(script)],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        threading.Event().wait(8)  # nobody reads the launcher's output meanwhile
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert sorted(out.decode().splitlines()) == [f"[w{r}] {str(r) * 50_000}" for r in (0, 1)]
