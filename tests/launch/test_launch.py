"""tfdist.launch and `tfdist launch`: options, child environments, and the supervisor.

The supervisor tests run real processes, but TensorFlow-free worker scripts (written
to tmp_path), so they take seconds; tests/e2e/test_multiworker.py runs TensorFlow workers.
"""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import warm_start

from tfdist import launch
from tfdist.cli import build_parser, main
from tfdist.core.config import ConfigError
from tfdist.launch import LaunchOptions, Outcome, namespace, network, supervise
from tfdist.launch.supervise import Phase

from conftest import REPO, child_env, launch_cli

# Every worker script starts with this: who am I, and a line the tests can wait for.
HEADER = """\
import json, os, signal, sys, time
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
restart = int(os.environ["TFDIST_RESTART"])
print("READY", rank, os.getpid(), flush=True)
"""


def script(tmp_path, body: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    return str(path)


def run(tmp_path, body: str, **options):
    """Runs the launcher in this process; returns (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    opts = LaunchOptions(
        nproc=options.pop("nproc", 2), target=script(tmp_path, body), fixes=False, **options
    )
    code = launch.run(opts, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def launch_log():
    """Messages of the tfdist.launch logger (a handler on it sees them whatever else is set)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("tfdist.launch")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)
    log.setLevel(level)


def start_cli(*argv: str) -> subprocess.Popen:
    """`python -m tfdist launch ...` in a subprocess (its own signal handlers, stdout piped)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tfdist", "launch", *argv],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


class Lines:
    """Reads a process's output in a thread, so a test can wait for a line with a timeout."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.seen, self._queue = proc, [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, *needles: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not all(any(n in line for line in self.seen) for n in needles):
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"never saw {needles}; output:\n{''.join(self.seen)[-3000:]}")
            self.seen.append(line)

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        code = self.proc.wait(timeout=timeout)
        while (line := self._queue.get(timeout=10)) is not None:
            self.seen.append(line)
        return code, "".join(self.seen)


