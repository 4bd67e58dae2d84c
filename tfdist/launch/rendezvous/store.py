"""The rules of an elastic job's rendezvous, and the c10d store that serves them.

``Membership`` holds the rules: which nodes train together, in what order, and when a
round ends (the package's docstring says them). ``Store`` is a ``Membership`` served over
TCP from the launcher that owns ``--rdzv-endpoint`` (torchrun's ``c10d`` choice);
``tfdist.launch.rendezvous.etcd`` applies the same rules to state kept in etcd.

Example:
    >>> rules = Membership(job="demo", min_nodes=1, max_nodes=1)
    >>> rules.answer({"job": "demo", "op": "join", "node": "a", "name": "a", "nproc": 1})["round"]
    1
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import socketserver
import threading
import time
from dataclasses import dataclass

from tfdist.core import validate
from tfdist.core.config import ConfigError
from tfdist.launch.options import split_host

__all__ = [
    "BEAT_S",
    "Membership",
    "NameTaken",
    "RendezvousError",
    "StoreUnreachable",
    "Round",
    "Store",
    "parse_nnodes",
    "static_nnodes",
    "try_host",
]

logger = logging.getLogger("tfdist.launch")

BEAT_S = 1.0  # how often a launcher renews its lease and reads the round
_ANSWER_S = 5.0  # how long one request may take
_WHERE = "launch"


class RendezvousError(RuntimeError):
    """The job cannot go on: too few nodes for too long, the store is gone, or refused."""


class NameTaken(RendezvousError):
    """Another node of the job holds this node's name (``host:first-port``): two launchers
    on one host chose the same worker ports."""


class StoreUnreachable(RendezvousError):
    """The store did not answer for ``lease`` seconds (the launcher hosting it is gone)."""


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"3"`` -> ``(3, 3)``; ``"2:3"`` -> ``(2, 3)`` (torchrun's ``--nnodes MIN:MAX``).

    Example:
        >>> parse_nnodes("2:4"), parse_nnodes("3")
        ((2, 4), (3, 3))
    """
    validate.instance(text, str, "nnodes", _WHERE, "N or MIN:MAX (a str)")
    low, sep, high = text.partition(":")
    try:
        pair = (int(low), int(high if sep else low))
    except ValueError:
        pair = (0, 0)
    if not 1 <= pair[0] <= pair[1]:
        raise ConfigError(
            validate.message(
                _WHERE, "nnodes", "N or MIN:MAX with 1 <= MIN <= MAX", text, "e.g. --nnodes 2:3."
            )
        )
    return pair


def static_nnodes(nnodes: str | int | None) -> int | None:
    """``--nnodes`` of a job that is not elastic: ``"3"`` or ``"3:3"`` -> 3; None stays.

    Example:
        >>> static_nnodes("2:2"), static_nnodes(None)
        (2, None)
    """
    if nnodes is None:
        return None
    if isinstance(nnodes, str):
        return parse_nnodes(nnodes)[0]
    return nnodes  # from a --config file: LaunchOptions checks it


@dataclass(frozen=True)
class Round:
    """One membership of the job.

    Attributes:
        number: counts from 1; the workers get it as ``TFDIST_RESTART``.
        nodes: every member's ``host:port`` (its first worker port), in node-rank order.
        index: this node's place in ``nodes`` (its node rank).
        nproc: workers per node.
        why: what ended the previous round ('' for the first).
        ended_at: ``time.time()`` when the previous round ended (None for the first).
    """

    number: int
    nodes: tuple[str, ...]
    index: int
    nproc: int
    why: str = ""
    ended_at: float | None = None

    @property
    def size(self) -> int:
        return len(self.nodes)


@dataclass
class _Node:
    name: str  # host:first-port, how messages name it
    nproc: int
    seen: float  # the membership's clock (``Membership._now``) at its last request
    arrival: int  # how many joins came before its last one: newcomers are ordered by it
    state: str = "waiting"  # waiting | member | stopping | done


