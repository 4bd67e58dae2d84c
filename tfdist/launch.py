"""Start and supervise the workers of a multi-worker job on this host, without TensorFlow.

``tfdist launch -n N script.py ARGS`` starts N worker processes with ``TF_CONFIG`` set
for each (free ports on 127.0.0.1), each running ``python -m tfdist.compat script.py
ARGS`` so the compat fixes are in place before the script runs. Every output line is
prefixed with its worker (``[w0] ...``). The launcher fails fast: when a worker exits
non-zero, the others are stopped and the launcher exits non-zero naming the worker and
its exit code. With ``max_restarts=R`` it restarts the whole group at most R times; the
job resumes from its own checkpoints.

Exit codes and restarts:

* every worker exits 0: the launcher exits 0.
* a worker exits with ``RESTART_EXIT_CODE`` (75: "saved, restart me", used by the
  checkpoint module on SIGTERM): the others are stopped and the group is restarted if
  restarts remain. Restart requests and failures draw on the same ``max_restarts``
  budget, so a job that keeps asking never loops forever; when the budget is spent the
  launcher itself exits 75, so an outer scheduler (SLURM ``--requeue``, Kubernetes) can
  restart it.
* a worker fails (any other non-zero code, or a signal): the others are stopped; the
  group is restarted if restarts remain, else the launcher exits with that worker's
  code (128 + N when signal N killed it).
* the launcher gets SIGINT/SIGTERM: it forwards the signal to every worker, waits up
  to ``grace`` seconds (then SIGKILL), never restarts, and exits 0 if all workers
  exited 0, 75 if all of them exited 0 or 75 (saved), else 128 + the signal number.

Security: TensorFlow's gRPC server has no authentication and listens on all
interfaces. Local jobs therefore use 127.0.0.1 addresses only, and addresses on other
hosts (multi-node jobs) must be allowed explicitly (``allow_remote=True``,
``--allow-remote``); keep those ports on a private network (docs/multi_worker.md).

Example:
    >>> opts = LaunchOptions(nproc=2, target="train.py", args=("--epochs", "3"))
    >>> exit_code = run(opts)  # doctest: +SKIP

    $ tfdist launch -n 2 train.py --epochs 3
    $ tfdist launch -n 2 --devices-per-worker 2 --max-restarts 1 -m mypkg.train
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from tfdist.cluster import RESTART_EXIT_CODE, worker_tf_config

__all__ = [
    "LOOPBACK",
    "LaunchOptions",
    "Outcome",
    "free_ports",
    "visible_gpus",
    "cluster_addresses",
    "worker_command",
    "worker_envs",
    "run",
]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
RESTART_ENV = "TFDIST_RESTART"  # how many times the group was restarted, for the script
_POLL_S = 0.05
_READER_JOIN_S = 5.0  # output still buffered in a pipe after its worker exited
_KILL_WAIT_S = 10.0  # a SIGKILLed process is gone long before this


def _check_options(options, where: str) -> None:
    if not isinstance(options, LaunchOptions):
        raise TypeError(
            f"{where}: options must be a tfdist.launch.LaunchOptions. Received: "
            f"options={options!r}. Build one with LaunchOptions(nproc=2, target='train.py')."
        )


def _positive(value, name: str, *, zero_ok: bool = False) -> int:
    low = 0 if zero_ok else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a non-negative int" if zero_ok else "a positive int"
        raise ValueError(f"launch: {name} must be {kind}. Received: {name}={value!r}")
    return value


def _seconds(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"launch: {name} must be a positive number of seconds. Received: {name}={value!r}"
        )
    return float(value)


def _split_host(entry: str) -> tuple[str, int | None]:
    """``"h"`` -> ``("h", None)``; ``"h:2222"`` or ``"[::1]:2222"`` -> ``(host, 2222)``."""
    head, sep, tail = entry.rpartition(":")
    if sep and tail.isdigit() and (head.startswith("[") or ":" not in head):
        return head, int(tail)
    return entry, None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class LaunchOptions:
    """What to launch and how (``tfdist launch`` builds one from its flags).

    Attributes:
        nproc: worker processes on this node (``-n``).
        target: the script path, or the module name when ``module`` is True.
        args: arguments passed to the script.
        module: run ``target`` as a module (``python -m``).
        devices_per_worker: devices per worker: that many GPUs (``CUDA_VISIBLE_DEVICES``)
            on a GPU machine, else that many logical CPUs (``TFDIST_CPU_DEVICES``). None:
            the GPUs split evenly between the workers, or one CPU device each.
        max_restarts: how many times the whole group may be restarted (failures and
            restart requests together).
        port: first port; worker i of a node listens on ``port + i``. None: free
            ports on 127.0.0.1 (single node only).
        nnodes: nodes taking part in the job.
        node_rank: this node's index in ``hosts``.
        hosts: one address per node, in node-rank order; an entry ``host:port`` gives
            that node its own first port. Defaults to ``("127.0.0.1",)``.
        allow_remote: permit non-loopback ``hosts`` (TensorFlow's gRPC server is
            unauthenticated and listens on all interfaces).
        fixes: run workers through ``python -m tfdist.compat`` (the compat fixes);
            False runs ``python SCRIPT`` unchanged.
        grace: seconds between a forwarded SIGINT/SIGTERM and SIGKILL.
        stop_grace: seconds between SIGTERM and SIGKILL when stopping the survivors of
            a failed worker (they are usually stuck in a collective).
        finish_timeout: once one worker exited 0, how long the others may still run.
        python: the interpreter for the workers.

    Example:
        >>> LaunchOptions(nproc=2, target="train.py").world_size
        2
    """

    nproc: int
    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    devices_per_worker: int | None = None
    max_restarts: int = 0
    port: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    hosts: tuple[str, ...] = (LOOPBACK,)
    allow_remote: bool = False
    fixes: bool = True
    grace: float = 30.0
    stop_grace: float = 5.0
    finish_timeout: float = 600.0
    python: str = sys.executable

    def __post_init__(self):
        _positive(self.nproc, "nproc")
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(
                "launch: target must be a script path or module name. "
                f"Received: target={self.target!r}"
            )
        if isinstance(self.args, str) or not all(isinstance(a, str) for a in self.args):
            raise ValueError(
                f"launch: args must be a sequence of strings. Received: args={self.args!r}"
            )
        object.__setattr__(self, "args", tuple(self.args))
        if self.devices_per_worker is not None:
            _positive(self.devices_per_worker, "devices_per_worker")
        _positive(self.max_restarts, "max_restarts", zero_ok=True)
        _positive(self.nnodes, "nnodes")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int):
            raise ValueError(f"launch: node_rank must be an int. Received: {self.node_rank!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"launch: node_rank must be in [0, nnodes={self.nnodes}). "
                f"Received: node_rank={self.node_rank}"
            )
        if self.port is not None and (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 1024 <= self.port <= 65535 - self.nproc
        ):
            raise ValueError(
                f"launch: port must be an int in [1024, {65535 - self.nproc}] (worker i "
                f"listens on port + i). Received: port={self.port!r}"
            )
        hosts = (self.hosts,) if isinstance(self.hosts, str) else tuple(self.hosts)
        object.__setattr__(self, "hosts", hosts)
        if len(hosts) != self.nnodes or not all(isinstance(h, str) and h for h in hosts):
            raise ValueError(
                f"launch: hosts must list one address per node ({self.nnodes}). Received: "
                f"hosts={list(hosts)!r}. Pass --hosts host0,host1,... in node-rank order."
            )
        split = [_split_host(h) for h in hosts]
        if self.nnodes > 1 and self.port is None and any(p is None for _, p in split):
            raise ValueError(
                "launch: a multi-node job needs fixed ports that every node agrees on. "
                f"Received: port=None, hosts={list(hosts)!r}. Pass --port (e.g. --port 23456) "
                "or give every host its port (--hosts host0:23456,host1:23456)."
            )
        for host, port in split:
            if port is not None and not 1024 <= port <= 65535 - self.nproc:
                raise ValueError(
                    f"launch: the port of host {host!r} must be in [1024, {65535 - self.nproc}]. "
                    f"Received: hosts={list(hosts)!r}"
                )
        remote = [h for h, _ in split if not _is_loopback(h)]
        if remote and not self.allow_remote:
            raise ValueError(
                f"launch: hosts {remote} are not loopback addresses. Received: "
                f"hosts={list(hosts)!r}. TensorFlow's gRPC server has no authentication and "
                "listens on all interfaces: only use hosts on a private network, then pass "
                "--allow-remote (allow_remote=True). See docs/multi_worker.md."
            )
        for name in ("grace", "stop_grace", "finish_timeout"):
            _seconds(getattr(self, name), name)

    @property
    def world_size(self) -> int:
        """Workers in the whole job: ``nproc * nnodes``."""
        return self.nproc * self.nnodes

    def ranks(self) -> range:
        """Global ranks of this node's workers."""
        return range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc)


