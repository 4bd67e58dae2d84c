"""Who can reach the workers' ports: a private network namespace, or a firewall rule.

TensorFlow's gRPC server listens on every interface (``*:PORT``, whatever TF_CONFIG
names) and has no authentication: whoever reaches a worker's port can run TensorFlow
operations in it. ``network_mode`` picks the protection for a job:

* ``private`` (one node, the default on Linux): the workers share a new network
  namespace whose only interface is its own loopback, so their ports exist nowhere
  else. The launcher stays in this host's namespace (signals, output and exit codes are
  unchanged); each worker joins the namespace between fork and exec. Where namespaces
  are not available the job runs on this host's network with a warning.
* ``shared`` (``shared_network=True``, ``--shared-network``, ``TFDIST_SHARED_NETWORK=1``):
  this host's network, for jobs that need the outside network.
* ``hosts`` (several nodes, or a non-loopback host): the workers must use this host's
  real interfaces; ``firewall_rules`` (``--firewall print|apply``) admits the worker
  ports only from the job's hosts and loopback.

Example:
    >>> network_mode(LaunchOptions(nproc=2, target="t.py"))
    'private'
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence

from tfdist.core.config import ConfigError
from tfdist.launch.options import LaunchOptions, check_options, is_loopback, split_host

__all__ = [
    "NamespaceUnavailable",
    "PrivateNetwork",
    "JobNetwork",
    "network_mode",
    "node_ports",
    "firewall_rules",
    "firewall_table",
]

logger = logging.getLogger(__name__)

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_NAMESPACE_TIMEOUT_S = 10.0  # the holder process creating the namespace answering
_NFT_TIMEOUT_S = 10.0  # one nft command
_DOCS = "docs/multi_worker.md"
_MODES = {"shared": "shared network (--shared-network)", "hosts": "multi-node job"}

# Run by `python -I -S -c` (no site: starts in milliseconds): creates the namespaces,
# maps this user into the user namespace (unprivileged case), brings loopback up, says
# "ready" and holds the namespaces until its stdin closes, while the launcher opens them.
_HOLDER = r"""
import ctypes, fcntl, os, socket, struct, sys
flags = int(sys.argv[1])
uid, gid = os.getuid(), os.getgid()
try:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    if flags & 0x10000000:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0))  # SIOCGIFFLAGS
        up = struct.unpack("16sH22x", req)[1] | 1  # IFF_UP
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", up))  # SIOCSIFFLAGS
except Exception as err:
    print("error", err, flush=True)
    sys.exit(1)
