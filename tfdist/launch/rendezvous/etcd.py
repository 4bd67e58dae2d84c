"""The elastic rendezvous kept in etcd (``--rdzv-backend etcd``): no node hosts the store.

``tfdist launch --nnodes MIN:MAX --rdzv-backend etcd --rdzv-endpoint ETCD_HOST:PORT
--rdzv-id JOB -n N script.py`` meets where torchrun's etcd backend meets: an etcd
cluster the job does not run. Every launcher applies the same rules as the c10d store
(``tfdist.launch.rendezvous.store.Membership``) to one key, ``/tfdist/rdzv/JOB/state``, in a
compare-and-swap transaction: so any node may be lost, the first one included.

Liveness is etcd's own: each launcher holds an etcd lease of ``lease`` seconds, renews
it every second and keeps a key ``/tfdist/rdzv/JOB/alive/NODE`` under it. When a node
stops renewing, etcd deletes that key, and the next request of any launcher ends the
round. Time in the shared state (the last call, the ages in progress lines) is each
machine's wall clock, so the machines' clocks should agree within a second or so.

State that no living node holds is an old job's: the next node to come starts afresh,
so reusing ``--rdzv-id`` after a job ended (or died whole) is safe. A renewal writes
nothing (etcd keeps every revision until it is compacted), and a launcher announces a
round only once its write of it won.

The client speaks etcd's v3 JSON API (its gRPC gateway, in etcd 3.4 and later) with the
standard library, over plain HTTP: keep etcd on the job's private network. Give every
member of the etcd cluster in ``--rdzv-endpoint``: a request goes to the next member
when one does not answer.

Example:
    >>> member = EtcdMember(("127.0.0.1:2379",), job="demo", host="127.0.0.1", ports=[2222],
    ...                     min_nodes=1, max_nodes=2)  # doctest: +SKIP
    >>> member.join(); member.wait_round(0, timeout=10).size  # doctest: +SKIP
    1
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
import urllib.error
import urllib.request

from tfdist.launch.rendezvous.member import Member
from tfdist.launch.rendezvous.store import _ANSWER_S, Membership, RendezvousError, _Node

__all__ = ["Etcd", "EtcdMember"]

logger = logging.getLogger("tfdist.launch")

_PREFIX = "/tfdist/rdzv/"
# Straight to etcd: a proxy the environment names (for the internet) is not on the way to it.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_CAS_TRIES = 100  # concurrent writers retry; this many conflicts in a row is a fault


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text(b64: str) -> str:
    return base64.b64decode(b64).decode()


def _prefix_end(prefix: str) -> str:
    """etcd's ``range_end`` for every key that starts with ``prefix``."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class Etcd:
    """A minimal client of etcd's v3 JSON API: leases, reads and compare-and-swap.

    ``endpoints``: ``host:port`` of the cluster's members, tried in turn.

    Example:
        >>> Etcd(("127.0.0.1:2379",)).put("/k", "v")  # doctest: +SKIP
    """

    def __init__(self, endpoints: tuple[str, ...], timeout: float = _ANSWER_S):
        self.endpoints = tuple(e if "://" in e else f"http://{e}" for e in endpoints)
        self.timeout = timeout
        self._at = 0  # the member that answered last

    def call(self, path: str, body: dict) -> dict:
        """POSTs ``body`` to ``/v3/path`` on the first member that answers (OSError when
        none does; RendezvousError when etcd refuses the request)."""
        failures = []
        for i in range(len(self.endpoints)):
            at = (self._at + i) % len(self.endpoints)
            request = urllib.request.Request(
                f"{self.endpoints[at]}/v3/{path}",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with _DIRECT.open(request, timeout=self.timeout) as response:
                    answer = json.loads(response.read())
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:300]
                if err.code < 500:  # a request etcd will never take
                    raise RendezvousError(
                        f"etcd at {self.endpoints[at]} refused {path}: {detail}"
                    ) from None
                failures.append(f"{self.endpoints[at]}: {detail}")  # e.g. no leader yet
            except (OSError, ValueError) as err:
                failures.append(f"{self.endpoints[at]}: {err}")
                continue
            self._at = at
            return answer
        raise OSError("no etcd endpoint answered (" + "; ".join(failures) + ")")

    def grant(self, ttl: float) -> str:
        """A new lease of ``ttl`` seconds (rounded up: etcd counts whole seconds)."""
        return self.call("lease/grant", {"TTL": max(1, math.ceil(ttl))})["ID"]

    def keepalive(self, lease: str) -> bool:
        """Renews ``lease``; False when it has expired (etcd deleted its keys)."""
        answer = self.call("lease/keepalive", {"ID": lease}).get("result", {})
        return int(answer.get("TTL", 0)) > 0

    def revoke(self, lease: str) -> None:
        self.call("lease/revoke", {"ID": lease})

    def put(self, key: str, value: str, lease: str | None = None) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        self.call("kv/put", body)

    def read(self, key: str, prefix: str) -> tuple[str | None, int, list[str]]:
        """In one snapshot: ``key``'s value and revision (None, 0 when absent) and the
        keys under ``prefix``."""
        answer = self.call(
            "kv/txn",
            {
                "success": [
                    {"request_range": {"key": _b64(key)}},
                    {
                        "request_range": {
                            "key": _b64(prefix),
                            "range_end": _b64(_prefix_end(prefix)),
                            "keys_only": True,
                        }
                    },
                ]
            },
        )
        state, under = (r["response_range"].get("kvs", []) for r in answer["responses"])
        value = _text(state[0]["value"]) if state else None
        revision = int(state[0]["mod_revision"]) if state else 0
        return value, revision, [_text(kv["key"])[len(prefix) :] for kv in under]

    def swap(self, key: str, revision: int, value: str) -> bool:
        """Writes ``value`` if ``key`` is still at ``revision`` (0: absent); True if so."""
        answer = self.call(
            "kv/txn",
            {
                "compare": [
                    {
                        "key": _b64(key),
                        "target": "MOD",
                        "result": "EQUAL",
                        "mod_revision": str(revision),
                    }
                ],
                "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
            },
        )
        return bool(answer.get("succeeded"))