def free_ports(n: int, *, host: str = LOOPBACK) -> list[int]:
    """``n`` distinct TCP ports that are free on ``host`` right now (loopback only).

    The ports are only reserved while this function runs, so a worker should bind them
    soon; the launcher picks new ones for every restart.

    Example:
        >>> len(set(free_ports(3)))
        3
    """
    _positive(n, "n")
    if not _is_loopback(host):
        raise ValueError(f"free_ports: host must be a loopback address. Received: host={host!r}")
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((LOOPBACK if host == "localhost" else host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _check_ports_free(ports: Sequence[int]) -> None:
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError as err:
                raise RuntimeError(
                    f"launch: port {port} on {LOOPBACK} is in use ({err.strerror}). Received: "
                    f"ports={list(ports)}. Choose another --port, or leave --port out to use "
                    "free ports."
                ) from None


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """GPU ids this process may hand out, found without TensorFlow.

    ``CUDA_VISIBLE_DEVICES`` when set (an empty value means none; CUDA stops at the
    first negative id), else one id per NVIDIA GPU in ``/proc/driver/nvidia/gpus``.

    Example:
        >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "0,2"})
        ['0', '2']
    """
    env = os.environ if environ is None else environ
    text = env.get("CUDA_VISIBLE_DEVICES")
    if text is not None:
        ids = []
        for item in (part.strip() for part in text.split(",")):
            if not item or item.startswith("-"):
                break
            ids.append(item)
        return ids
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def cluster_addresses(options: LaunchOptions, ports: Sequence[int] | None = None) -> list[str]:
    """``host:port`` of every worker of the job, in rank order.

    Args:
        options: the launch options.
        ports: this node's ports for a single-node job without a fixed port.

    Example:
        >>> cluster_addresses(LaunchOptions(nproc=2, target="t.py", port=2222))
        ['127.0.0.1:2222', '127.0.0.1:2223']
    """
    _check_options(options, "cluster_addresses")
    split = [_split_host(h) for h in options.hosts]
    if options.port is not None or all(port is not None for _, port in split):
        return [
            f"{host}:{(port if port is not None else options.port) + i}"
            for host, port in split
            for i in range(options.nproc)
        ]
    if ports is None or len(ports) != options.nproc:
        raise ValueError(
            f"cluster_addresses: ports must list {options.nproc} ports when no fixed port is "
            f"set. Received: ports={ports!r}"
        )
    return [f"{split[0][0]}:{port}" for port in ports]


def worker_command(options: LaunchOptions) -> list[str]:
    """The command line of every worker.

    Example:
        >>> worker_command(LaunchOptions(nproc=1, target="t.py", args=("-x",)))[1:]
        ['-m', 'tfdist.compat', 't.py', '-x']
    """
    _check_options(options, "worker_command")
    target = ["-m", options.target] if options.module else [options.target]
    if options.fixes:
        return [options.python, "-m", "tfdist.compat", *target, *options.args]
    return [options.python, *target, *options.args]


def worker_envs(
    options: LaunchOptions,
    addresses: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    restart: int = 0,
) -> list[dict[str, str]]:
    """The environment of each of this node's workers (a pure function).

    Each gets ``TF_CONFIG`` for its rank, ``PYTHONUNBUFFERED=1`` (so lines arrive as
    they are printed), ``TFDIST_RESTART`` (how many times the group was restarted) and
    its devices: a slice of the visible GPUs in ``CUDA_VISIBLE_DEVICES``, or, without
    GPUs, ``TFDIST_CPU_DEVICES=devices_per_worker`` logical CPUs.

    Raises:
        ValueError: the GPUs cannot be split as asked.

    Example:
        >>> envs = worker_envs(LaunchOptions(nproc=2, target="t.py", devices_per_worker=2),
        ...                    ["127.0.0.1:1", "127.0.0.1:2"], environ={})
        >>> envs[1]["TFDIST_CPU_DEVICES"], envs[1]["TF_CONFIG"][-30:]
        ('2', '"type": "worker", "index": 1}}')
    """
    _check_options(options, "worker_envs")
    env = dict(os.environ if environ is None else environ)
    if isinstance(addresses, str) or len(addresses) != options.world_size:
        raise ValueError(
            f"worker_envs: addresses must list all {options.world_size} workers of the job. "
            f"Received: addresses={list(addresses)!r}"
        )
    gpus = visible_gpus(env)
    per = options.devices_per_worker
    if gpus:
        if per is None:
            if len(gpus) % options.nproc:
                raise ValueError(
                    f"launch: {len(gpus)} visible GPU(s) {gpus} cannot be split evenly between "
                    f"{options.nproc} workers. Received: nproc={options.nproc}. Pass "
                    "--devices-per-worker K, or set CUDA_VISIBLE_DEVICES to the GPUs to use "
                    "(CUDA_VISIBLE_DEVICES= trains on CPU)."
                )
            per = len(gpus) // options.nproc
        if per * options.nproc > len(gpus):
            raise ValueError(
                f"launch: {options.nproc} workers x {per} GPU(s) need {per * options.nproc} "
                f"GPUs, but {len(gpus)} are visible {gpus}. Received: devices_per_worker="
                f"{options.devices_per_worker}. Use fewer workers or devices per worker."
            )
    envs = []
    for local, rank in enumerate(options.ranks()):
        child = dict(env)
        child["TF_CONFIG"] = worker_tf_config(list(addresses), rank)
        child["PYTHONUNBUFFERED"] = "1"
        child[RESTART_ENV] = str(restart)
        if gpus:
            child["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[local * per : (local + 1) * per])
            child.pop("TFDIST_CPU_DEVICES", None)
        elif per is not None:
            child["TFDIST_CPU_DEVICES"] = str(per)
        # A SLURM step around the launcher must not make the workers resolve SLURM.
        for key in ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"):
            child.pop(key, None)
        envs.append(child)
    return envs


@dataclass(frozen=True)
class Outcome:
    """How one run of the worker group ended.

    Attributes:
        kind: ``ok``, ``failed``, ``restart`` (a worker exited 75) or ``signalled``
            (the launcher got SIGINT/SIGTERM).
        rank: the worker that decided it (None for ``ok``/``signalled``).
        code: that worker's exit code (negative: killed by that signal).
        codes: every worker's exit code, by rank.
    """

    kind: str
    rank: int | None = None
    code: int | None = None
    codes: dict[int, int | None] = dataclasses.field(default_factory=dict)


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    if code == RESTART_EXIT_CODE:
        return f"exited with code {code} (saved, restart requested)"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


class _Worker:
    """One worker process, its output prefixer threads and how to stop it."""

    def __init__(self, rank: int, command: list[str], env: dict[str, str], out, err, lock):
        self.rank = rank
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Own process group: signals reach the worker and its children, and a
            # Ctrl-C in the terminal reaches the launcher only, which forwards it.
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.readers = [
            threading.Thread(
                target=_prefix_lines, args=(pipe, stream, f"[w{rank}] ", lock), daemon=True
            )
            for pipe, stream in ((self.proc.stdout, out), (self.proc.stderr, err))
        ]
        for reader in self.readers:
            reader.start()

    def signal(self, sig: int, *, only_if_running: bool = True) -> None:
        if only_if_running and self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):  # the whole group is gone
            pass

    def finish(self) -> None:
        """Kills what is left of the worker's process group, reaps it, drains its output.

        The group outlives the worker when the script started processes of its own;
        its id cannot be reused while any of them lives, so this kills only those.
        """
        self.signal(signal.SIGKILL, only_if_running=False)
        try:
            self.proc.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.error("worker w%d (pid %d) did not die after SIGKILL", self.rank, self.proc.pid)
        for reader in self.readers:
            reader.join(timeout=_READER_JOIN_S)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    # If the launcher is killed (even with SIGKILL) its workers get SIGKILL too, instead
    # of training on as orphans holding their ports.
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _prefix_lines(pipe, stream: TextIO, prefix: str, lock: threading.Lock) -> None:
    """Copies ``pipe`` to ``stream``, starting every line with ``prefix``.

    Progress bars redraw a line with ``\\r``; each redraw keeps its ``\\r`` and gets the
    prefix too, so a terminal shows one live ``[w0] ...`` bar. Output is forwarded as
    soon as a line or redraw is complete, not only at newlines.
    """
    fd = pipe.fileno()
    pending = b""
    with pipe:
        while True:
            chunk = os.read(fd, 65536)
            pending += chunk
            # Hold back a trailing "\r": it may be the first half of "\r\n".
            cut = len(pending) - 1 if chunk and pending.endswith(b"\r") else len(pending)
            ready, pending = pending[:cut], pending[cut:]
            pieces = ready.replace(b"\r\n", b"\n").splitlines(keepends=True)
            if not chunk and pieces and not pieces[-1].endswith((b"\n", b"\r")):
                pieces[-1] += b"\n"  # the worker's last line had no newline
            elif pieces and not pieces[-1].endswith((b"\n", b"\r")):
                pending = pieces.pop() + pending  # incomplete: wait for the rest
            if pieces:
                text = "".join(prefix + p.decode("utf-8", errors="replace") for p in pieces)
                with lock:
                    stream.write(text)
                    stream.flush()
            if not chunk:
                return


class _Signals:
    """Records SIGINT/SIGTERM sent to the launcher while the workers run."""

    def __init__(self):
        self.received: int | None = None
        self.count = 0
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame):
        self.received = signum
        self.count += 1

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _run_group(options: LaunchOptions, restart: int, signals: _Signals, out, err) -> Outcome:
    fixed = options.port is not None or all(_split_host(h)[1] is not None for h in options.hosts)
    addresses = cluster_addresses(options, None if fixed else free_ports(options.nproc))
    if fixed and all(_is_loopback(_split_host(h)[0]) for h in options.hosts):
        # On one host, say which port is taken instead of letting TensorFlow fail later.
        mine = addresses[
            options.node_rank * options.nproc : (options.node_rank + 1) * options.nproc
        ]
        _check_ports_free([int(a.rpartition(":")[2]) for a in mine])
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
    workers: list[_Worker] = []
    try:
        for rank, env in zip(options.ranks(), envs, strict=True):
            workers.append(_Worker(rank, command, env, out, err, lock))
        return _supervise(options, workers, signals)
    finally:
        for worker in workers:
            worker.finish()


def _supervise(options: LaunchOptions, workers: list[_Worker], signals: _Signals) -> Outcome:
    decided: Outcome | None = None  # the first event that ends the group
    kill_at: float | None = None  # when the survivors get SIGKILL
    first_done_at: float | None = None
    forwarded = 0
    while True:
        now = time.monotonic()
        codes = {w.rank: w.proc.poll() for w in workers}
        running = [w for w in workers if codes[w.rank] is None]
        if signals.count > forwarded:  # forward every SIGINT/SIGTERM; a second one kills
            forwarded = signals.count
            if decided is None or decided.kind != "signalled":
                decided = Outcome("signalled")
                logger.warning(
                    "got %s: forwarding it to the workers (SIGKILL in %.0f s)",
                    signal.Signals(signals.received).name,
                    options.grace,
                )
                kill_at = now + options.grace
            else:
                kill_at = now
            for w in running:
                w.signal(signals.received)
        if decided is None:
            # Seen in the same poll: a worker killed by a signal is the likelier cause.
            ended = [w for w in workers if codes[w.rank] not in (None, 0)]
            for w in sorted(ended, key=lambda w: (codes[w.rank] >= 0, w.rank)):
                code = codes[w.rank]
                kind = "restart" if code == RESTART_EXIT_CODE else "failed"
                decided = Outcome(kind, w.rank, code)
                logger.error(
                    "worker w%d (pid %d) %s; stopping the other workers",
                    w.rank,
                    w.proc.pid,
                    _describe(code),
                )
                for other in running:
                    other.signal(signal.SIGTERM)
                kill_at = now + options.stop_grace
                break
        if decided is None and running and len(running) < len(workers):
            first_done_at = first_done_at or now
            if now - first_done_at > options.finish_timeout:
                names = ", ".join(f"w{w.rank}" for w in running)
                logger.error(
                    "worker(s) %s still running %.0f s after another worker finished; "
                    "stopping them",
                    names,
                    options.finish_timeout,
                )
                decided = Outcome("failed", running[0].rank, None)
                for w in running:
                    w.signal(signal.SIGTERM)
                kill_at = now + options.stop_grace
        if not running:
            final = {w.rank: w.proc.returncode for w in workers}
            if decided is None:
                return Outcome("ok", codes=final)
            return dataclasses.replace(decided, codes=final)
        if kill_at is not None and now >= kill_at:
            for w in running:
                logger.warning("worker w%d did not exit in time: SIGKILL", w.rank)
                w.signal(signal.SIGKILL)
            kill_at = None
        time.sleep(_POLL_S)


def run(
    options: LaunchOptions, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Runs the job's workers on this node until they finish; returns the exit code.

    See the module docstring for exit codes, restarts and signals. Status messages go
    to the ``tfdist.launch`` logger; worker output goes to ``stdout``/``stderr``
    (default: this process's), each line prefixed with ``[wRANK]``.

    Args:
        options: what to launch.
        stdout: where the workers' stdout lines go.
        stderr: where the workers' stderr lines go.

    Example:
        >>> run(LaunchOptions(nproc=2, target="train.py"))  # doctest: +SKIP
        0
    """
    _check_options(options, "run")
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    if not options.module and not os.path.isfile(options.target):
        raise FileNotFoundError(
            f"launch: script {options.target!r} not found. Received: target="
            f"{options.target!r}. Pass a script path, or -m MODULE for a module."
        )
    restart = 0
    with _Signals() as signals:
        while True:
            outcome = _run_group(options, restart, signals, out, err)
            if outcome.kind == "ok":
                logger.info(
                    "all %d worker(s) finished: %s",
                    options.nproc,
                    ", ".join(f"w{rank} exited 0" for rank in sorted(outcome.codes)),
                )
                return 0
            if outcome.kind == "signalled":
                codes = set(outcome.codes.values())
                if codes <= {0}:
                    return 0
                if codes <= {0, RESTART_EXIT_CODE}:
                    return RESTART_EXIT_CODE
                return 128 + (signals.received or signal.SIGTERM)
            what = (
                f"worker w{outcome.rank} {_describe(outcome.code)}"
                if outcome.code is not None
                else f"worker w{outcome.rank} did not finish in time"
            )
            if restart < options.max_restarts and not signals.count:
                restart += 1
                logger.warning(
                    "%s: restarting all workers (restart %d of %d)",
                    what,
                    restart,
                    options.max_restarts,
                )
                continue
            if outcome.kind == "restart":
                logger.error("%s, and no restarts are left (--max-restarts)", what)
                return RESTART_EXIT_CODE
            logger.error("failed: %s", what)
            return _exit_code(outcome.code) if outcome.code else 1