def gone(pid: int, timeout: float = 15) -> bool:
    """True once ``pid`` has exited (a zombie waiting for its reaper counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if os.path.isdir("/proc"):
                with open(f"/proc/{pid}/stat") as stat:
                    if stat.read().rpartition(")")[2].split()[0] == "Z":
                        return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------ options, pure functions


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nproc": 0}, r"nproc must be a positive int\. Received: nproc=0"),
        ({"nproc": 2, "max_restarts": -1}, r"max_restarts must be a non-negative int.*=-1"),
        ({"nproc": 2, "devices_per_worker": 0}, r"devices_per_worker must be a positive int"),
        ({"nproc": 2, "port": 80}, r"port must be an int in \[1024, .*Received: port=80"),
        (
            {"nproc": 1, "nnodes": 2, "node_rank": 2, "port": 2222},
            r"node_rank must be an int in \[0, nnodes=2\)",
        ),
        ({"nproc": 1, "nnodes": 2, "hosts": ("127.0.0.1",), "port": 2222}, r"one address per"),
        ({"nproc": 1, "nnodes": 2, "hosts": ("127.0.0.1", "127.0.0.1")}, r"needs fixed ports"),
        ({"nproc": 1, "grace": 0}, r"grace must be a positive number of seconds"),
        ({"nproc": 1, "target": ""}, r"target must be a script path or module name"),
    ],
)
def test_bad_options_are_config_errors_named_and_echoed(kwargs, match):
    kwargs.setdefault("target", "train.py")
    with pytest.raises(ConfigError, match=match):
        LaunchOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nproc": "2"}, r"nproc must be a positive int\. Received: nproc='2'"),
        ({"nproc": True}, r"nproc must be a positive int"),
        ({"nproc": 1, "args": "--epochs 3"}, r"args must be a sequence of strings"),
        ({"nproc": 1, "target": None}, r"target must be a script path"),
        ({"nproc": 1, "grace": "1"}, r"grace must be a positive number of seconds"),
        ({"nproc": 1, "hosts": (None,)}, r"hosts must be a sequence of"),
    ],
)
def test_options_of_the_wrong_type_are_type_errors(kwargs, match):
    kwargs.setdefault("target", "train.py")
    with pytest.raises(TypeError, match=match):
        LaunchOptions(**kwargs)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ({"nproc": 2, "target": None}, r"missing the script to run\. Received: no SCRIPT"),
        ({"nproc": "gpu", "target": "t.py"}, r"--nproc-per-node gpu needs a GPU"),
        (
            {"nproc": 1, "target": "t.py", "standalone": True, "nnodes": 2},
            r"--standalone runs a single-node job on loopback\. Received: nnodes=2, hosts=None",
        ),
        (
            {"nproc": 1, "target": "t.py", "standalone": True, "hosts": "127.0.0.1"},
            r"--standalone runs a single-node job",
        ),
        ({"nproc": 1, "target": "t.py", "hosts": "127.0.0.1", "nnodes": 2}, r"one address per"),
        ({"nproc": 0, "target": "t.py"}, r"nproc must be a positive int\. Received: nproc=0"),
    ],
)
def test_the_flags_are_checked_by_launch_options(monkeypatch, flags, match):
    # tfdist launch's flags reach LaunchOptions.from_flags unchecked: it is the one check.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match=match):
        LaunchOptions.from_flags(**flags)


def test_the_flags_default_the_nodes_from_the_hosts_and_read_auto():
    opts = LaunchOptions.from_flags(
        nproc="auto", target="t.py", hosts=" 127.0.0.1:7000, 127.0.0.2:7000", allow_remote=True
    )
    assert (opts.nnodes, opts.hosts) == (2, ("127.0.0.1:7000", "127.0.0.2:7000"))
    assert opts.nproc == (len(launch.visible_gpus()) or 1)
    assert LaunchOptions.from_flags(nproc=1, target="t.py", nnodes=1).hosts == ("127.0.0.1",)
    with pytest.raises(TypeError, match=r"hosts must be a comma-separated list.*hosts=5"):
        LaunchOptions.from_flags(nproc=1, target="t.py", hosts=5)
    with pytest.raises(TypeError, match=r"nnodes must be a positive int\. Received: nnodes=1.5"):
        LaunchOptions.from_flags(nproc=1, target="t.py", nnodes=1.5)


def test_options_are_normalized_and_frozen():
    opts = LaunchOptions(nproc=2, target="t.py", args=["-x"], hosts="127.0.0.1", grace=1)
    assert opts.args == ("-x",) and opts.hosts == ("127.0.0.1",) and opts.grace == 1.0
    assert LaunchOptions(nproc=1, target="t.py", finish_timeout=float("inf")).finish_timeout
    with pytest.raises(AttributeError):
        opts.nproc = 3


def test_non_loopback_hosts_need_an_explicit_flag():
    hosts = ("10.0.0.1", "10.0.0.2")
    with pytest.raises(
        ValueError, match=r"\['10.0.0.1', '10.0.0.2'\] are not loopback.*--allow-remote"
    ):
        LaunchOptions(nproc=1, target="t.py", nnodes=2, hosts=hosts, port=2222)
    opts = LaunchOptions(
        nproc=1, target="t.py", nnodes=2, hosts=hosts, port=2222, allow_remote=True
    )
    assert launch.cluster_addresses(opts) == ["10.0.0.1:2222", "10.0.0.2:2222"]
    # loopback spellings need no flag
    LaunchOptions(
        nproc=1, target="t.py", nnodes=3, hosts=("localhost", "127.0.0.2", "::1"), port=2222
    )


def test_free_ports_are_distinct_loopback_ports():
    ports = launch.free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:  # free right now on 127.0.0.1
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    with pytest.raises(ValueError, match="loopback"):
        launch.free_ports(1, host="10.0.0.1")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0,2", ["0", "2"]), ("", []), ("-1", []), ("0,-1,2", ["0"]), (" 1 , 3 ", ["1", "3"])],
)
def test_visible_gpus_follow_cuda_visible_devices(value, expected):
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": value}) == expected


def test_cluster_addresses_single_node_multi_node_and_per_host_ports():
    two = LaunchOptions(nproc=2, target="t.py")
    assert launch.cluster_addresses(two, [5001, 5002]) == ["127.0.0.1:5001", "127.0.0.1:5002"]
    with pytest.raises(ValueError, match="ports must list 2 ports"):
        launch.cluster_addresses(two, [5001])
    nodes = LaunchOptions(
        nproc=2, target="t.py", nnodes=2, hosts=("a", "b"), port=7000, allow_remote=True
    )
    assert launch.cluster_addresses(nodes) == ["a:7000", "a:7001", "b:7000", "b:7001"]
    per_host = LaunchOptions(
        nproc=1, target="t.py", nnodes=2, hosts=("127.0.0.1:7100", "127.0.0.1:7200")
    )
    assert launch.cluster_addresses(per_host) == ["127.0.0.1:7100", "127.0.0.1:7200"]


def test_worker_envs_give_each_rank_its_tf_config_and_cpu_devices():
    opts = LaunchOptions(
        nproc=2, target="t.py", devices_per_worker=3, nnodes=2, node_rank=1, port=7000,
        hosts=("127.0.0.1", "127.0.0.2"),
    )  # fmt: skip
    addresses = launch.cluster_addresses(opts)
    parent = {"PATH": "/bin", "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8"}
    envs = launch.worker_envs(opts, addresses, environ=parent, restart=2)
    configs = [json.loads(env["TF_CONFIG"]) for env in envs]
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in (2, 3)]
    assert configs[0]["cluster"] == {"worker": addresses}
    for env in envs:
        assert env["TFDIST_CPU_DEVICES"] == "3" and env["TFDIST_RESTART"] == "2"
        assert env["PYTHONUNBUFFERED"] == "1" and env["PATH"] == "/bin"
        assert "SLURM_PROCID" not in env and "SLURM_STEP_NUM_TASKS" not in env
    assert parent == {"PATH": "/bin", "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8"}
    with pytest.raises(ValueError, match="addresses must list all 4 workers"):
        launch.worker_envs(opts, addresses[:2], environ=parent)


def test_workers_on_one_node_share_its_cores_for_tensorflow_intra_op_threads():
    from tfdist.launch import environment

    cores = len(os.sched_getaffinity(0))
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    two = LaunchOptions(nproc=2, target="t.py")
    envs = launch.worker_envs(two, addresses, environ={})
    assert [e["TF_NUM_INTRAOP_THREADS"] for e in envs] == [str(max(1, cores // 2))] * 2
    mine = launch.worker_envs(two, addresses, environ={"TF_NUM_INTRAOP_THREADS": "7"})
    assert [e["TF_NUM_INTRAOP_THREADS"] for e in mine] == ["7", "7"]  # the user's value
    alone = launch.worker_envs(LaunchOptions(nproc=1, target="t.py"), addresses[:1], environ={})
    assert "TF_NUM_INTRAOP_THREADS" not in alone[0]  # TensorFlow's own default
    assert environment.intra_op_threads(cores * 4) == 1


def test_worker_envs_split_the_visible_gpus():
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    four = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "TFDIST_CPU_DEVICES": "4"}
    envs = launch.worker_envs(LaunchOptions(nproc=2, target="t.py"), addresses, environ=four)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"]
    assert all("TFDIST_CPU_DEVICES" not in e for e in envs)
    one_each = LaunchOptions(nproc=2, target="t.py", devices_per_worker=1)
    assert [
        e["CUDA_VISIBLE_DEVICES"] for e in launch.worker_envs(one_each, addresses, environ=four)
    ] == [
        "0",
        "1",
    ]
    with pytest.raises(ValueError, match=r"2 workers x 3 GPU\(s\) need 6 GPUs, but 4 are visible"):
        launch.worker_envs(
            LaunchOptions(nproc=2, target="t.py", devices_per_worker=3), addresses, environ=four
        )
    with pytest.raises(ValueError, match=r"3 visible GPU\(s\).*cannot be split evenly"):
        launch.worker_envs(
            LaunchOptions(nproc=2, target="t.py"),
            addresses,
            environ={"CUDA_VISIBLE_DEVICES": "0,1,2"},
        )


def test_functions_take_launch_options_only():
    for fn in (launch.worker_command, launch.cluster_addresses, launch.run):
        with pytest.raises(TypeError, match=r"options must be a tfdist.launch.LaunchOptions"):
            fn({"nproc": 2})
    with pytest.raises(TypeError, match=r"options must be .* Received: options=\{'nproc': 2\}"):
        launch.worker_envs({"nproc": 2}, ["127.0.0.1:1"])


def test_worker_command_runs_the_bootstrap_unless_told_not_to():
    opts = LaunchOptions(nproc=1, target="train.py", args=("--epochs", "3"), python="py")
    assert launch.worker_command(opts) == [
        "py", "-m", "tfdist.bootstrap", "train.py", "--epochs", "3"
    ]  # fmt: skip
    module = LaunchOptions(nproc=1, target="pkg.train", module=True, python="py")
    assert launch.worker_command(module) == ["py", "-m", "tfdist.bootstrap", "-m", "pkg.train"]
    plain = LaunchOptions(nproc=1, target="pkg.train", module=True, python="py", fixes=False)
    assert launch.worker_command(plain) == ["py", "-m", "pkg.train"]


def test_cli_passes_script_arguments_through_verbatim():
    args = build_parser().parse_args(["launch", "-n", "2", "train.py", "-n", "5", "--max-restarts"])
    assert (args.nproc, args.script, args.args) == (2, "train.py", ["-n", "5", "--max-restarts"])
    args = build_parser().parse_args(["launch", "-m", "pkg.train", "--epochs", "3"])
    assert (args.module, args.script, args.args) == (True, "pkg.train", ["--epochs", "3"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["launch", "-n", "2"], "missing the script"),
        (["launch", "-n", "2", "no_such_script.py"], "script 'no_such_script.py' not found"),
        (["launch", "--hosts", "10.1.1.1,10.1.1.2", "--port", "2222", "t.py"], "--allow-remote"),
    ],
)
def test_cli_reports_bad_launches_as_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tfdist launch: error: launch:") and message in err
    assert "Traceback" not in err


# ------------------------------------------------------------------ policy and state machine


@pytest.mark.parametrize(
    ("outcome", "restarts", "signalled", "restart", "code"),
    [
        (Outcome("ok"), (0, 2), False, False, 0),
        (Outcome("failed", 1, 3), (0, 2), False, True, 3),
        (Outcome("failed", 1, 3), (2, 2), False, False, 3),  # the budget is spent
        (Outcome("failed", 1, -9), (0, 2), False, True, 128 + 9),
        (Outcome("failed", 1, None), (0, 2), False, True, 1),  # did not finish in time
        (Outcome("failed", 1, 3), (0, 2), True, False, 3),  # a stopped launcher never restarts
        (Outcome("restart", 0, 75), (1, 2), False, True, 75),
        (Outcome("restart", 0, 75), (0, 0), False, False, 75),
        (Outcome("signalled", codes={0: 0, 1: 0}), (0, 2), True, False, 0),
        (Outcome("signalled", codes={0: 75, 1: 0}), (0, 2), True, False, 75),
        (Outcome("signalled", codes={0: -15, 1: 75}), (0, 2), True, False, 128 + signal.SIGINT),
    ],
)
def test_restart_policy_and_exit_codes(outcome, restarts, signalled, restart, code):
    done, budget = restarts
    assert supervise.should_restart(outcome, done, budget, signalled=signalled) is restart
    assert supervise.exit_code(outcome, signal.SIGINT) == code


class FakeWorker:
    """Stands in for tfdist.launch.workers.Worker: an exit code the test sets, signals kept."""

    def __init__(self, rank):
        self.rank, self.code, self.got = rank, None, []
        self.proc = self  # .pid and .returncode, as on a Popen

    pid = property(lambda self: 1000 + self.rank)
    returncode = property(lambda self: self.code)

    def poll(self):
        return self.code

    def signal(self, sig, *, only_if_running=True):
        self.got.append(signal.Signals(sig).name)


def supervisor(n=2, **options):
    signals = type("Signals", (), {"count": 0, "received": None})()
    workers = [FakeWorker(rank) for rank in range(n)]
    opts = LaunchOptions(nproc=n, target="t.py", grace=10, stop_grace=2, **options)
    return supervise.GroupSupervisor(opts, workers, signals), workers, signals


def test_supervisor_stops_the_others_when_one_fails_then_kills_them():
    sup, (w0, w1), _ = supervisor()
    sup.step(0.0)
    assert sup.phase is Phase.RUNNING
    w1.code = 3
    sup.step(1.0)
    assert sup.phase is Phase.STOPPING and w0.got == ["SIGTERM"] and w1.got == []
    sup.step(2.9)
    assert w0.got == ["SIGTERM"]
    sup.step(3.0)  # stop_grace=2 after the failure
    assert sup.phase is Phase.KILLED and w0.got == ["SIGTERM", "SIGKILL"]
    w0.code = -9
    sup.step(3.1)
    assert sup.phase is Phase.DONE
    assert sup.outcome == Outcome("failed", 1, 3, {0: -9, 1: 3})


def test_supervisor_blames_a_killed_worker_over_one_that_exited_in_the_same_poll():
    sup, (w0, w1), _ = supervisor()
    w0.code, w1.code = 1, -9
    sup.step(0.0)
    assert sup.outcome == Outcome("failed", 1, -9, {0: 1, 1: -9})


def test_supervisor_gives_the_rest_finish_timeout_after_the_first_finished():
    sup, (w0, w1), _ = supervisor(finish_timeout=5)
    w0.code = 0
    sup.step(1.0)
    assert sup.phase is Phase.FINISHING
    sup.step(6.0)
    assert sup.phase is Phase.FINISHING and w1.got == []
    sup.step(6.1)
    assert sup.phase is Phase.STOPPING and w1.got == ["SIGTERM"]
    w1.code = -15
    sup.step(6.2)
    assert sup.outcome == Outcome("failed", 1, None, {0: 0, 1: -15})


def test_supervisor_forwards_signals_and_a_second_one_kills_at_once():
    sup, (w0, w1), signals = supervisor()
    w1.code = 75  # one worker saved and exited before the signal was seen
    signals.count, signals.received = 1, signal.SIGTERM
    sup.step(0.0)
    assert sup.phase is Phase.STOPPING and w0.got == ["SIGTERM"]
    signals.count = 2
    sup.step(1.0)
    assert sup.phase is Phase.KILLED and w0.got == ["SIGTERM", "SIGTERM", "SIGKILL"]
    w0.code = 75
    sup.step(1.1)
    assert sup.outcome == Outcome("signalled", codes={0: 75, 1: 75})
    assert supervise.exit_code(sup.outcome, signal.SIGTERM) == 75


def test_all_workers_exiting_0_is_ok():
    sup, workers, _ = supervisor(n=3)
    for w in workers:
        w.code = 0
    sup.step(0.0)
    assert sup.phase is Phase.DONE and sup.outcome == Outcome("ok", codes={0: 0, 1: 0, 2: 0})


# ------------------------------------------------------------------ the supervisor


def test_workers_get_prefixed_output_tf_config_and_the_parent_never_imports_tensorflow(tmp_path):
    worker = script(
        tmp_path,
        """
        config = json.loads(os.environ["TF_CONFIG"])
        print("CLUSTER", ",".join(config["cluster"]["worker"]), os.environ["TFDIST_CPU_DEVICES"])
        print("to stderr", file=sys.stderr)
        sys.stdout.write("bar 1/2\\rbar 2/2\\n")
        sys.stdout.write("no newline at the end")
        """,
    )
    code = f"""
        import sys
        from tfdist.cli import main
        rc = main(["launch", "-n", "2", "--devices-per-worker", "2", "--no-fixes", {worker!r}])
        print("RC", rc, "TF" if "tensorflow" in sys.modules else "NO-TF")
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env(),
        cwd=REPO,
        capture_output=True,
        timeout=60,
    )
    # Bytes, decoded by hand: text mode would turn the progress bar's "\r" into "\n".
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert out.strip().splitlines()[-1] == "RC 0 NO-TF"
    clusters = {line.split()[0]: line.split()[2:] for line in out.splitlines() if "CLUSTER" in line}
    assert set(clusters) == {"[w0]", "[w1]"}
    addresses = clusters["[w0]"][0].split(",")
    assert clusters["[w1]"] == clusters["[w0]"] and clusters["[w0]"][1] == "2"
    assert len(addresses) == 2 and all(a.startswith("127.0.0.1:") for a in addresses)
    for rank in (0, 1):
        # stdout is a pipe here: a progress bar's redraws are dropped, its final state kept.
        assert f"[w{rank}] bar 2/2\n" in out and "bar 1/2" not in out
        assert f"[w{rank}] no newline at the end\n" in out
        assert f"[w{rank}] to stderr" in err
    assert "tfdist launch: all 2 worker(s) finished: w0 exited 0, w1 exited 0" in err