class Membership:
    """The rendezvous rules for one job's membership, applied request by request (``answer``).

    ``lease``: seconds without a renewal after which a node counts as gone.
    ``last_call``: once MIN nodes wait, how long more may still come before the round
    forms (torchrun's ``last_call_timeout``); MAX waiting nodes form it at once.
    """

    def __init__(
        self,
        *,
        job: str,
        min_nodes: int,
        max_nodes: int,
        lease: float = 5.0,
        last_call: float = 3.0,
    ):
        self.job, self.min_nodes, self.max_nodes, self.lease = job, min_nodes, max_nodes, lease
        self.last_call = last_call
        self._enough_since: float | None = None  # when MIN nodes first waited
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._members: list[str] = []  # node ids of the current (or last) round
        self._round = 0
        self._arrivals = 0  # joins so far
        self._running = False
        self._finished = False
        self._why: str = ""
        self._ended_at: float | None = None
        self._lost: dict[str, float] = {}  # name -> when it was lost, for progress lines

    # ---------------------------------------------------------------- the clock and leases

    def _now(self) -> float:
        """The membership's clock: one process's monotonic clock (the etcd backend, whose
        state every node updates, uses wall time)."""
        return time.monotonic()

    def _expired(self, key: str, node: _Node, now: float) -> bool:
        """``node`` stopped renewing: no request for ``lease`` seconds."""
        return now - node.seen > self.lease

    def _log(self, level: int, message: str, *args) -> None:
        """A change of membership, said in the launcher's log."""
        logger.log(level, message, *args)

    # ---------------------------------------------------------------- the state

    def answer(self, request: dict) -> dict:
        """One request -> its answer (the whole protocol; also called directly in tests)."""
        if request.get("job") != self.job:
            return {
                "error": f"this rendezvous serves job {self.job!r}, not {request.get('job')!r}: "
                "give every node the same --rdzv-id"
            }
        op, node = request.get("op"), str(request.get("node", ""))
        with self._lock:
            now = self._now()
            self._tick(now)
            if op == "join":
                refused = self._join(
                    node, str(request.get("name")), int(request.get("nproc", 0)), now
                )
                if refused:
                    return refused
            elif node not in self._nodes:
                if not self._finished:
                    return {"error": "unknown node: join first", "rejoin": True}
            else:
                self._nodes[node].seen = now
                if op == "done":
                    self._done(node)
                elif op == "leave":
                    self._drop(node, "left the job")
            self._tick(now)
            return self._view(node)

    def _join(self, node: str, name: str, nproc: int, now: float) -> dict | None:
        """Registers ``node``; the refusal to answer instead (None: joined)."""
        others = {n.nproc for key, n in self._nodes.items() if key != node}
        if others and nproc not in others:
            return {
                "error": f"node {name} starts {nproc} worker(s) but the job's nodes start "
                f"{others.pop()}: give every node the same -n"
            }
        if self._finished:
            return None
        if any(n.name == name for key, n in self._nodes.items() if key != node):
            # Two launchers on one host that picked the same free ports: the workers of
            # one could not listen. The joining one picks others (Member.join).
            return {"error": f"node name {name} is taken by another node", "taken": True}
        known = self._nodes.get(node)
        self._arrivals += 1
        self._nodes[node] = _Node(name, nproc, now, self._arrivals)
        self._lost.pop(name, None)
        if not self._running:
            return None
        if node in self._members:  # a member whose own workers ended: all restart
            self._end_round(f"node {name} restarted its workers")
        elif known is None and len(self._members) < self.max_nodes:
            self._end_round(f"node {name} joined")
        return None

    def _done(self, node: str) -> None:
        self._nodes[node].state = "done"
        if self._members and all(
            self._nodes.get(m) is None or self._nodes[m].state == "done" for m in self._members
        ):
            self._finished, self._running = True, False

    def _drop(self, node: str, what: str) -> None:
        gone = self._nodes.pop(node)
        if gone.state == "done":
            return
        self._lost[gone.name] = time.time()
        if self._running and node in self._members:
            self._end_round(f"node {gone.name} {what}")

    def _end_round(self, why: str) -> None:
        self._log(logging.WARNING, "rendezvous: round %d ends: %s", self._round, why)
        self._running, self._why, self._ended_at = False, why, time.time()
        for node in self._nodes.values():
            if node.state == "member":
                node.state = "stopping"

    def _tick(self, now: float) -> None:
        for key, node in list(self._nodes.items()):
            if self._expired(key, node, now) and not self._finished:
                self._drop(key, f"stopped renewing its lease ({self.lease:g} s)")
        if self._running or self._finished:
            return
        waiting = [k for k, n in self._nodes.items() if n.state == "waiting"]
        stopping = [k for k, n in self._nodes.items() if n.state == "stopping"]
        if len(waiting) < self.min_nodes:
            self._enough_since = None
            return
        if len(waiting) < self.max_nodes:
            self._enough_since = self._enough_since or now
            if stopping or now - self._enough_since < self.last_call:
                return
        self._enough_since = None
        order = {k: i for i, k in enumerate(self._members)}
        waiting.sort(key=lambda k: (order.get(k, len(order)), self._nodes[k].arrival))
        self._members = waiting[: self.max_nodes]
        for key in self._members:
            self._nodes[key].state = "member"
        self._round += 1
        self._running = True
        names = [self._nodes[k].name for k in self._members]
        self._log(
            logging.INFO, "rendezvous: round %d: %d node(s) %s", self._round, len(names), names
        )

    # The fields that make the state, for a backend that keeps it outside this process.
    _STATE = (
        "_members", "_round", "_arrivals", "_running", "_finished", "_why", "_ended_at",
        "_lost", "_enough_since",
    )  # fmt: skip

    def state(self) -> dict:
        """The membership as JSON-ready data (``restore`` reads it back)."""
        state = {name: getattr(self, name) for name in self._STATE}
        state["_nodes"] = {key: dataclasses.asdict(node) for key, node in self._nodes.items()}
        return state

    def restore(self, state: dict) -> None:
        """Takes the membership ``state()`` gave (an empty dict: a new job)."""
        for name in self._STATE:
            if name in state:
                setattr(self, name, state[name])
        self._nodes = {key: _Node(**node) for key, node in state.get("_nodes", {}).items()}

    def _view(self, node: str) -> dict:
        view: dict = {"round": self._round, "running": self._running, "finished": self._finished}
        if self._running and node in self._members:
            view["nodes"] = [self._nodes[k].name for k in self._members]
            view["index"] = self._members.index(node)
            view["nproc"] = self._nodes[node].nproc
            view["why"], view["ended_at"] = self._why, self._ended_at
        else:
            waiting = sum(n.state == "waiting" for n in self._nodes.values())
            view["waiting"], view["min"] = waiting, self.min_nodes
            view["lost"] = {name: round(time.time() - t) for name, t in self._lost.items()}
            view["spare"] = self._running and node in self._nodes
        return view


