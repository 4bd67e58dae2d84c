"""``LaunchOptions``: what to launch and how, checked once when built.

Errors follow ``tfdist.core.validate``'s rule: a value of the wrong type raises ``TypeError``;
a value of the right type that is not allowed raises ``ConfigError`` (a ``ValueError``),
which ``tfdist launch`` prints as one line.

Example:
    >>> LaunchOptions(nproc=2, target="train.py").ranks()
    range(0, 2)
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from tfdist.core import validate
from tfdist.core.config import ConfigError, launch_python, private_egress, shared_network

__all__ = [
    "LOOPBACK",
    "LaunchOptions",
    "check_options",
    "split_host",
    "is_loopback",
    "visible_gpus",
]

LOOPBACK = "127.0.0.1"
_WHERE = "launch"


def split_host(entry: str) -> tuple[str, int | None]:
    """``"h"`` -> ``("h", None)``; ``"h:2222"`` or ``"[::1]:2222"`` -> ``(host, 2222)``.

    Example:
        >>> split_host("10.0.0.1:2222"), split_host("::1")
        (('10.0.0.1', 2222), ('::1', None))
    """
    head, sep, tail = entry.rpartition(":")
    if sep and tail.isdigit() and (head.startswith("[") or ":" not in head):
        return head, int(tail)
    return entry, None


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (``[::1]`` included).

    Example:
        >>> is_loopback("127.0.0.2"), is_loopback("10.0.0.1")
        (True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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


def check_options(options, where: str) -> None:
    """TypeError unless ``options`` is a ``LaunchOptions`` (``where`` names the caller)."""
    validate.instance(
        options,
        LaunchOptions,
        "options",
        where,
        "a tfdist.launch.LaunchOptions",
        "Build one with LaunchOptions(nproc=2, target='train.py').",
    )


def _setting(check, value, name: str, *args, **kwargs):
    """``check(value, name, "launch", ...)``, a bad value raised as ``ConfigError``."""
    try:
        return check(value, name, _WHERE, *args, **kwargs)
    except ConfigError:
        raise
    except ValueError as err:  # a wrong type stays a TypeError: the caller's bug
        raise ConfigError(str(err)) from None


def _workers(nproc: int | str) -> int:
    """``auto``: one worker per visible GPU, else 1; ``gpu``: one per GPU (GPUs needed)."""
    if nproc not in ("auto", "gpu"):
        return nproc  # type: ignore[return-value]  # an int, checked by LaunchOptions
    gpus = len(visible_gpus())
    if gpus:
        return gpus
    if nproc == "gpu":
        raise ConfigError(
            "launch: --nproc-per-node gpu needs a GPU. Received: nproc_per_node='gpu', and "
            "none is visible (CUDA_VISIBLE_DEVICES, /proc/driver/nvidia/gpus). Pass a number, "
            "or auto (1 worker without GPUs)."
        )
    return 1


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
        shared_network: a single-node job's workers use this host's network instead of
            a private network namespace (for jobs that need the outside network; their
            ports are then reachable from it). None: ``TFDIST_SHARED_NETWORK``, else
            False. Multi-node jobs always use this host's network.
        private_egress: the private network gives the workers outbound connections
            (pasta or slirp4netns; no port forwarded in). None:
            ``TFDIST_PRIVATE_EGRESS``, else True. False: loopback only.
        firewall: while the job runs, admit this node's worker ports only from loopback
            and the job's hosts with an nftables rule (needs root and ``nft``); not
            needed, and not applied, when the private network is in use.
        fixes: run workers through ``python -m tfdist.bootstrap`` (tfdist's fixes
            applied before the script runs); False runs ``python SCRIPT`` unchanged.
        grace: seconds between a forwarded SIGINT/SIGTERM and SIGKILL.
        stop_grace: seconds between SIGTERM and SIGKILL when stopping the survivors of
            a failed worker (they are usually stuck in a collective).
        finish_timeout: once one worker exited 0, how long the others may still run.
        python: the interpreter for the workers (default: ``TFDIST_LAUNCH_PYTHON``, else
            the launcher's own).
        log_dir: write worker i's whole output (stdout and stderr, unfiltered, without
            progress-bar redraws) to ``LOG_DIR/worker-<i>.log``; the console then only
            gets the launcher's messages unless ``tee``.
        tee: with ``log_dir``, also print the workers' output, prefixed (torchrun's
            ``--tee``).
        verbose: show every worker line; False (the default) drops the known-harmless
            start-up noise (``tfdist.core.quiet``) and gives workers ``TF_CPP_MIN_LOG_LEVEL=2``
            unless it is set.

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
    shared_network: bool | None = None
    private_egress: bool | None = None
    firewall: bool = False
    fixes: bool = True
    grace: float = 30.0
    stop_grace: float = 5.0
    finish_timeout: float = 600.0
    python: str = field(default_factory=launch_python)  # TFDIST_LAUNCH_PYTHON, else ours
    log_dir: str | None = None
    tee: bool = False
    verbose: bool = False

    def __post_init__(self):
        self._check_counts()
        self._check_target()
        self._check_ports()
        self._check_hosts()
        self._check_remote()
        self._check_network()
        self._check_timeouts()
        self._check_output()
        self._set("python", launch_python(self.python))

    @classmethod
    def from_flags(
        cls,
        *,
        nproc: int | str,
        target: str | None,
        hosts: str | None = None,
        nnodes: int | None = None,
        standalone: bool = False,
        **fields,
    ) -> LaunchOptions:
        """The options ``tfdist launch``'s flags describe, checked here like the rest.

        ``nproc`` may also be ``"auto"`` (one worker per visible GPU, else 1) or ``"gpu"``
        (one per visible GPU; GPUs needed); ``target`` None is a missing script;
        ``hosts`` is the ``--hosts`` text (``"h0,h1"``); ``nnodes`` None: the number of
        hosts, or 1; ``standalone`` (torchrun's flag) insists on one node on loopback.
        The other ``fields`` are ``LaunchOptions``'s own.

        Example:
            >>> LaunchOptions.from_flags(nproc=2, target="t.py", hosts="127.0.0.1").hosts
            ('127.0.0.1',)
        """
        if target is None:
            raise ConfigError(
                "launch: missing the script to run. Received: no SCRIPT. "
                "Usage: tfdist launch -n N script.py [ARGS...] (or -m MODULE [ARGS...])."
            )
        what = "a comma-separated list of 'host[:port]' (a str)"
        validate.instance(hosts, (str, type(None)), "hosts", _WHERE, what)
        listed = tuple(h.strip() for h in hosts.split(",")) if hosts else None
        nodes = nnodes if nnodes is not None else (len(listed) if listed else 1)
        if standalone and (nodes > 1 or hosts):  # torchrun's: one node, loopback, free ports
            raise ConfigError(
                "launch: --standalone runs a single-node job on loopback. Received: "
                f"nnodes={nodes}, hosts={hosts!r}. Leave out --standalone, or --nnodes/--hosts."
            )
        loopback = (LOOPBACK,) * nodes if isinstance(nodes, int) else (LOOPBACK,)
        # (A bad nnodes is refused before hosts are looked at.)
        return cls(
            nproc=_workers(nproc), target=target, nnodes=nodes, hosts=listed or loopback, **fields
        )

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # normalizing a field of a frozen instance

    def _check_counts(self) -> None:
        self._set("nproc", _setting(validate.positive_int, self.nproc, "nproc"))
        if self.devices_per_worker is not None:
            per = _setting(validate.positive_int, self.devices_per_worker, "devices_per_worker")
            self._set("devices_per_worker", per)
        restarts = _setting(validate.non_negative_int, self.max_restarts, "max_restarts")
        self._set("max_restarts", restarts)
        self._set("nnodes", _setting(validate.positive_int, self.nnodes, "nnodes"))
        what = f"an int in [0, nnodes={self.nnodes})"
        rank = _setting(validate.integer, self.node_rank, "node_rank", low=0, what=what)
        if rank >= self.nnodes:
            raise ConfigError(validate.message(_WHERE, "node_rank", what, rank))
        self._set("node_rank", rank)

    def _check_target(self) -> None:
        validate.instance(
            self.target, str, "target", _WHERE, "a script path or module name (a str)"
        )
        if not self.target:
            raise ConfigError(
                validate.message(_WHERE, "target", "a script path or module name", self.target)
            )
        if isinstance(self.args, str) or not all(isinstance(a, str) for a in self.args):
            raise TypeError(
                validate.message(
                    _WHERE, "args", "a sequence of strings", self.args, "e.g. ('--epochs', '3')."
                )
            )
        self._set("args", tuple(self.args))

    def _port_range(self) -> tuple[int, int]:
        return 1024, 65535 - self.nproc  # worker i listens on port + i

    def _check_ports(self) -> None:
        if self.port is None:
            return
        low, high = self._port_range()
        what = f"an int in [{low}, {high}] (worker i listens on port + i)"
        port = _setting(validate.integer, self.port, "port", low=low, what=what)
        if port > high:
            raise ConfigError(validate.message(_WHERE, "port", what, port))
        self._set("port", port)

    def _check_hosts(self) -> None:
        hosts = (self.hosts,) if isinstance(self.hosts, str) else tuple(self.hosts)
        self._set("hosts", hosts)
        if not all(isinstance(h, str) for h in hosts):
            raise TypeError(
                validate.message(_WHERE, "hosts", "a sequence of 'host[:port]' strings", hosts)
            )
        if len(hosts) != self.nnodes or not all(hosts):
            raise ConfigError(
                f"launch: hosts must list one address per node ({self.nnodes}). Received: "
                f"hosts={list(hosts)!r}. Pass --hosts host0,host1,... in node-rank order."
            )
        split = [split_host(h) for h in hosts]
        if self.nnodes > 1 and self.port is None and any(p is None for _, p in split):
            raise ConfigError(
                "launch: a multi-node job needs fixed ports that every node agrees on. "
                f"Received: port=None, hosts={list(hosts)!r}. Pass --port (e.g. --port 23456) "
                "or give every host its port (--hosts host0:23456,host1:23456)."
            )
        low, high = self._port_range()
        for host, port in split:
            if port is not None and not low <= port <= high:
                raise ConfigError(
                    f"launch: the port of host {host!r} must be in [{low}, {high}]. "
                    f"Received: hosts={list(hosts)!r}"
                )

    def _check_remote(self) -> None:
        remote = [h for h, _ in map(split_host, self.hosts) if not is_loopback(h)]
        if remote and not self.allow_remote:
            raise ConfigError(
                f"launch: hosts {remote} are not loopback addresses. Received: "
                f"hosts={list(self.hosts)!r}. TensorFlow's gRPC server has no authentication "
                "and listens on all interfaces: only use hosts on a private network, then pass "
                "--allow-remote (allow_remote=True). See docs/launching.md#several-machines."
            )

    def _check_network(self) -> None:
        for name in ("shared_network", "private_egress", "firewall"):
            value = getattr(self, name)
            if value is not None or name == "firewall":
                validate.instance(value, bool, name, _WHERE, "a bool")
        # Precedence: the argument, then TFDIST_SHARED_NETWORK / TFDIST_PRIVATE_EGRESS,
        # then False / True.
        self._set("shared_network", shared_network(self.shared_network))
        self._set("private_egress", private_egress(self.private_egress))

    def _check_timeouts(self) -> None:
        for name in ("grace", "stop_grace", "finish_timeout"):
            value = getattr(self, name)
            if value == math.inf:  # no limit
                continue
            what = "a positive number of seconds"
            seconds = _setting(validate.number, value, name, low=0.0, low_ok=False, what=what)
            self._set(name, seconds)

    def _check_output(self) -> None:
        for name in ("tee", "verbose"):
            validate.instance(getattr(self, name), bool, name, _WHERE, "a bool")
        if self.log_dir is not None:
            validate.instance(self.log_dir, str, "log_dir", _WHERE, "a directory path (a str)")
            if not self.log_dir:
                raise ConfigError(validate.message(_WHERE, "log_dir", "a directory path", ""))
        elif self.tee:
            raise ConfigError(
                validate.message(
                    _WHERE, "tee", "False without log_dir", True, "Pass --log-dir DIR with --tee."
                )
            )

    @property
    def world_size(self) -> int:
        """Workers in the whole job: ``nproc * nnodes``."""
        return self.nproc * self.nnodes

    @property
    def fixed_ports(self) -> bool:
        """True when the ports come from ``port`` or ``hosts``, not from free ports."""
        return self.port is not None or all(split_host(h)[1] is not None for h in self.hosts)

    def ranks(self) -> range:
        """Global ranks of this node's workers."""
        return range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc)
