"""The elastic rendezvous kept in etcd (``--rdzv-backend etcd``), on a real etcd (no workers).

The c10d store's rules (tests/launch/test_rendezvous.py) hold when every launcher applies
them to etcd by compare-and-swap: nodes that join at once agree on one round; a node whose
etcd lease runs out ends the round and the survivors re-form in their order; a newcomer
ends a round below MAX; a job id's old state does not hold a new job; an etcd that stops
answering is named. tests/e2e/test_elastic.py runs it with real launchers and workers.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
from etcd_server import EtcdServer

from tfdist.core.config import ConfigError
from tfdist.launch.elastic import ElasticOptions
from tfdist.launch.environment import free_ports
from tfdist.launch.rendezvous import RendezvousError, StoreUnreachable
from tfdist.launch.rendezvous.etcd import Etcd, EtcdMember
from tfdist.launch.rendezvous_link import link_for

LEASE = 2.0  # seconds: etcd's shortest lease is about this


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


def member(etcd, name: str, job: str, *, nproc: int = 1, **rules) -> EtcdMember:
    rules = {"min_nodes": 1, "max_nodes": 3, "lease": LEASE, "last_call": 0.5, **rules}
    port = 5000 + ord(name[0])
    return EtcdMember(
        (etcd.endpoint,), job=job, host=name, ports=list(range(port, port + nproc)), **rules
    )


def joined_round(members: list[EtcdMember], last: int = 0, at_once: bool = False):
    """The round each member sees after they join: in their order, or all at once."""
    rounds: dict[str, object] = {}
    for m in [] if at_once else members:
        m.join()
    start = threading.Barrier(len(members))

    def one(m):
        start.wait(timeout=30)
        if at_once:
            m.join()
        rounds[m.name] = m.wait_round(last, timeout=30)

    threads = [threading.Thread(target=one, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return [rounds[m.name] for m in members]


def test_nodes_that_join_at_once_agree_on_one_round(etcd):
    names = "abcdefgh"  # eight launchers writing the same key at the same moment
    members = [member(etcd, n, "at-once", min_nodes=8, max_nodes=8) for n in names]
    rounds = joined_round(members, at_once=True)
    assert len({(r.number, r.nodes) for r in rounds}) == 1, rounds
    assert sorted(r.index for r in rounds) == list(range(8)) and rounds[0].size == 8, rounds
    for m, r in zip(members, rounds, strict=True):
        assert r.nodes[r.index] == m.name, (m.name, r)


def test_two_launchers_on_one_host_with_the_same_ports_get_names_of_their_own(etcd):
    first, second = member(etcd, "h", "one-host", min_nodes=2), member(etcd, "h", "one-host")
    second.repick = lambda: [6000]  # what the launcher's fresh free ports give
    rounds = joined_round([first, second])
    assert [r.nodes for r in rounds] == [("h:5104", "h:6000")] * 2, rounds


def test_a_write_that_lost_a_race_is_made_again_on_the_state_that_won(etcd):
    a, b = member(etcd, "a", "race"), member(etcd, "b", "race")
    read, raced = a.etcd.read, []

    def read_then_b_joins(*args):
        got = read(*args)
        if not raced:  # b writes between a's read and a's write
            raced.append(b.join())
        return got

    a.etcd.read = read_then_b_joins
    a.join()
    state, _, alive = read(f"{a.root}state", f"{a.root}alive/")
    nodes = json.loads(state)["_nodes"]
    assert raced and sorted(nodes) == sorted([a.id, b.id]) == sorted(alive), (nodes, alive)
    assert [nodes[n]["arrival"] for n in (b.id, a.id)] == [1, 2], nodes


def next_round(a: EtcdMember, last: int):
    """``a`` renews its lease until round ``last`` ends for it, then meets again."""
    a.start_beating()
    try:
        deadline = time.monotonic() + 4 * LEASE + 5
        while a.ended(last) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert a.ended(last) == "the job re-forms", a.view
    finally:
        a.stop_beating()
    a.join()
    return a.wait_round(last, timeout=30)


def test_a_lost_lease_ends_the_round_and_a_newcomer_below_max_ends_the_next(etcd):
    a, b, c = (member(etcd, name, "lost") for name in "abc")
    first = joined_round([a, b], 0)[0]
    assert first.nodes == ("a:5097", "b:5098"), first
    second = next_round(a, first.number)  # b stops renewing: its machine is gone
    assert second.nodes == ("a:5097",) and "node b:5098 stopped renewing" in second.why, second
    c.join()  # below MAX (3): the round ends for the newcomer
    c.start_beating()
    try:
        third = next_round(a, second.number)
    finally:
        c.stop_beating()
    assert third.nodes == ("a:5097", "c:5099") and "node c:5099 joined" in third.why, third


def test_an_old_jobs_finished_state_does_not_hold_a_new_job_with_its_id(etcd):
    old = member(etcd, "a", "reused", lease=LEASE)
    (round_,) = joined_round([old])
    old.done()
    assert old.ask("beat")["finished"]
    old.leave()  # its lease goes: no node of that job lives
    new = member(etcd, "b", "reused")
    (again,) = joined_round([new])
    assert again.number == 1 and again.nodes == ("b:5098",), again


def test_another_number_of_workers_per_node_is_refused(etcd):
    a = member(etcd, "a", "nproc", nproc=2)
    a.join()
    with pytest.raises(RendezvousError, match=r"starts 1 worker\(s\) but the job's nodes start 2"):
        member(etcd, "b", "nproc").join()
    a.leave()


def test_an_etcd_member_that_does_not_answer_is_passed_over_and_none_answering_is_named(etcd):
    (dead,) = free_ports(1)
    assert "header" in Etcd((f"127.0.0.1:{dead}", etcd.endpoint)).call("maintenance/status", {})
    gone = EtcdMember(
        (f"127.0.0.1:{dead}",), job="j", host="a", ports=[5000], min_nodes=1, max_nodes=1,
        lease=1.0,
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(StoreUnreachable, match=rf"store at 127.0.0.1:{dead} stopped answering"):
        gone.join()
    assert time.monotonic() - started < 10
    options = ElasticOptions(1, 2, (f"127.0.0.1:{dead}",), "j", lease=1.0, backend="etcd")
    rendezvous = link_for(options, "127.0.0.1", [5000], say=lambda line: None)
    with pytest.raises(RendezvousError, match="no rendezvous store answered .* Start etcd there"):
        rendezvous.connect(timeout=1.0)
    with pytest.raises(RendezvousError, match="cannot re-form without it"):
        rendezvous.move_on()


def test_an_unknown_backend_is_refused_naming_it():
    with pytest.raises(
        ConfigError, match=r"rdzv_backend must be one of .*Received: rdzv_backend='zookeeper'"
    ):
        ElasticOptions(1, 2, ("127.0.0.1:2379",), "j", backend="zookeeper")


def test_a_node_with_another_job_id_meets_in_another_job(etcd):
    mine, other = member(etcd, "a", "mine"), member(etcd, "b", "other")
    rounds = joined_round([mine, other], at_once=True)
    assert [(r.number, r.nodes) for r in rounds] == [(1, ("a:5097",)), (1, ("b:5098",))], rounds
    assert not [k for k in Etcd((etcd.endpoint,)).read("x", mine.root)[2] if "b:5098" in k]


def test_renewals_write_nothing_to_etcd(etcd):
    """etcd keeps every revision until compacted: a write per renewal per node would fill
    its space quota over a long job. A renewal renews the lease and reads the state only."""
    a = member(etcd, "a", "quiet")
    (round_,) = joined_round([a])
    before = a.etcd.read(f"{a.root}state", f"{a.root}alive/")[1]
    for _ in range(5):
        assert a.ask("beat")["round"] == round_.number
    assert a.etcd.read(f"{a.root}state", f"{a.root}alive/")[1] == before


def test_a_round_computed_on_a_state_that_lost_a_race_is_not_announced(etcd, caplog):
    a, b = (member(etcd, name, "unsaid", min_nodes=2, max_nodes=2) for name in "ab")
    b.join()
    read, raced = a.etcd.read, []

    def read_then_b_leaves(*args):
        got = read(*args)
        if not raced:  # a sees b waiting and forms round 1; b leaves before a writes it
            raced.append(b.leave())
        return got

    a.etcd.read = read_then_b_leaves
    with caplog.at_level(logging.INFO, logger="tfdist.launch"):
        a.join()
    assert raced and not a.view["running"], a.view
    assert "rendezvous: round" not in caplog.text, caplog.text