class Store(Membership):
    """A ``Membership`` served over TCP on ``endpoint`` (``host:port``; port 0: any), its
    leases checked every 0.2 s, once started; ``rules``: ``Membership``'s arguments."""

    def __init__(self, endpoint: str, **rules):
        super().__init__(**rules)
        self._address = split_host(endpoint)
        self._server: socketserver.ThreadingTCPServer | None = None
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Binds the endpoint and serves in background threads (OSError when it cannot)."""
        host, port = self._address
        store = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                self.connection.settimeout(_ANSWER_S)
                try:
                    request = json.loads(self.rfile.readline())
                    answer = store.answer(request)
                except (OSError, ValueError) as err:
                    answer = {"error": f"bad request: {err}"}
                self.wfile.write(json.dumps(answer).encode() + b"\n")

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self._server = Server((host.strip("[]"), port or 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="rdzv-store", daemon=True).start()
        self._ticker = threading.Thread(target=self._tick_forever, name="rdzv-tick", daemon=True)
        self._ticker.start()

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return f"{host!s}:{port}"

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _tick_forever(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                self._tick(self._now())


def try_host(endpoint: str, **store_args) -> Store | None:
    """Starts the store on ``endpoint`` when this machine owns its address and nobody
    serves it yet; None otherwise (another launcher hosts it, or another machine)."""
    store = Store(endpoint, **store_args)
    try:
        store.start()
    except OSError as err:
        if err.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return None
        raise ConfigError(
            f"launch: cannot serve the rendezvous on {endpoint} ({err.strerror}). Received: "
            f"rdzv_endpoint={endpoint!r}. Pass an address of one of the job's nodes."
        ) from None
    return store
