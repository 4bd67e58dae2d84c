"""Multi-process JAX jobs end in time when a peer dies, never starts or is stuck.

Real processes (``KERAS_BACKEND=jax``, 2 processes) run tests/scripts/jax_fault_job.py,
through ``tfdist launch`` and, where the launcher would hide a process's own bound (it
stops every worker once one exits), started directly with the environment ``tfdist
launch`` gives them. Each fault is timed from the moment it happened; short timeouts
come from the environment, and a unit test checks that the defaults also stay within
60 s. Several jobs run at once to keep the wall time down.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from tfdist.core import config, watchdog
from tfdist.launch import LaunchOptions, free_ports, supervise
from tfdist.launch.environment import cluster_addresses, worker_command, worker_envs

from conftest import REPO, SCRIPTS, child_env

pytestmark = [pytest.mark.jax, pytest.mark.multiworker]

JOB = str(SCRIPTS / "jax_fault_job.py")
BOUND_S = 60.0  # what docs/jax.md promises: every process ends within this of the fault
START_S = 240.0  # 2-4 JAX processes starting at once on a small CI machine
COLLECTIVE_S = 5  # the jobs' short watchdog limit (45 s by default on JAX)
SHORT = {"TFDIST_JAX_STALL_TIMEOUT": str(COLLECTIVE_S)}
REGISTER_S = 5  # a job whose peer never starts: its short register timeout (60 s by default)


class Procs:
    """Processes started together: their output lines (with arrival times) and ends."""

    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}
        self.lines: dict[str, list[tuple[float, str]]] = {}
        self.ends: dict[str, float] = {}

    def start(self, name: str, command: list[str], env: dict[str, str]) -> None:
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs[name], self.lines[name] = proc, []
        threading.Thread(target=self._read, args=(name, proc), daemon=True).start()

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines[name].append((time.time(), line.rstrip("\n")))
        proc.wait()
        self.ends[name] = time.time()

    def output(self, name: str) -> str:
        return "\n".join(line for _, line in self.lines[name])

    def wait_for(self, name: str, pattern: str, timeout: float = START_S) -> re.Match:
        """The first line of ``name`` matching ``pattern`` (fails if it ends first)."""
        deadline = time.time() + timeout
        while True:
            for _, line in list(self.lines[name]):
                found = re.search(pattern, line)
                if found:
                    return found
            assert name not in self.ends, f"{name} ended first:\n{self.output(name)[-3000:]}"
            assert time.time() < deadline, f"no {pattern!r} in {name}:\n{self.output(name)[-3000:]}"
            time.sleep(0.2)

    def wait_end(self, name: str, since: float, bound: float = BOUND_S) -> tuple[int, float]:
        """``name``'s exit code and seconds from ``since`` to its end (fails past ``bound``)."""
        deadline = since + bound
        while name not in self.ends and time.time() < deadline:
            time.sleep(0.2)
        assert name in self.ends, (
            f"{name} still runs {bound:.0f} s after the fault:\n" + (self.output(name)[-3000:])
        )
        return self.procs[name].returncode, self.ends[name] - since

    def running(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture
def procs():
    running = Procs()
    yield running
    running.close()


def _launch(procs: Procs, name: str, *args: str, **env: str) -> None:
    command = [sys.executable, "-m", "tfdist", "launch", "-n", "2", JOB, *args]
    procs.start(name, command, child_env(KERAS_BACKEND="jax", **env))


def _direct(procs: Procs, name: str, ranks, *args: str, **env: str) -> None:
    """Processes ``ranks`` of a 2-process job, each with the environment tfdist launch
    would give it (TF_CONFIG, KERAS_DISTRIBUTION_*), on this host's loopback."""
    options = LaunchOptions(nproc=2, target=JOB, args=args)
    addresses = cluster_addresses(options, free_ports(2))
    envs = worker_envs(options, addresses, environ=child_env(KERAS_BACKEND="jax", **env))
    for rank in ranks:
        procs.start(f"{name}{rank}", worker_command(options), envs[rank])


def _fault_time(procs: Procs, name: str) -> float:
    return float(procs.wait_for(name, r"FAULT (\S+)").group(1))


def _one_line(text: str, pattern: str) -> str:
    """The single line matching ``pattern``; the output has no traceback."""
    assert "Traceback" not in text, text[-3000:]
    found = [line for line in text.splitlines() if re.search(pattern, line)]
    assert found, f"no line matching {pattern!r} in:\n{text[-3000:]}"
    return found[0]


# ------------------------------------------------------------------ defaults and messages


def test_default_timeouts_end_a_job_with_a_dead_never_started_or_stuck_peer_within_60_s():
    timeouts = config.MultiWorkerTimeouts()
    # Never started: the others give up (naming it) a moment before the register timeout.
    assert config.jax_register_timeout({}) <= BOUND_S
    # Dead: jax's heartbeat verdict, or the failed collective read within the verdict.
    assert timeouts.heartbeat + watchdog.VERDICT_MAX_S <= BOUND_S
    # Stuck: the watchdog's default, its verdict included.
    default = config.jax_stall_timeout(environ={})
    assert default == config.JAX_STALL_TIMEOUT_DEFAULT
    assert default + watchdog.VERDICT_MAX_S <= BOUND_S
    assert watchdog.ALLOWANCE_S >= default  # compiling is never held to a step's limit
    env = "TFDIST_JAX_STALL_TIMEOUT"
    assert config.jax_stall_timeout(environ={env: "12"}) == 12.0
    assert config.jax_stall_timeout(environ={env: "0"}) is None
    assert config.jax_stall_timeout(environ={env: "off"}) is None
    assert config.jax_stall_timeout(0) is None
    with pytest.raises(config.ConfigError, match=r"Received: TFDIST_JAX_STALL_TIMEOUT='soon'"):
        config.jax_stall_timeout(environ={env: "soon"})
    with pytest.raises(ValueError, match=r"Received: timeout=-1"):
        config.jax_stall_timeout(-1)


def _dog(rank: int, count: int):
    return SimpleNamespace(rank=rank, size=3, count=count, timeout=10.0, where=lambda: "fit")


def test_the_verdict_names_the_peers_behind_or_this_process():
    # Process 0 finished 5 batches; 1 is alive at 4, 2 stopped publishing at 4.
    entries = {1: (4, 9, "fit"), 2: (4, 3, "fit")}
    line, wait = watchdog._stuck_line(_dog(0, 5), 10.4, (entries, {2}))
    assert "process 0 of 3: no batch finished for 10 s in fit (5 batches done" in line
    assert "waiting for process 1 (4 batches done, in fit, alive but not progressing)" in line
    assert "process 2 (4 batches done, in fit, not answering)" in line
    assert wait  # process 1 is alive: it reports (and ends) first
    # Process 1 is behind everyone: it is the stuck one, and says where it is.
    line, wait = watchdog._stuck_line(
        _dog(1, 4), 10.0, ({0: (5, 9, "fit"), 2: (5, 9, "fit")}, set())
    )
    assert (
        "no other process is behind and process 0, process 2 got further, so this one is " in line
    )
    assert "stuck, in " in line
    assert not wait
    # Everyone as far (stuck after reporting, e.g. reading data): each says where it is.
    line, wait = watchdog._stuck_line(
        _dog(0, 5), 10.0, ({1: (5, 9, "fit"), 2: (5, 9, "fit")}, set())
    )
    assert "every process got as far and none progressed since (process 1 (5 batches" in line
    assert "; this one is in " in line and not wait
    line, _ = watchdog._stuck_line(
        _dog(0, 5), 10.0, "the job's coordination service does not answer"
    )
    assert line.endswith("; the job's coordination service does not answer")
    # The launcher says what the exit code means and stops the others, as for any failure.
    assert "tfdist.watchdog" in supervise.exit_meaning(config.WATCHDOG_EXIT_CODE)
    outcome = supervise.Outcome("failed", 1, config.WATCHDOG_EXIT_CODE)
    assert supervise.exit_code(outcome) == config.WATCHDOG_EXIT_CODE


def test_the_watchdog_stays_off_in_one_process_and_ignores_other_errors(monkeypatch):
    assert not watchdog.enabled()  # jax not distributed: fit runs upstream's code
    watchdog.end_if_peer_lost(ValueError("Gloo all-reduce failed"), "fit")  # none started
    monkeypatch.setattr(watchdog, "_dog", SimpleNamespace(checked=None))
    watchdog.end_if_peer_lost(ValueError("Incompatible shapes: [4] vs. [8]"), "fit")


# ------------------------------------------------------------------ real processes


@pytest.mark.slow
def test_launch_ends_the_job_when_a_worker_dies_or_is_stuck(procs):
    """Two jobs at once: w1 killed with SIGKILL mid-training; w1 stuck in a callback in
    its second epoch (after a validation), which only the watchdog can end."""
    _launch(procs, "dead", "--steps", "400", "--step-sleep", "0.2")
    stall = ("--steps", "6", "--epochs", "3", "--evaluate", "--fault-rank", "1", "--stall-at", "9")
    _launch(procs, "stuck", *stall, **SHORT)
    procs.wait_for("dead", r"^\[w1\] STEP 5$")
    pid = int(procs.wait_for("dead", r"^\[w1\] PID (\d+)").group(1))
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    code, dead_s = procs.wait_end("dead", killed)
    assert code == 128 + signal.SIGKILL, procs.output("dead")[-3000:]
    assert "failed: worker w1 was killed by signal 9 (SIGKILL)" in procs.output("dead")

    stalled = _fault_time(procs, "stuck")
    code, stuck_s = procs.wait_end("stuck", stalled)
    out = procs.output("stuck")
    assert code == config.WATCHDOG_EXIT_CODE, out[-3000:]
    assert "failed: worker w1 exited with code 69 (tfdist.watchdog" in out, out[-3000:]
    line = _one_line(out, r"^\[w1\] tfdist: process 1 of 2: no batch finished")
    assert f"(12 batches done; TFDIST_JAX_STALL_TIMEOUT={COLLECTIVE_S})" in line, line  # 8 + 4 val
    assert "so this one is stuck, in on_batch_end (jax_fault_job.py:" in line, line
    print(f"launch: dead -> job ended {dead_s:.1f} s after the kill; stuck -> {stuck_s:.1f} s")


@pytest.mark.slow
def test_each_process_ends_itself_when_its_peer_dies_or_never_starts(procs):
    """Started directly (no launcher to stop them): process 1 SIGKILLs itself after batch
    5; and, in another job, process 0 starts alone."""
    _direct(procs, "dead", (0, 1), "--fault-rank", "1", "--die-at", "5")
    _direct(procs, "alone", (0,), TFDIST_REGISTER_TIMEOUT=str(REGISTER_S))
    started = time.time()
    died = _fault_time(procs, "dead1")
    code, dead_s = procs.wait_end("dead0", died)
    out = procs.output("dead0")
    assert code == config.WATCHDOG_EXIT_CODE, out[-3000:]
    line = _one_line(out, r"^tfdist: process 0 of 2: a collective in fit failed after 5 batches")
    assert "Gloo" in line and "lost process 1 (" in line and "not answering" in line, line
    assert procs.wait_end("dead1", died)[0] == -signal.SIGKILL

    code, alone_s = procs.wait_end("alone0", started, START_S)
    out = procs.output("alone0")
    assert code == config.WATCHDOG_EXIT_CODE and "STEP" not in out, out[-3000:]
    assert alone_s < REGISTER_S + BOUND_S  # its start-up, then the short register timeout
    _one_line(
        out,
        rf"^tfdist: process 0 of 2 gave up after {REGISTER_S} s waiting for process 1 to join "
        r"the job at 127\.0\.0\.1:\d+: start it, or raise TFDIST_REGISTER_TIMEOUT\.$",
    )
    print(f"direct: dead -> survivor ended {dead_s:.1f} s after; alone -> {alone_s:.1f} s")


@pytest.mark.slow
@pytest.mark.upstream_failure("keras_jax_watchdog")
def test_each_process_ends_itself_when_its_peer_is_stuck_and_hangs_without_the_fix(procs):
    """Two jobs at once, process 1 stuck in a callback after batch 5 in both: with the
    watchdog both processes end; without it (the fix excluded) both wait forever."""
    _direct(procs, "fixed", (0, 1), "--fault-rank", "1", "--stall-at", "5", **SHORT)
    _direct(
        procs, "upstream", (0, 1), "--fault-rank", "1", "--stall-at", "5",
        TFDIST_COMPAT_EXCLUDE="keras_jax_watchdog", **SHORT,
    )  # fmt: skip
    stalled = _fault_time(procs, "fixed1")
    code1, stuck_s = procs.wait_end("fixed1", stalled)
    code0, waiting_s = procs.wait_end("fixed0", stalled)
    out0, out1 = procs.output("fixed0"), procs.output("fixed1")
    assert (code0, code1) == (config.WATCHDOG_EXIT_CODE,) * 2, out0[-2000:] + out1[-2000:]
    line = _one_line(out0, r"^tfdist: process 0 of 2: no batch finished for \d+ s in fit")
    assert "waiting for process 1 (4 batches done, in fit, alive but not progressing)" in line
    line = _one_line(out1, r"^tfdist: process 1 of 2: no batch finished")
    assert "so this one is stuck, in on_batch_end (jax_fault_job.py:" in line, line
    assert stuck_s < waiting_s  # the stuck one ends first: a launcher names it

    upstream_stalled = _fault_time(procs, "upstream1")
    hang_until = upstream_stalled + COLLECTIVE_S + watchdog.VERDICT_MAX_S + 10
    procs.wait_for("upstream0", r"^STEP 5$")
    while time.time() < hang_until:
        assert procs.running("upstream0") and procs.running("upstream1")
        time.sleep(0.5)
    assert "STEP 6" not in procs.output("upstream0")  # waiting in the collective
    print(f"direct: stuck -> process 1 ended {stuck_s:.1f} s, process 0 {waiting_s:.1f} s after")