print("ready", flush=True)
sys.stdin.read()
"""


class NamespaceUnavailable(OSError):
    """This system does not let the launcher create a private network namespace."""


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def _attempts() -> list[int]:
    # root can make a network namespace alone; otherwise (or where root lacks
    # CAP_SYS_ADMIN, e.g. in a container) a user namespace grants the right to.
    both = CLONE_NEWUSER | CLONE_NEWNET
    return [CLONE_NEWNET, both] if os.geteuid() == 0 else [both]


def _hold(flags: int, timeout: float) -> tuple[subprocess.Popen, str]:
    """Starts a holder with ``flags``; returns it and its first line (``ready``/``error``)."""
    holder = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _HOLDER, str(flags)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert holder.stdout is not None  # stdout=PIPE above
    ready, _, _ = select.select([holder.stdout], [], [], timeout)
    line = holder.stdout.readline().strip() if ready else ""
    return holder, line or f"error: no answer within {timeout:.0f} s"


def _release(holder: subprocess.Popen) -> None:
    # A holder from _hold: its stdin and stdout are pipes.
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.close()  # the holder's cue to exit
    try:
        holder.wait(timeout=_NAMESPACE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait(timeout=_NAMESPACE_TIMEOUT_S)
    holder.stdout.close()


class PrivateNetwork:
    """A new network namespace with only a loopback, for workers to join (a context).

    The namespaces live as long as this object holds them open (``close``) or a worker
    is inside.

    Example:
        >>> with PrivateNetwork.create() as net:  # doctest: +SKIP
        ...     subprocess.run(["ss", "-ltn"], preexec_fn=net.enter)
    """

    def __init__(self, net_fd: int, user_fd: int | None):
        # Both None once closed (close).
        self.net_fd: int | None = net_fd
        self.user_fd: int | None = user_fd

    @classmethod
    def create(cls, timeout: float = _NAMESPACE_TIMEOUT_S) -> PrivateNetwork:
        """Creates the namespaces (in a short-lived holder process).

        Raises:
            NamespaceUnavailable: not Linux, or the kernel refused (the reason is named).
        """
        if _LIBC is None:
            raise NamespaceUnavailable("network namespaces need Linux")
        reasons = []
        for flags in _attempts():
            holder, line = _hold(flags, timeout)
            try:
                if line == "ready":
                    user = CLONE_NEWUSER & flags
                    net_fd = os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                    path = f"/proc/{holder.pid}/ns/user"
                    user_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if user else None
                    return cls(net_fd, user_fd)
                reasons.append(line.removeprefix("error").strip(" :"))
            finally:
                _release(holder)
        raise NamespaceUnavailable(f"unshare(CLONE_NEWNET) failed: {'; '.join(reasons)}")

    def enter(self) -> None:  # pragma: no cover - runs in the child between fork and exec
        """Moves the calling (single-threaded, just forked) process into the namespace."""
        for fd, kind in ((self.user_fd, CLONE_NEWUSER), (self.net_fd, CLONE_NEWNET)):
            if fd is not None and _LIBC.setns(fd, kind) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns: {os.strerror(err)}")

    def close(self) -> None:
        """Lets the namespaces go once no worker is inside."""
        for fd in (self.net_fd, self.user_fd):
            if fd is not None:
                os.close(fd)
        self.net_fd = self.user_fd = None

    def __enter__(self) -> PrivateNetwork:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def network_mode(options: LaunchOptions) -> str:
    """``private``, ``shared`` or ``hosts``: where this node's workers listen (see above).

    Example:
        >>> network_mode(LaunchOptions(nproc=2, target="t.py", shared_network=True))
        'shared'
    """
    check_options(options, "network_mode")
    if options.nnodes > 1 or not all(is_loopback(split_host(h)[0]) for h in options.hosts):
        return "hosts"  # other nodes must reach these workers: a private loopback cannot
    return "shared" if options.shared_network else "private"


def node_ports(options: LaunchOptions, addresses: Sequence[str]) -> list[int]:
    """The ports this node's workers listen on, from the job's ``addresses``.

    Example:
        >>> node_ports(LaunchOptions(nproc=1, target="t.py"), ["127.0.0.1:2222"])
        [2222]
    """
    mine = addresses[options.ranks().start : options.ranks().stop]
    return [int(a.rpartition(":")[2]) for a in mine]


def firewall_table() -> str:
    """The nftables table of this launcher: ``inet tfdist_PID``."""
    return f"tfdist_{os.getpid()}"


def _peer_addresses(options: LaunchOptions) -> tuple[list[str], list[str]]:
    """IPv4 and IPv6 addresses of the job's non-loopback hosts (names resolved)."""
    v4: set[str] = set()
    v6: set[str] = set()
    for host, _ in map(split_host, options.hosts):
        if is_loopback(host):
            continue
        try:
            infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
        except socket.gaierror as err:
            raise ConfigError(
                f"launch: cannot resolve host {host!r} for the firewall rule ({err}). "
                f"Received: hosts={list(options.hosts)!r}. Use IP addresses in --hosts."
            ) from None
        for family, *_, sockaddr in infos:
            (v6 if family == socket.AF_INET6 else v4).add(str(sockaddr[0]))  # an IP address
    return sorted(v4), sorted(v6)