def test_a_failing_worker_stops_the_others_and_is_named(tmp_path, launch_log):
    code, out, _ = run(
        tmp_path,
        """
        if rank == 1:
            sys.exit(3)
        time.sleep(120)
        print("w0 should have been stopped")
        """,
    )
    assert code == 3
    assert "should have been stopped" not in out
    assert any(
        "worker w1" in m and "exited with code 3; stopping the other" in m for m in launch_log
    )
    assert launch_log[-1] == "failed: worker w1 exited with code 3"


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(tmp_path, launch_log):
    ready = tmp_path / "w1-ignores-sigterm"
    code, _, _ = run(
        tmp_path,
        f"""
        if rank == 0:
            while not os.path.exists({str(ready)!r}):  # fail only once w1 ignores SIGTERM
                time.sleep(0.01)
            sys.exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").close()
        time.sleep(120)
        """,
        stop_grace=1,
    )
    assert code == 1
    assert "worker w1 did not exit in time: SIGKILL" in launch_log


def test_kill_9_of_a_worker_is_reported_with_its_signal(tmp_path, launch_log):
    pids = tmp_path / "pids"
    pids.mkdir()
    worker = script(
        tmp_path,
        f"""
        open(os.path.join({str(pids)!r}, str(rank)), "w").write(str(os.getpid()))
        time.sleep(120)
        """,
    )
    result = {}
    opts = LaunchOptions(nproc=2, target=worker, fixes=False)
    thread = threading.Thread(
        target=lambda: result.update(code=launch.run(opts, stdout=io.StringIO())), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not all((pids / r).exists() and (pids / r).read_text() for r in "01"):
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.05)
    os.kill(int((pids / "1").read_text()), signal.SIGKILL)
    thread.join(timeout=60)
    assert result["code"] == 128 + signal.SIGKILL
    # The message names the signal and the exit status the launcher itself exits with.
    assert launch_log[-1] == "failed: worker w1 was killed by signal 9 (SIGKILL), exit status 137"
    assert gone(int((pids / "0").read_text()))


