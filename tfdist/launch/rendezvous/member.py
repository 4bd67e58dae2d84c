"""A node's side of the rendezvous: join, renew its lease, read the round, finish or leave.

``Member`` talks to the c10d store over TCP, one JSON line each way; the etcd backend's
``EtcdMember`` (``tfdist.launch.rendezvous.etcd``) sends the same requests to etcd.

Example:
    >>> from tfdist.launch.rendezvous.store import Store
    >>> store = Store("127.0.0.1:0", job="demo", min_nodes=1, max_nodes=2)
    >>> store.start()
    >>> member = Member(store.endpoint, job="demo", host="127.0.0.1", ports=[2222])
    >>> member.join()
    >>> member.wait_round(0, timeout=10).size
    1
    >>> store.close()
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from collections.abc import Callable

from tfdist.launch.options import split_host
from tfdist.launch.rendezvous.store import (
    _ANSWER_S,
    BEAT_S,
    NameTaken,
    RendezvousError,
    Round,
    StoreUnreachable,
)

__all__ = ["Member"]


class Member:
    """This node's side of the rendezvous: join, renew, read the round, finish or leave.

    ``ports``: this node's worker ports (the first names the node). ``repick``, when set,
    gives fresh free ports for a name another node already holds (``join``).
    """

    repick: Callable[[], list[int] | None] | None = None

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
        if answer.get("taken"):
            raise NameTaken(f"rendezvous {self.endpoint}: {answer['error']}")
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
        ports from now on (fresh ones at each round: the old ones may linger in TIME_WAIT).

        A name another node holds (launchers on one host that picked the same free ports)
        is given up for ``repick``'s ports. Fixed ports are asked again until the other
        node's lease could have ended; then the error says to give each its own ``--port``.
        """
        if ports:
            self._rename(ports)
        deadline = time.monotonic() + 2 * self.lease
        while True:
            try:
                self.view = self.ask("join", name=self.name, nproc=self.nproc)
                return
            except NameTaken as taken:
                fresh = self.repick() if self.repick is not None else None
                if fresh:
                    self._rename(fresh)
                    continue
                if time.monotonic() > deadline:
                    raise RendezvousError(
                        f"{taken} for {2 * self.lease:g} s: another launcher on this host "
                        "uses the same worker ports. Give each launcher on one host its own "
                        "--port"
                    ) from None
                time.sleep(BEAT_S)

    def _rename(self, ports: list[int]) -> None:
        self.name = f"{self.name.rpartition(':')[0]}:{ports[0]}"

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