def firewall_rules(options: LaunchOptions, addresses: Sequence[str], table: str = "") -> str:
    """nftables rules that admit this node's worker ports only from loopback and the
    job's hosts (``nft -f`` input; ``table`` default ``firewall_table()``).

    Example:
        >>> opts = LaunchOptions(nproc=1, target="t.py", port=2222)
        >>> "tcp dport { 2222 } reject" in firewall_rules(opts, ["127.0.0.1:2222"])
        True
    """
    check_options(options, "firewall_rules")
    ports = ", ".join(map(str, node_ports(options, addresses)))
    v4, v6 = _peer_addresses(options)
    lines = [
        f"# tfdist launch: worker ports of node {options.node_rank} only for the job's hosts",
        f"table inet {table or firewall_table()} {{",
        "  chain input {",
        "    type filter hook input priority -10; policy accept;",
        '    iif "lo" accept',
    ]
    if v4:
        lines.append(f"    ip saddr {{ {', '.join(v4)} }} tcp dport {{ {ports} }} accept")
    if v6:
        lines.append(f"    ip6 saddr {{ {', '.join(v6)} }} tcp dport {{ {ports} }} accept")
    lines += [f"    tcp dport {{ {ports} }} reject with tcp reset", "  }", "}"]
    return "\n".join(lines) + "\n"


def _nft(args: list[str], text: str | None = None) -> None:
    nft = shutil.which("nft")
    hint = "--firewall apply needs root and nftables (apt-get install nftables)"
    if nft is None:
        raise ConfigError(f"launch: nft not found. Received: firewall=True. {hint}.")
    try:
        proc = subprocess.run(
            [nft, *args], input=text, capture_output=True, text=True, timeout=_NFT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"launch: nft {' '.join(args)} did not answer in 10 s. {hint}.") from None
    if proc.returncode != 0:
        raise ConfigError(
            f"launch: nft {' '.join(args)} failed: {proc.stderr.strip()}. Received: "
            f"firewall=True. {hint}; or load the rules of --firewall print yourself."
        )


class JobNetwork:
    """The network of one ``run``: a fresh private namespace per group start, or this
    host's network (with the firewall rule when asked); says which in one log line."""

    def __init__(self, options: LaunchOptions):
        self.options, self.mode = options, network_mode(options)
        self._private: PrivateNetwork | None = None
        self._table: str | None = None
        self._told = False

    def start(self, addresses: Sequence[str]) -> Callable[[], None] | None:
        """Prepares a group start; returns what each worker runs to enter its network."""
        ports = ", ".join(str(p) for p in node_ports(self.options, addresses))
        reason, level = _MODES.get(self.mode, ""), logging.WARNING
        if self.mode == "private":
            try:
                self._private = PrivateNetwork.create()
            except NamespaceUnavailable as err:
                reason = f"no private network ({err})"
            else:
                self._tell(
                    logging.INFO,
                    f"private network: the workers share a network namespace with its own "
                    f"loopback; their ports ({ports}) are not reachable from outside the job "
                    "(--shared-network: use this host's network)",
                )
                return self._private.enter
        if self.options.firewall:
            self._apply(addresses)
            message = (
                f"firewall: nftables table inet {self._table} admits worker ports {ports} only "
                "from loopback and the job's hosts (removed when the launcher ends)"
            )
            level = logging.INFO if self.mode != "private" else level
        else:
            message = self._exposed(ports)
        self._tell(level, f"{reason}: {message}")
        return None

    def _exposed(self, ports: str) -> str:
        peers = "the job's hosts" if self.mode == "hosts" else "this host"
        return (
            f"worker ports {ports} listen unauthenticated on every interface of this host; "
            f"admit them only from {peers} (as root: --firewall apply; the rules: "
            f"--firewall print; {_DOCS})"
        )

    def _apply(self, addresses: Sequence[str]) -> None:
        table = firewall_table()
        rules = firewall_rules(self.options, addresses, table)
        # Replaces the rules of an earlier start atomically (free ports change).
        _nft(["-f", "-"], f"table inet {table}\ndelete table inet {table}\n{rules}")
        self._table = table

    def _tell(self, level: int, message: str) -> None:
        # One line per run: restarts keep the same protection.
        logger.log(level if not self._told else logging.DEBUG, message)
        self._told = True

    def end_group(self) -> None:
        """After a group's workers are gone: lets its namespace go."""
        if self._private is not None:
            self._private.close()
            self._private = None

    def close(self) -> None:
        """At the end of the run: removes the firewall rules it applied."""
        self.end_group()
        if self._table is not None:
            table, self._table = self._table, None
            try:
                _nft(["delete", "table", "inet", table])
            except ConfigError as err:
                logger.error("could not remove the firewall rules: %s", err)