def test_restart_request_restarts_the_group_within_the_budget(tmp_path, launch_log):
    body = """
        print("attempt", restart)
        if rank == 1 and restart == 0:
            sys.exit(75)
        """
    code, out, _ = run(tmp_path, body, max_restarts=1)
    assert code == 0
    assert out.count("[w1] attempt 0") == out.count("[w1] attempt 1") == 1
    assert any(
        "saved, restart requested): restarting all workers (restart 1 of 1)" in m
        for m in launch_log
    )
    # without a budget the launcher passes the request on with the same code
    code, out, _ = run(tmp_path, body, max_restarts=0)
    assert code == 75 and "attempt 1" not in out
    assert "no restarts are left" in launch_log[-1]


def test_restarts_never_loop_forever(tmp_path):
    code, out, _ = run(
        tmp_path, 'print("attempt", restart); sys.exit(75 if rank == 0 else 0)\n', max_restarts=2
    )
    assert code == 75
    assert [line for line in out.splitlines() if line.startswith("[w0] attempt")] == [
        "[w0] attempt 0",
        "[w0] attempt 1",
        "[w0] attempt 2",
    ]


def test_a_failure_is_retried_and_the_job_finishes(tmp_path):
    code, out, _ = run(
        tmp_path, "sys.exit(2 if (rank, restart) == (0, 0) else 0)\n", max_restarts=1
    )
    assert code == 0 and out.count("READY 0") == 2


