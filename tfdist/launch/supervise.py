"""Supervision: run the worker group, decide how it ended, restart it or exit.

Three layers, each testable alone:

* ``GroupSupervisor``: a state machine over ``Phase`` that polls one group of workers
  and ends in an ``Outcome`` (mechanism only: it signals and kills, never restarts).
* ``should_restart`` and ``exit_code``: the restart policy, pure functions of an
  ``Outcome`` (the rules are in the ``tfdist.launch`` docstring).
* ``run``: starts groups until the policy says to stop.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from tfdist.core.config import RESTART_EXIT_CODE, WATCHDOG_EXIT_CODE, ConfigError
from tfdist.launch.environment import group_addresses, worker_command, worker_envs
from tfdist.launch.network import JobNetwork
from tfdist.launch.options import LaunchOptions, check_options
from tfdist.launch.workers import LauncherSignals, Route, Worker

__all__ = [
    "Outcome",
    "Phase",
    "GroupSupervisor",
    "run_group",
    "should_restart",
    "exit_code",
    "exit_meaning",
    "run",
]

logger = logging.getLogger(__name__)

_POLL_S = 0.05


@dataclass(frozen=True)
class Outcome:
    """How one run of the worker group ended.

    Attributes:
        kind: ``ok``, ``failed``, ``restart`` (a worker exited 75), ``signalled``
            (the launcher got SIGINT/SIGTERM), or for elastic jobs ``reform`` (the round
            ended) and ``store-lost`` (the rendezvous store stopped answering).
        rank: the worker that decided it (None for ``ok``/``signalled``).
        code: that worker's exit code (negative: killed by that signal).
        codes: every worker's exit code, by rank.
    """

    kind: str
    rank: int | None = None
    code: int | None = None
    codes: dict[int, int | None] = dataclasses.field(default_factory=dict)


def exit_meaning(code: int | None) -> str:
    """What a worker's exit code means, for a log line (the status a shell would show).

    Example:
        >>> exit_meaning(-9)
        'was killed by signal 9 (SIGKILL), exit status 137'
    """
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-code} ({name}), exit status {128 - code}"
    if code == RESTART_EXIT_CODE:
        return f"exited with code {code} (saved, restart requested)"
    if code == WATCHDOG_EXIT_CODE:  # its own last line names the peer (or itself)
        return f"exited with code {code} (tfdist.watchdog: a peer or itself stuck, or a peer lost)"
    return f"exited with code {code}"


# ------------------------------------------------------------------ one group: a state machine


class Phase(enum.Enum):
    """Where a group of workers stands; ``GroupSupervisor.step`` moves between these."""

    RUNNING = "running"  # nothing decided yet
    FINISHING = "finishing"  # some workers exited 0; the rest have finish_timeout left
    STOPPING = "stopping"  # the end is decided; the survivors were signalled
    KILLED = "killed"  # the survivors were sent SIGKILL; waiting for them to go
    DONE = "done"  # no worker runs: ``outcome`` is final


class GroupSupervisor:
    """Polls one group of workers until none runs, signalling them as events require.

    Events, checked in this order at every poll:

    1. a SIGINT/SIGTERM to the launcher: forwarded to the running workers, SIGKILL after
       ``grace``; a second one kills at once. It decides the outcome (``signalled``).
    2. a worker exited non-zero (nothing decided yet): the others get SIGTERM, SIGKILL
       after ``stop_grace`` (``failed``, or ``restart`` for exit code 75).
    3. some workers exited 0 and the rest are still running after ``finish_timeout``:
       they are stopped the same way (``failed``).
    4. no worker runs: ``DONE``.
    5. the SIGKILL deadline passed: the survivors get SIGKILL.
    """

    def __init__(
        self,
        options: LaunchOptions,
        workers: list[Worker],
        signals: LauncherSignals,
        ended: Callable[[], tuple[str, str, bool] | None] | None = None,
    ):
        self.options, self.workers, self.signals = options, workers, signals
        self.ended = ended
        self.phase = Phase.RUNNING
        self.decided: Outcome | None = None  # the first event that ends the group
        self.outcome: Outcome | None = None  # set in DONE
        self._kill_at: float | None = None
        self._first_done_at: float | None = None
        self._forwarded = 0

    def supervise(self) -> Outcome:
        """Polls until no worker runs; returns how the group ended."""
        while True:
            self.step(time.monotonic())
            if self.phase is Phase.DONE:
                assert self.outcome is not None  # step sets it with DONE
                return self.outcome
            time.sleep(_POLL_S)

    def step(self, now: float) -> None:
        """One poll of the workers at time ``now`` (``time.monotonic()``)."""
        codes = {w.rank: w.poll() for w in self.workers}
        running = [w for w in self.workers if codes[w.rank] is None]
        if self.signals.count > self._forwarded:
            self._forward_signal(now, running)
        if self.phase in (Phase.RUNNING, Phase.FINISHING):
            self._check_failures(now, codes, running)
        if self.phase in (Phase.RUNNING, Phase.FINISHING) and self.ended is not None:
            self._check_ended(now, running)
        if self.phase in (Phase.RUNNING, Phase.FINISHING):
            self._check_finish(now, running)
        if not running:
            final = {w.rank: w.proc.returncode for w in self.workers}
            decided = self.decided or Outcome("ok")
            self.outcome = dataclasses.replace(decided, codes=final)
            self.phase = Phase.DONE
        elif self.phase is Phase.STOPPING:
            assert self._kill_at is not None  # _stop sets it with STOPPING
            if now >= self._kill_at:
                for w in running:
                    logger.warning("worker w%d did not exit in time: SIGKILL", w.rank)
                    w.signal(signal.SIGKILL)
                self.phase = Phase.KILLED

    def _stop(self, decided: Outcome, kill_at: float) -> None:
        self.decided, self._kill_at, self.phase = decided, kill_at, Phase.STOPPING

    def _forward_signal(self, now: float, running: list[Worker]) -> None:
        self._forwarded = self.signals.count
        received = self.signals.received
        assert received is not None  # set with each count (LauncherSignals)
        if self.decided is None or self.decided.kind != "signalled":
            logger.warning(
                "got %s: forwarding it to the workers (SIGKILL in %.0f s)",
                signal.Signals(received).name,
                self.options.grace,
            )
            self._stop(Outcome("signalled"), now + self.options.grace)
        else:  # a second signal: no more grace
            self._stop(self.decided, now)
        for w in running:
            w.signal(received)

    def _check_failures(self, now: float, codes: dict, running: list[Worker]) -> None:
        ended = [w for w in self.workers if codes[w.rank] not in (None, 0)]
        if not ended:
            return
        # Seen in the same poll: a worker killed by a signal is the likelier cause.
        w = min(ended, key=lambda w: (codes[w.rank] >= 0, w.rank))
        code = codes[w.rank]
        logger.error(
            "worker w%d (pid %d) %s; stopping the other workers",
            w.rank,
            w.proc.pid,
            exit_meaning(code),
        )
        for other in running:
            other.signal(signal.SIGTERM)
        kind = "restart" if code == RESTART_EXIT_CODE else "failed"
        self._stop(Outcome(kind, w.rank, code), now + self.options.stop_grace)

    def _check_ended(self, now: float, running: list[Worker]) -> None:
        """An elastic job's round is over (``ended`` says why): SIGTERM now, SIGKILL after
        ``grace`` when every node is alive to save with (``patient``), else ``stop_grace``."""
        assert self.ended is not None  # step calls this only with ``ended``
        said = self.ended()
        if said is None:
            return
        kind, why, patient = said
        wait = self.options.grace if patient else self.options.stop_grace
        logger.warning("%s: stopping the workers (SIGKILL in %.0f s)", why, wait)
        for w in running:
            w.signal(signal.SIGTERM)
        self._stop(Outcome(kind), now + wait)

    def _check_finish(self, now: float, running: list[Worker]) -> None:
        if not running or len(running) == len(self.workers):
            return
        if self.phase is Phase.RUNNING:
            self._first_done_at, self.phase = now, Phase.FINISHING
        assert self._first_done_at is not None  # set on entering FINISHING, just above
        if now - self._first_done_at <= self.options.finish_timeout:
            return
        logger.error(
            "worker(s) %s still running %.0f s after another worker finished; stopping them",
            ", ".join(f"w{w.rank}" for w in running),
            self.options.finish_timeout,
        )
        for w in running:
            w.signal(signal.SIGTERM)
        self._stop(Outcome("failed", running[0].rank, None), now + self.options.stop_grace)


def run_group(
    options: LaunchOptions,
    restart: int,
    signals: LauncherSignals,
    out: TextIO,
    err: TextIO,
    network: JobNetwork | None = None,
    *,
    ended: Callable[[], tuple[str, str, bool] | None] | None = None,
) -> Outcome:
    """Starts this node's workers (start number ``restart``), supervises them to the end.

    ``network`` (default: a new ``JobNetwork``) puts them in a private network or
    guards their ports; its namespace is let go when the group ends. ``ended`` (elastic
    jobs) is polled while they run: ``(kind, why, patient)`` ends the group.
    """
    network = network or JobNetwork(options)
    addresses = group_addresses(options)
    envs = worker_envs(options, addresses, restart=restart)
    command = worker_command(options)
    lock = threading.Lock()
    logger.info(
        "starting %d worker(s) %s of %d: %s",
        options.nproc,
        [f"w{r}" for r in options.ranks()],
        options.world_size,
        " ".join(command[1:]),
    )
    workers: list[Worker] = []
    logs = _open_logs(options, restart)
    try:
        enter = network.start(addresses)
        for rank, env in zip(options.ranks(), envs, strict=True):
            route = _route(options, logs.get(rank))
            workers.append(Worker(rank, command, env, out, err, lock, enter, route))
        return GroupSupervisor(options, workers, signals, ended).supervise()
    finally:
        for worker in workers:
            worker.finish()
        for log in logs.values():
            log.close()
        network.end_group()


def _route(options: LaunchOptions, log: TextIO | None) -> Route:
    console = options.log_dir is None or options.tee
    return Route(console=console, log=log, verbose=options.verbose)


def _open_logs(options: LaunchOptions, restart: int) -> dict[int, TextIO]:
    """``LOG_DIR/worker-<rank>.log`` per worker (appended to at restarts, marked)."""
    if options.log_dir is None:
        return {}
    try:
        os.makedirs(options.log_dir, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"launch: log_dir must be a writable directory ({err.strerror}). Received: "
            f"log_dir={options.log_dir!r}"
        ) from None
    logs: dict[int, TextIO] = {}
    for rank in options.ranks():
        path = os.path.join(options.log_dir, f"worker-{rank}.log")
        logs[rank] = open(path, "w" if restart == 0 else "a", encoding="utf-8")  # noqa: SIM115
        if restart:
            logs[rank].write(f"--- tfdist launch: restart {restart} ---\n")
    if restart == 0:
        logger.info("worker output: %s", os.path.join(options.log_dir, "worker-<rank>.log"))
    return logs


# ------------------------------------------------------------------ policy


def should_restart(
    outcome: Outcome, restarts_done: int, max_restarts: int, *, signalled: bool
) -> bool:
    """True when the group is started again: it failed or asked for a restart, the
    budget is not spent, and the launcher was not told to stop.

    Example:
        >>> should_restart(Outcome("restart", 0, 75), 0, 1, signalled=False)
        True
    """
    return outcome.kind in ("failed", "restart") and restarts_done < max_restarts and not signalled


def exit_code(outcome: Outcome, received: int | None = None) -> int:
    """The launcher's exit code when ``outcome`` ends the job (``received``: its signal).

    Example:
        >>> exit_code(Outcome("failed", 1, -9))
        137
    """
    if outcome.kind == "ok":
        return 0
    if outcome.kind == "signalled":
        codes = set(outcome.codes.values())
        if codes <= {0}:
            return 0
        if codes <= {0, RESTART_EXIT_CODE}:
            return RESTART_EXIT_CODE
        return 128 + (received or signal.SIGTERM)
    if outcome.kind == "restart":
        return RESTART_EXIT_CODE
    code = outcome.code
    return (128 - code if code < 0 else code) if code else 1


def _what(outcome: Outcome) -> str:
    if outcome.code is None:
        return f"worker w{outcome.rank} did not finish in time"
    return f"worker w{outcome.rank} {exit_meaning(outcome.code)}"


def _log_end(options: LaunchOptions, outcome: Outcome) -> None:
    if outcome.kind == "ok":
        finished = ", ".join(f"w{rank} exited 0" for rank in sorted(outcome.codes))
        logger.info("all %d worker(s) finished: %s", options.nproc, finished)
    elif outcome.kind == "restart":
        logger.error("%s, and no restarts are left (--max-restarts)", _what(outcome))
    elif outcome.kind == "failed":
        logger.error("failed: %s", _what(outcome))


def run(
    options: LaunchOptions, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Runs the job's workers on this node until they finish; returns the exit code.

    See the ``tfdist.launch`` docstring for exit codes, restarts and signals. Status
    messages go to the ``tfdist.launch`` logger; worker output goes to ``stdout``/
    ``stderr`` (default: this process's), each line prefixed with ``[wRANK]``.

    Raises:
        ConfigError: the script is missing, a fixed port is taken, or the GPUs cannot
            be split as asked.

    Example:
        >>> run(LaunchOptions(nproc=2, target="train.py"))  # doctest: +SKIP
        0
    """
    check_options(options, "run")
    out, err = stdout or sys.stdout, stderr or sys.stderr
    if not options.module and not os.path.isfile(options.target):
        raise ConfigError(
            f"launch: script {options.target!r} not found. Received: target="
            f"{options.target!r}. Pass a script path, or -m MODULE for a module."
        )
    network = JobNetwork(options)
    with LauncherSignals() as signals:
        try:
            return _run_groups(options, network, signals, out, err)
        finally:
            network.close()


def _run_groups(options, network, signals, out, err) -> int:
    """Starts the group until the restart policy says to stop; returns the exit code."""
    restarts = 0
    while True:
        outcome = run_group(options, restarts, signals, out, err, network)
        signalled = bool(signals.count)
        if not should_restart(outcome, restarts, options.max_restarts, signalled=signalled):
            _log_end(options, outcome)
            return exit_code(outcome, signals.received)
        restarts += 1
        logger.warning(
            "%s: restarting all workers (restart %d of %d)",
            _what(outcome),
            restarts,
            options.max_restarts,
        )