class _LeasedMembership(Membership):
    """The rendezvous rules on state read from etcd: a node is alive while its key
    under its etcd lease is; the clock is wall time, shared by every machine."""

    def __init__(self, alive: set[str], **rules):
        super().__init__(**rules)
        self.alive = alive
        self.said: list[tuple] = []  # said once the state is written (a lost race says nothing)

    def _now(self) -> float:
        return time.time()

    def _expired(self, key: str, node: _Node, now: float) -> bool:
        return key not in self.alive

    def _log(self, level: int, message: str, *args) -> None:
        self.said.append((level, message, *args))

    def state(self) -> dict:
        """The shared state without the nodes' last requests: the lease tells liveness, so
        a renewal writes nothing (etcd keeps every revision until it is compacted)."""
        state = super().state()
        for node in state["_nodes"].values():
            node["seen"] = 0.0
        return state


class EtcdMember(Member):
    """This node's side of a rendezvous kept in etcd: the same requests as ``Member``'s,
    each applied to the shared state by compare-and-swap.

    ``endpoints``: the etcd cluster's ``host:port``; ``min_nodes``, ``max_nodes``,
    ``last_call``: the job's rules, as ``Membership`` takes them.
    """

    def __init__(
        self,
        endpoints: tuple[str, ...],
        *,
        job: str,
        host: str,
        ports: list[int],
        min_nodes: int,
        max_nodes: int,
        lease: float = 5.0,
        last_call: float = 3.0,
    ):
        super().__init__(",".join(endpoints), job=job, host=host, ports=ports, lease=lease)
        self.etcd = Etcd(tuple(endpoints))
        self.rules = {
            "job": job,
            "min_nodes": min_nodes,
            "max_nodes": max_nodes,
            "lease": lease,
            "last_call": last_call,
        }
        self.root = f"{_PREFIX}{job}/"
        self._lease: str | None = None

    def _alive_key(self) -> str:
        return f"{self.root}alive/{self.id}"

    def _hold_lease(self, op: str) -> None:
        """Joining takes a fresh lease (and its alive key); other requests renew it."""
        if op == "join" or self._lease is None:
            self._lease = self.etcd.grant(self.lease)
            self.etcd.put(self._alive_key(), self.name, self._lease)
        elif op != "leave" and not self.etcd.keepalive(self._lease):
            self._lease = None  # expired: the shared state drops this node; it joins again

    def _send(self, request: dict) -> dict:
        op = str(request.get("op"))
        if op != "leave":
            self._hold_lease(op)
        state_key = f"{self.root}state"
        for _ in range(_CAS_TRIES):
            value, revision, alive = self.etcd.read(state_key, f"{self.root}alive/")
            membership = _LeasedMembership(set(alive), **self.rules)
            state = json.loads(value) if value else {}
            if not set(state.get("_nodes", {})) & set(alive):
                state = {}  # none of its nodes lives: an old job's state, or none yet
            membership.restore(state)
            answer = membership.answer(request)
            new = membership.state()
            if new == state or self.etcd.swap(state_key, revision, json.dumps(new)):
                for said in membership.said:
                    logger.log(*said)
                break
        else:
            raise OSError(f"{_CAS_TRIES} conflicting writes in a row on {state_key}")
        if op == "leave" and self._lease is not None:
            self.etcd.revoke(self._lease)
            self._lease = None
        return answer