def test_a_worker_still_running_long_after_the_others_finished_is_stopped(tmp_path, launch_log):
    code, _, _ = run(tmp_path, "if rank == 1:\n    time.sleep(120)\n", finish_timeout=1)
    assert code == 1
    assert "failed: worker w1 did not finish in time" in launch_log[-1]


def test_a_taken_port_is_named(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"port {port} on 127.0.0.1 is in use"):
            run(tmp_path, "pass\n", nproc=1, port=port)


def test_sigterm_is_forwarded_and_saved_workers_make_the_launcher_exit_75(tmp_path):
    worker = script(
        tmp_path,
        """
        def saved(signum, frame):
            print("saving on", signal.Signals(signum).name, flush=True)
            sys.exit(75)
        signal.signal(signal.SIGTERM, saved)
        time.sleep(120)
        """,
    )
    lines = Lines(start_cli("-n", "2", "--max-restarts", "3", "--no-fixes", worker))
    lines.wait_for("[w0] READY", "[w1] READY")
    lines.proc.send_signal(signal.SIGTERM)
    code, out = lines.finish()
    assert code == 75  # saved: restart me (later), not a failure
    assert "[w0] saving on SIGTERM" in out and "[w1] saving on SIGTERM" in out
    assert "got SIGTERM: forwarding it to the workers" in out
    assert out.count("[w0] READY") == 1  # a signalled launcher never restarts


