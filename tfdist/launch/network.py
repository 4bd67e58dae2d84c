"""Who can reach the workers' ports: a private network namespace, or a firewall rule.

TensorFlow's gRPC server listens on every interface (``*:PORT``, whatever TF_CONFIG
names) and has no authentication: whoever reaches a worker's port can run TensorFlow
operations in it. ``network_mode`` picks the protection for a job:

* ``private`` (one node, the default on Linux): the workers share a new network
  namespace, so their ports exist nowhere else. The launcher stays in this host's
  namespace (signals, output and exit codes are unchanged); each worker joins the
  namespace between fork and exec. Where namespaces are not available the job runs on
  this host's network with a warning.

  Outbound only: a user-mode network stack attached to the namespace, ``pasta`` (from
  the passt package) or else ``slirp4netns``, gives it a default route and carries the
  workers' outbound connections (an object store, a data set hub, DNS) out through this
  host's sockets; this host's loopback is reachable at the namespace's default gateway.
  No port is forwarded into the namespace. Without either tool (or when it fails to
  start) the namespace has its loopback only and one warning says so;
  ``TFDIST_PRIVATE_EGRESS=0`` leaves the stack out on purpose.
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

import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Sequence

from tfdist.core.config import PRIVATE_EGRESS_ENV, ConfigError, private_egress
from tfdist.launch.environment import cluster_addresses
from tfdist.launch.namespace import NamespaceUnavailable, PrivateNetwork
from tfdist.launch.options import LaunchOptions, check_options, is_loopback, split_host

__all__ = [
    "EGRESS_ENV",
    "JobNetwork",
    "network_mode",
    "private_egress",
    "node_ports",
    "firewall_rules",
    "printed_firewall_rules",
    "firewall_table",
]

logger = logging.getLogger(__name__)


_NFT_TIMEOUT_S = 10.0  # one nft command
EGRESS_ENV = PRIVATE_EGRESS_ENV
_NO_EGRESS_HINT = "install passt (or slirp4netns), or pass --shared-network"
_DOCS = "docs/security.md"
_MODES = {"shared": "shared network (--shared-network)", "hosts": "multi-node job"}


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


def printed_firewall_rules(options: LaunchOptions) -> str:
    """``tfdist launch --firewall print``: ``firewall_rules`` for the job's fixed ports, in a
    table named after the first of them (the rules are loaded by hand and outlive this
    process).

    Example:
        >>> opts = LaunchOptions(nproc=1, target="t.py", port=2222)
        >>> printed_firewall_rules(opts).splitlines()[1]
        'table inet tfdist_2222 {'
    """
    check_options(options, "printed_firewall_rules")
    if not options.fixed_ports:
        raise ConfigError(
            "launch: --firewall print needs fixed ports. Received: no --port. Pass --port P "
            "(or host:port in --hosts): the rules name the ports."
        )
    addresses = cluster_addresses(options)
    first = node_ports(options, addresses)[0]
    return firewall_rules(options, addresses, table=f"tfdist_{first}")


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
    host's network (with the firewall rule when asked); says which in one log line.

    ``egress`` (default ``options.private_egress``: ``--no-private-egress``,
    ``TFDIST_PRIVATE_EGRESS``, else True): the private namespace gets outbound
    connections through a user-mode network stack.
    """

    def __init__(self, options: LaunchOptions, egress: bool | None = None):
        self.options, self.mode = options, network_mode(options)
        self.egress = private_egress(options.private_egress if egress is None else egress)
        self._private: PrivateNetwork | None = None
        self._table: str | None = None
        self._told = logging.NOTSET  # the level of the loudest line said so far

    def start(self, addresses: Sequence[str]) -> Callable[[], None] | None:
        """Prepares a group start; returns what each worker runs to enter its network."""
        ports = ", ".join(str(p) for p in node_ports(self.options, addresses))
        reason, level = _MODES.get(self.mode, ""), logging.WARNING
        if self.mode == "private":
            try:
                self._private = PrivateNetwork.create(egress=self.egress)
            except NamespaceUnavailable as err:
                reason = f"no private network ({err})"
            else:
                self._tell(*self._private_line(self._private, ports))
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

    def _private_line(self, private: PrivateNetwork, ports: str) -> tuple[int, str]:
        shared = "--shared-network: this host's network"
        if private.egress is not None:
            return logging.INFO, (
                f"private network: the workers share a network namespace; their ports "
                f"({ports}) are not reachable from outside the job, and their outbound "
                f"connections go out through {private.egress} ({EGRESS_ENV}=0: loopback "
                f"only; {shared})"
            )
        head = (
            f"private network: the workers share a network namespace with only its own "
            f"loopback; their ports ({ports}) are not reachable from outside the job"
        )
        if not self.egress:
            return (
                logging.INFO,
                f"{head}, nor anything outside it from them ({EGRESS_ENV}=0; {shared})",
            )
        return logging.WARNING, (
            f"{head}, and they cannot reach anything outside it (other hosts, the internet, "
            f"this host's services): {private.no_egress}; {_NO_EGRESS_HINT}"
        )

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
        # One line per run: restarts keep the same protection. A restart that brings a
        # warning (its stack did not start) still says it, once.
        logger.log(level if level > self._told else logging.DEBUG, message)
        self._told = max(self._told, level)

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
