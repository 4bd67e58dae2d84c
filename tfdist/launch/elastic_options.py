"""How an elastic job meets: ``tfdist launch``'s elastic flags, checked (``ElasticOptions``).

``--nnodes MIN:MAX --rdzv-backend {c10d,etcd} --rdzv-endpoint HOST:PORT[,...] --rdzv-id JOB
--rdzv-conf lease=5,join_timeout=600,last_call_timeout=3 --local-addr HOST`` become one
``ElasticOptions``, as ``tfdist.launch.options.LaunchOptions`` holds the other flags;
``tfdist.launch.elastic`` runs the job.

Example:
    >>> ElasticOptions(min_nodes=2, max_nodes=3, endpoints=("127.0.0.1:29400",), job="j").max_nodes
    3
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from tfdist.core import validate
from tfdist.core.config import ConfigError
from tfdist.launch.options import is_loopback, split_host
from tfdist.launch.rendezvous import parse_nnodes

__all__ = ["BACKENDS", "ElasticOptions", "node_host", "wanted"]


def wanted(nnodes: str | int | None, rdzv_endpoint: str | None) -> bool:
    """An elastic job: ``--nnodes MIN:MAX`` with MIN < MAX, or a ``--rdzv-endpoint``.

    Example:
        >>> wanted("2:3", None), wanted("2", None), wanted(None, "10.0.0.1:29400")
        (True, False, True)
    """
    if rdzv_endpoint:
        return True
    if not isinstance(nnodes, str) or ":" not in nnodes:
        return False
    low, high = parse_nnodes(nnodes)
    return low < high


_RDZV_CONF = {"lease": "lease", "join_timeout": "join_timeout", "last_call_timeout": "last_call"}


def _rdzv_conf(text: str | None) -> dict:
    """``lease=5,join_timeout=600,last_call_timeout=3`` -> ElasticOptions fields."""
    conf = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        try:
            conf[_RDZV_CONF[key.strip()]] = float(value)
        except (KeyError, ValueError):
            raise ConfigError(
                f"launch: rdzv_conf takes {', '.join(_RDZV_CONF)} as KEY=SECONDS. Received: "
                f"rdzv_conf={text!r}. e.g. --rdzv-conf lease=5,join_timeout=600."
            ) from None
    return conf


_WHERE = "launch"
BACKENDS = ("c10d", "etcd")  # where the nodes meet (--rdzv-backend)


@dataclass(frozen=True)
class ElasticOptions:
    """How an elastic job meets (``tfdist launch --nnodes MIN:MAX``).

    Attributes:
        min_nodes, max_nodes: the job trains on at least MIN and at most MAX nodes.
        endpoints: ``host:port`` of the rendezvous store, then the places it moves to
            when its host is lost (``--rdzv-endpoint``); with ``backend="etcd"``, the
            etcd cluster's members.
        job: the job's id (``--rdzv-id``); a node with another id is refused (c10d) or
            meets in another job (etcd).
        host: the address this node's workers are reached at (None: the address this
            machine uses to reach the first endpoint).
        lease: seconds without a renewal after which a node counts as lost.
        join_timeout: seconds to wait for MIN nodes before giving up.
        last_call: once MIN nodes are there, seconds to wait for more before starting.
        backend: ``"c10d"`` (a store one node's launcher hosts) or ``"etcd"``
            (``tfdist.launch.rendezvous.etcd``), as ``--rdzv-backend``.
    """

    min_nodes: int
    max_nodes: int
    endpoints: tuple[str, ...]
    job: str
    host: str | None = None
    lease: float = 5.0
    join_timeout: float = 600.0
    last_call: float = 3.0
    backend: str = "c10d"

    @classmethod
    def from_flags(
        cls,
        *,
        nnodes: str | None,
        rdzv_endpoint: str | None,
        rdzv_backend: str = "c10d",
        rdzv_id: str | None,
        rdzv_conf: str | None = None,
        local_addr: str | None = None,
        hosts: str | None = None,
        node_rank: int = 0,
        standalone: bool = False,
    ) -> ElasticOptions:
        """The options ``tfdist launch``'s elastic flags describe, checked here.

        Example:
            >>> ElasticOptions.from_flags(nnodes="2:3", rdzv_endpoint="127.0.0.1:29400",
            ...                           rdzv_id="j", rdzv_conf="lease=3").lease
            3.0
        """
        if hosts or node_rank or standalone:
            raise ConfigError(
                "launch: an elastic job (--nnodes MIN:MAX or --rdzv-endpoint) numbers its "
                f"nodes itself. Received: hosts={hosts!r}, node_rank={node_rank}, "
                f"standalone={standalone}. Leave out --hosts, --node-rank and --standalone."
            )
        if not rdzv_endpoint or not rdzv_id:
            raise ConfigError(
                "launch: an elastic job needs where its nodes meet and a job id. Received: "
                f"rdzv_endpoint={rdzv_endpoint!r}, rdzv_id={rdzv_id!r}. Pass --rdzv-endpoint "
                "HOST:PORT (an address of one of the nodes; with --rdzv-backend etcd, of etcd) "
                "and --rdzv-id NAME."
            )
        low, high = parse_nnodes(str(nnodes or "1:1"))
        return cls(
            min_nodes=low,
            max_nodes=high,
            endpoints=tuple(e.strip() for e in rdzv_endpoint.split(",")),
            job=rdzv_id,
            host=local_addr,
            backend=rdzv_backend,
            **_rdzv_conf(rdzv_conf),
        )

    def __post_init__(self):
        low = validate.positive_int(self.min_nodes, "min_nodes", _WHERE)
        high = validate.positive_int(self.max_nodes, "max_nodes", _WHERE)
        if low > high:
            raise ConfigError(
                validate.message(_WHERE, "nnodes", "MIN:MAX with MIN <= MAX", f"{low}:{high}")
            )
        endpoints = (self.endpoints,) if isinstance(self.endpoints, str) else self.endpoints
        if not endpoints or not all(isinstance(e, str) and split_host(e)[1] for e in endpoints):
            raise ConfigError(
                validate.message(
                    _WHERE,
                    "rdzv_endpoint",
                    "host:port[,host:port...]",
                    self.endpoints,
                    "e.g. --rdzv-endpoint 10.0.0.1:29400 (an address of one of the job's nodes; "
                    "with --rdzv-backend etcd, of etcd's members).",
                )
            )
        object.__setattr__(self, "endpoints", tuple(endpoints))
        if not isinstance(self.job, str) or not self.job:
            raise ConfigError(
                validate.message(
                    _WHERE, "rdzv_id", "a non-empty job id", self.job, "e.g. --rdzv-id run42."
                )
            )
        if self.backend not in BACKENDS:
            raise ConfigError(
                validate.message(
                    _WHERE, "rdzv_backend", f"one of {BACKENDS}", self.backend,
                    "e.g. --rdzv-backend etcd with --rdzv-endpoint at an etcd cluster.",
                )
            )  # fmt: skip
        for name in ("lease", "join_timeout", "last_call"):
            validate.number(
                getattr(self, name), name, _WHERE, low=0.0, low_ok=False, what="seconds > 0"
            )


def node_host(elastic: ElasticOptions) -> str:
    """The address other nodes reach this node at: ``host``, or the one this machine
    uses towards the first endpoint (loopback for a loopback endpoint)."""
    if elastic.host:
        return elastic.host
    host, port = split_host(elastic.endpoints[0])
    if is_loopback(host):
        return host.strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host.strip("[]"), port or 9))  # no packet is sent
        return probe.getsockname()[0]