def test_sigint_to_the_launcher_ends_stubborn_workers_after_the_grace(tmp_path):
    worker = script(tmp_path, "signal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(120)\n")
    lines = Lines(start_cli("-n", "2", "--grace", "1", "--no-fixes", worker))
    lines.wait_for("[w0] READY", "[w1] READY")
    lines.proc.send_signal(signal.SIGINT)
    code, out = lines.finish()
    assert code == 128 + signal.SIGINT
    assert "worker w0 did not exit in time: SIGKILL" in out


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_processes_a_worker_leaves_behind_are_stopped(tmp_path, start, monkeypatch):
    """A worker started cold (the interpreter users have) and one forked warm
    (tests/warm_python.py, as most tests' workers are): the child each leaves is killed."""
    if start == "warm":
        # The in-process launcher gives its worker this process's environment: the
        # variables read at import must be the warm process's, else the worker starts cold
        # (an earlier test in this process may have set one, as the CLI's quiet start does).
        base = child_env()
        for key in warm_start.IMPORT_TIME:
            if key in base:
                monkeypatch.setenv(key, base[key])
            else:
                monkeypatch.delenv(key, raising=False)
        warm_start.prepare(base, base)  # the warm process its worker forks from
    python = warm_start.LAUNCH_ENV["TFDIST_LAUNCH_PYTHON"] if start == "warm" else sys.executable
    code, out, _ = run(
        tmp_path,
        """
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print("CHILD", child.pid, "WARM", "tensorflow" in sys.modules, flush=True)
        """,
        nproc=1,
        python=python,
    )
    assert code == 0
    assert out.split("WARM ")[1].split()[0] == str(start == "warm"), out  # started as named
    assert gone(int(out.split("CHILD ")[1].split()[0])), "the worker's child outlived the job"


