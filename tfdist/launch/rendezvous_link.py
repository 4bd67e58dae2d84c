"""A node's link to its elastic job's rendezvous, one class per backend.

``tfdist.launch.elastic`` joins each round through a link: ``StoreLink`` finds the c10d
store at the first endpoint that answers, hosts it when this node owns that endpoint,
and moves to the next endpoint when the store's node is lost; ``EtcdLink`` meets in an
etcd cluster, where no node hosts anything.

Example:
    >>> options = ElasticOptions(1, 2, ("127.0.0.1:29400",), "j")
    >>> type(link_for(options, "127.0.0.1", [5000], say=print)).__name__
    'StoreLink'
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tfdist.launch.elastic_options import ElasticOptions
from tfdist.launch.rendezvous import Member, RendezvousError, Store, try_host
from tfdist.launch.rendezvous.etcd import EtcdMember

__all__ = ["EtcdLink", "RendezvousLink", "StoreLink", "link_for"]


class RendezvousLink:
    """This node's link to the rendezvous, in the backend's place (``link_for``)."""

    _WHAT_TO_START = ""  # the hint when no endpoint answers

    def __init__(self, elastic: ElasticOptions, host: str, ports: list[int], say):
        self.elastic, self.host, self.ports, self.say = elastic, host, ports, say
        self.member: Member | None = None
        # Fresh worker ports when another node holds this node's name (Member.repick).
        self.repick: Callable[[], list[int] | None] | None = None
        self._at = 0  # index of the endpoint in use

    def connect(self, timeout: float) -> Member:
        """Joins the rendezvous at the first endpoint that answers, from the one in use."""
        deadline, told = time.monotonic() + timeout, 0.0
        while True:
            for at in self._endpoints_to_try():
                member = self._try(at)
                if member is not None:
                    self._at, self.member = at, member
                    return member
            now = time.monotonic()
            if now > deadline:
                raise RendezvousError(
                    f"no rendezvous store answered at {', '.join(self.elastic.endpoints[self._at :])} "
                    f"in {timeout:g} s. {self._WHAT_TO_START}, or check --rdzv-endpoint"
                )
            if now - told >= 10:
                self.say(f"waiting for the rendezvous store at {self.elastic.endpoints[self._at]}")
                told = now
            time.sleep(0.5)

    def _endpoints_to_try(self) -> range:
        return range(self._at, len(self.elastic.endpoints))

    def _try(self, at: int) -> Member | None:
        """This node joined at endpoint ``at``, or None when nothing answers there."""
        raise NotImplementedError

    def _joined(self, member: Member, probe) -> Member | None:
        """``member`` joined, once ``probe()`` reached the rendezvous; None if it did not."""
        try:
            probe()
        except OSError:
            return None
        member.repick = self.repick
        member.join()
        return member

    def move_on(self) -> Member:
        """The rendezvous stopped answering: where the job meets next."""
        raise NotImplementedError

    def close(self, linger: float) -> None:
        """The job is over: whatever this node holds for the others goes."""


class StoreLink(RendezvousLink):
    """The c10d store, wherever it lives; this node hosts it when its turn comes."""

    _WHAT_TO_START = "Start the launcher of the node that owns the endpoint"

    def __init__(self, elastic: ElasticOptions, host: str, ports: list[int], say):
        super().__init__(elastic, host, ports, say)
        self.store: Store | None = None

    def _try(self, at: int) -> Member | None:
        endpoint = self.elastic.endpoints[at]
        if self.store is None:
            self.store = try_host(
                endpoint,
                job=self.elastic.job,
                min_nodes=self.elastic.min_nodes,
                max_nodes=self.elastic.max_nodes,
                lease=self.elastic.lease,
                last_call=self.elastic.last_call,
            )
            if self.store is not None:
                self.say(
                    f"rendezvous: this node hosts the store of job {self.elastic.job!r} at {endpoint}"
                )
        member = Member(
            endpoint,
            job=self.elastic.job,
            host=self.host,
            ports=self.ports,
            lease=self.elastic.lease,
        )
        return self._joined(member, lambda: member._ask("beat"))  # "join first": it is there

    def move_on(self) -> Member:
        """The store's host is gone: the next endpoint that answers, or this node hosts it."""
        if self._at + 1 >= len(self.elastic.endpoints):
            raise RendezvousError(
                f"the rendezvous store at {self.elastic.endpoints[self._at]} is gone with its "
                "node, and --rdzv-endpoint names no other place for it. Give several endpoints "
                "(one per node that may host it) to survive the loss of that node"
            )
        lost = self.elastic.endpoints[self._at]
        self._at += 1
        self.say(
            f"rendezvous: the store at {lost} is gone; moving to {self.elastic.endpoints[self._at]}"
        )
        return self.connect(self.elastic.join_timeout)

    def close(self, linger: float) -> None:
        if self.store is not None:
            time.sleep(linger)  # the other launchers read "finished" before it goes
            self.store.close()


class EtcdLink(RendezvousLink):
    """The rendezvous kept in an etcd cluster the job does not run."""

    _WHAT_TO_START = "Start etcd there"

    def _endpoints_to_try(self) -> range:
        return range(self._at, self._at + 1)  # one try reaches every member in turn (Etcd.call)

    def _try(self, at: int) -> Member | None:
        member = EtcdMember(
            self.elastic.endpoints,
            job=self.elastic.job,
            host=self.host,
            ports=self.ports,
            min_nodes=self.elastic.min_nodes,
            max_nodes=self.elastic.max_nodes,
            lease=self.elastic.lease,
            last_call=self.elastic.last_call,
        )
        return self._joined(member, lambda: member.etcd.call("maintenance/status", {}))

    def move_on(self) -> Member:
        raise RendezvousError(
            f"etcd at {', '.join(self.elastic.endpoints)} stopped answering for "
            f"{self.elastic.lease:g} s: the job cannot re-form without it. Run etcd as a "
            "cluster of 3 or 5 members and give them all in --rdzv-endpoint"
        )


def link_for(elastic: ElasticOptions, host: str, ports: list[int], say) -> RendezvousLink:
    """This node's link to the rendezvous of ``elastic.backend``: ``say`` prints a line
    of the launcher's."""
    kind = EtcdLink if elastic.backend == "etcd" else StoreLink
    return kind(elastic, host, ports, say)
