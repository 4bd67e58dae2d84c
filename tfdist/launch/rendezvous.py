"""The rendezvous of an elastic job: which nodes train together, in what order, and when.

``tfdist launch --nnodes MIN:MAX --rdzv-endpoint HOST:PORT --rdzv-id JOB`` starts one
launcher per node. The launcher that can bind ``HOST:PORT`` hosts a small ``Store``
(torchrun's ``c10d`` choice: no service to install); every launcher is a ``Member``
that registers there and renews its lease every ``BEAT_S`` seconds.

The store forms *rounds*. A round is an ordered list of nodes: the survivors of the
last round first, in their old order (so the chief stays the chief while it lives),
then newcomers in the order they came. It forms when at least MIN nodes wait and no
node of the last round is still stopping its workers (or MAX nodes wait). A round ends
when a member stops renewing for ``lease`` seconds (its machine or launcher is gone),
leaves, restarts its own workers, or when a new node arrives and the round has fewer
than MAX nodes. The launchers see the end at their next renewal and stop their workers
at once; a node that arrives while the round is full waits as a spare.

The protocol is one JSON line each way per TCP connection; every request names the job,
and a request for another job is refused. The store listens on ``HOST`` only, so it is
as reachable as the workers' ports are.

Example:
    >>> store = Store("127.0.0.1:0", job="demo", min_nodes=1, max_nodes=2)
    >>> store.start()
    >>> member = Member(store.endpoint, job="demo", host="127.0.0.1", ports=[2222])
    >>> member.join()
    >>> member.wait_round(0, timeout=10).size
    1
    >>> store.close()
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import socket
import socketserver
import threading
import time
from dataclasses import dataclass

from tfdist.core import validate
from tfdist.core.config import ConfigError
from tfdist.launch.options import split_host

__all__ = [
    "BEAT_S",
    "RendezvousError",
    "StoreUnreachable",
    "Round",
    "Store",
    "Member",
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
    seen: float  # the store's clock (``Store._now``) at its last request
    arrival: int  # how many joins came before its last one: newcomers are ordered by it
    state: str = "waiting"  # waiting | member | stopping | done


class Store:
    """The membership of one job, served on ``endpoint`` (``host:port``; port 0: any).

    ``lease``: seconds without a renewal after which a node counts as gone.
    ``last_call``: once MIN nodes wait, how long more may still come before the round
    forms (torchrun's ``last_call_timeout``); MAX waiting nodes form it at once.
    """

    def __init__(
        self,
        endpoint: str,
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
        self._address = split_host(endpoint)
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
        self._server: socketserver.ThreadingTCPServer | None = None
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    # ---------------------------------------------------------------- serving

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

    # ---------------------------------------------------------------- the clock and leases

    def _now(self) -> float:
        """The store's clock: one process's monotonic clock (the etcd backend, whose state
        every node updates, uses wall time)."""
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
                error = self._join(
                    node, str(request.get("name")), int(request.get("nproc", 0)), now
                )
                if error:
                    return {"error": error}
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

    def _join(self, node: str, name: str, nproc: int, now: float) -> str:
        others = {n.nproc for key, n in self._nodes.items() if key != node}
        if others and nproc not in others:
            return (
                f"node {name} starts {nproc} worker(s) but the job's nodes start "
                f"{others.pop()}: give every node the same -n"
            )
        if self._finished:
            return ""
        known = self._nodes.get(node)
        self._arrivals += 1
        self._nodes[node] = _Node(name, nproc, now, self._arrivals)
        self._lost.pop(name, None)
        if not self._running:
            return ""
        if node in self._members:  # a member whose own workers ended: all restart
            self._end_round(f"node {name} restarted its workers")
        elif known is None and len(self._members) < self.max_nodes:
            self._end_round(f"node {name} joined")
        return ""

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


class Member:
    """This node's side of the rendezvous: join, renew, read the round, finish or leave.

    ``ports``: this node's worker ports (the first names the node).
    """

    def __init__(self, endpoint: str, *, job: str, host: str, ports: list[int], lease: float = 5.0):
        self.endpoint, self.job, self.lease = endpoint, job, lease
        self.name = f"{host}:{ports[0]}"
        self.nproc = len(ports)
        self.id = f"{self.name}/{time.time_ns()}"  # a new launcher is a new node
        self.view: dict = {}
        self.store_lost = False  # the renewals found the store gone
        self._last_answer = time.monotonic()
        self._beating = threading.Event()
        self._beater: threading.Thread | None = None

    def _send(self, request: dict) -> dict:
        """One request to the store, its answer (OSError when the store cannot be reached)."""
        host, port = split_host(self.endpoint)
        with socket.create_connection((host.strip("[]"), port), timeout=_ANSWER_S) as sock:
            sock.sendall(json.dumps(request).encode() + b"\n")
            line = sock.makefile("rb").readline()
        if not line:
            raise OSError(errno.ECONNRESET, "the store closed the connection")
        return json.loads(line)

    def _ask(self, op: str, **extra) -> dict:
        answer = self._send({"job": self.job, "op": op, "node": self.id, **extra})
        if "error" in answer and not answer.get("rejoin"):
            raise RendezvousError(f"rendezvous {self.endpoint}: {answer['error']}")
        self._last_answer = time.monotonic()
        return answer

    def ask(self, op: str, **extra) -> dict:
        """A request that tolerates a store unreachable for less than ``lease`` seconds."""
        while True:
            try:
                return self._ask(op, **extra)
            except OSError as err:
                if time.monotonic() - self._last_answer > self.lease:
                    raise StoreUnreachable(
                        f"the rendezvous store at {self.endpoint} stopped answering "
                        f"({err}) for {self.lease:g} s: the launcher hosting it is gone"
                    ) from None
                time.sleep(0.2)

    def join(self, ports: list[int] | None = None) -> None:
        """Registers (again) as waiting for the next round; ``ports``: this node's worker
        ports from now on (fresh ones at each round: the old ones may linger in TIME_WAIT)."""
        if ports:
            self.name = f"{self.name.rpartition(':')[0]}:{ports[0]}"
        self.view = self.ask("join", name=self.name, nproc=self.nproc)

    def wait_round(self, last: int, *, timeout: float, say=None) -> Round | None:
        """Blocks until a round after ``last`` includes this node; None when the job
        finished. Every 10 s ``say(line)`` tells who is awaited; after ``timeout``
        seconds without a round: RendezvousError naming the missing nodes."""
        start = time.monotonic()
        next_word = start + 5.0  # a re-form takes a few seconds: say nothing before
        while True:
            view = self.ask("beat")
            if view.get("rejoin"):
                self.join()
                continue
            if view.get("finished"):
                return None
            if view.get("running") and "nodes" in view and view["round"] > last:
                self.view = view
                return Round(
                    view["round"],
                    tuple(view["nodes"]),
                    view["index"],
                    view["nproc"],
                    view["why"],
                    view["ended_at"],
                )
            now = time.monotonic()
            if now - start > timeout:
                raise RendezvousError(
                    f"no round of at least {view.get('min')} node(s) formed in {timeout:g} s: "
                    f"{_awaited(view)}. Start the missing nodes' launchers, or lower MIN in "
                    "--nnodes MIN:MAX"
                )
            if say is not None and now >= next_word:
                say(f"waiting for the job to form: {_awaited(view)}")
                next_word = now + 10.0
            time.sleep(0.25)

    def start_beating(self) -> None:
        """Renews the lease in a thread; ``ended()`` reads what the renewals learn."""
        self._beating.set()

        def beat():
            while self._beating.is_set():
                try:
                    self.view = self.ask("beat")
                except RendezvousError as err:
                    self.view = {"error": str(err)}
                    self.store_lost = isinstance(err, StoreUnreachable)
                    return
                time.sleep(BEAT_S)

        self._beater = threading.Thread(target=beat, name="rdzv-beat", daemon=True)
        self._beater.start()

    def stop_beating(self) -> None:
        self._beating.clear()
        if self._beater is not None:
            self._beater.join(timeout=_ANSWER_S + BEAT_S)
            self._beater = None

    def ended(self, number: int) -> str | None:
        """Why round ``number`` is over for this node, or None while it stands."""
        view = self.view
        if "error" in view:
            return view["error"]
        if view.get("finished"):
            return None  # the others finished: ours finish on their own
        if view.get("rejoin"):
            return "the rendezvous forgot this node (its lease ran out)"
        if view.get("round", number) != number or not view.get("running", True):
            return "the job re-forms"
        return None

    def done(self) -> None:
        """This node's workers finished: the job ends when every member's have."""
        self.ask("done")

    def leave(self) -> None:
        """Leaves the job on purpose (the others re-form at once); never raises."""
        try:
            self._ask("leave")
        except (OSError, RendezvousError, ValueError):
            pass


def _awaited(view: dict) -> str:
    lost = view.get("lost") or {}
    head = f"{view.get('waiting', 0)} of at least {view.get('min')} node(s) are here"
    if not lost:
        return head
    names = ", ".join(f"{name} (lost {age} s ago)" for name, age in sorted(lost.items()))
    return f"{head}; missing: {names}"