def test_workers_die_with_a_killed_launcher(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    worker = script(tmp_path, "time.sleep(120)\n")
    lines = Lines(start_cli("-n", "2", "--no-fixes", worker))
    lines.wait_for("[w0] READY", "[w1] READY")
    pids = [int(line.split()[-1]) for line in lines.seen if "READY" in line]
    lines.proc.kill()
    lines.finish()
    assert all(gone(pid) for pid in pids), "workers outlived their launcher"


# ------------------------------------------------------------------ the private network

# Listens like TensorFlow's gRPC server (every interface), then reaches its peer.
LISTENER = """
import socket
ports = [int(a.rpartition(":")[2]) for a in json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]]
server = socket.socket()
server.bind(("0.0.0.0", ports[rank]))
server.listen()
deadline = time.monotonic() + 30
while True:  # the peer's port, over the job's own loopback
    try:
        socket.create_connection(("127.0.0.1", ports[1 - rank]), timeout=5).close()
        break
    except OSError:
        assert time.monotonic() < deadline, "the peer never listened"
        time.sleep(0.05)
print("PEER OK", ports[rank], flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


def _reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return True
    except OSError:
        return False


def _ports_seen_from_here(tmp_path, *flags: str) -> tuple[list[bool], str]:
    """Runs two listening workers; which of their ports this (the host's) network reaches."""
    done = tmp_path / "done"
    worker = script(tmp_path, LISTENER)
    lines = Lines(start_cli("-n", "2", *flags, "--no-fixes", worker, str(done)))
    try:
        lines.wait_for("[w0] PEER OK", "[w1] PEER OK")
        ports = [int(line.split()[-1]) for line in lines.seen if "PEER OK" in line]
        reached = [_reachable(port) for port in ports]
    finally:
        done.touch()
    code, out = lines.finish()
    assert code == 0, out
    return reached, out


def test_worker_ports_are_not_reachable_from_outside_the_job(tmp_path):
    reached, out = _ports_seen_from_here(tmp_path)
    if "no private network" in out:
        pytest.fail(f"network namespaces are not available here: {out[-2000:]}")
    assert "tfdist launch: private network: the workers share a network namespace" in out
    assert reached == [False, False], "a worker port is reachable from the host's network"
    assert "all 2 worker(s) finished: w0 exited 0, w1 exited 0" in out


def test_shared_network_opts_out_and_warns_that_the_ports_are_exposed(tmp_path):
    reached, out = _ports_seen_from_here(tmp_path, "--shared-network")
    assert reached == [True, True]
    assert "shared network (--shared-network): worker ports" in out
    assert "listen unauthenticated on every interface" in out


def test_without_namespaces_the_job_runs_with_a_warning_naming_its_ports(
    tmp_path, launch_log, monkeypatch
):
    def unavailable(*args, **kwargs):
        raise namespace.NamespaceUnavailable(
            "unshare(CLONE_NEWNET) failed: Operation not permitted"
        )

    monkeypatch.setattr(namespace.PrivateNetwork, "create", unavailable)
    code, out, _ = run(tmp_path, "pass\n", port=free_port_pair())
    assert code == 0 and "[w1] READY" in out
    warning = next(m for m in launch_log if m.startswith("no private network"))
    port = int(warning.split("worker ports ")[1].split(",")[0])
    assert f"worker ports {port}, {port + 1} listen unauthenticated" in warning
    assert "--firewall apply" in warning and "Operation not permitted" in warning


def free_port_pair() -> int:
    for _ in range(100):
        port = launch.free_ports(1)[0]
        if port < 65000 and _free(port + 1):
            return port
    pytest.fail("no two consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_network_mode_and_the_shared_network_knob(monkeypatch):
    assert network.network_mode(LaunchOptions(nproc=2, target="t.py")) == "private"
    two = LaunchOptions(nproc=1, target="t.py", nnodes=2, port=2222, hosts=("127.0.0.1",) * 2)
    assert network.network_mode(two) == "hosts"  # each node's launcher: one network
    monkeypatch.setenv("TFDIST_SHARED_NETWORK", "1")
    assert LaunchOptions(nproc=1, target="t.py").shared_network is True
    assert LaunchOptions(nproc=1, target="t.py", shared_network=False).shared_network is False
    monkeypatch.setenv("TFDIST_SHARED_NETWORK", "maybe")
    with pytest.raises(ConfigError, match=r"TFDIST_SHARED_NETWORK must be 1 or 0.*'maybe'"):
        LaunchOptions(nproc=1, target="t.py")
    with pytest.raises(TypeError, match=r"launch: firewall must be a bool\. Received: firewall"):
        LaunchOptions(nproc=1, target="t.py", firewall="yes")


def test_firewall_print_admits_the_job_hosts_only(capsys):
    argv = ["launch", "-n", "2", "--nnodes", "2", "--node-rank", "1", "--port", "23456"]
    argv += ["--hosts", "10.213.0.1,10.213.0.2", "--allow-remote", "--firewall", "print", "t.py"]
    assert main(argv) == 0
    rules = capsys.readouterr().out
    assert "table inet tfdist_23456 {" in rules and 'iif "lo" accept' in rules
    assert "ip saddr { 10.213.0.1, 10.213.0.2 } tcp dport { 23456, 23457 } accept" in rules
    assert "tcp dport { 23456, 23457 } reject with tcp reset" in rules
    assert main(["launch", "-n", "2", "--firewall", "print", "t.py"]) == 2
    assert "--firewall print needs fixed ports" in capsys.readouterr().err


def test_a_module_target_runs_as_python_m_in_every_worker(tmp_path):
    """The README's ``tfdist launch -n 2 -m mypkg.train``: each worker runs the module as
    ``__main__`` with its own arguments and its own task."""
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        "import json, os, sys\n"
        "task = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "print(json.dumps({'name': __name__, 'argv': sys.argv[1:], 'task': task}))\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = launch_cli("-n", "2", "-m", "mypkg.train", "--epochs", "3", PYTHONPATH=path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {}
    for line in proc.stdout.splitlines():
        prefix, _, rest = line.partition(" ")
        if rest.startswith("{"):
            found[prefix] = json.loads(rest)
    assert found == {
        f"[w{i}]": {"name": "__main__", "argv": ["--epochs", "3"], "task": i} for i in (0, 1)
    }, proc.stdout[-3000:]
