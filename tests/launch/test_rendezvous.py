"""The elastic rendezvous's rules, on the store itself and over its socket (no workers).

Rounds form from MIN nodes after the last call, at once with MAX; survivors keep their
order (the chief stays the chief); a lost lease, a leave, a member's own restart and a
newcomer (below MAX) end a round; a spare waits at MAX; a request for another job is
refused; the job finishes when every member is done. tests/e2e/test_elastic.py runs it
with real launchers and workers.
"""

from __future__ import annotations

import re

import pytest

from tfdist import cli
from tfdist.core.config import ConfigError
from tfdist.launch import elastic, rendezvous
from tfdist.launch.elastic import ElasticOptions
from tfdist.launch.rendezvous import Member, RendezvousError, Store, parse_nnodes


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(rendezvous.store.time, "monotonic", clock)
    return clock


def store(**kwargs) -> Store:
    args = {"job": "j", "min_nodes": 2, "max_nodes": 3, "lease": 5.0, "last_call": 3.0}
    return Store("127.0.0.1:0", **{**args, **kwargs})


def join(s: Store, node: str, nproc: int = 1) -> dict:
    return s.answer({"job": "j", "op": "join", "node": node, "name": node, "nproc": nproc})


def beat(s: Store, node: str) -> dict:
    return s.answer({"job": "j", "op": "beat", "node": node})


def test_a_round_forms_after_the_last_call_from_min_nodes_at_once_from_max(clock):
    s = store()
    join(s, "a")
    assert not beat(s, "a")["running"]
    join(s, "b")
    assert not beat(s, "a")["running"]  # MIN is there: more may come for 3 s
    clock.now += 3.1
    view = beat(s, "b")
    assert view["running"] and view["nodes"] == ["a", "b"] and view["index"] == 1
    full = store()
    for node in "abc":
        join(full, node)
    assert beat(full, "c")["nodes"] == ["a", "b", "c"]  # MAX: no last call


def test_a_lost_lease_ends_the_round_and_the_survivors_keep_their_order(clock):
    s = store()
    for node in "abc":
        join(s, node)
    assert beat(s, "a")["round"] == 1
    clock.now += 4
    beat(s, "b")
    beat(s, "c")
    clock.now += 2  # a: 6 s without a renewal
    view = beat(s, "b")
    assert not view["running"] and "a" in view["lost"], view
    join(s, "c")
    join(s, "b")  # b comes back after c; its place is kept
    clock.now += 3.1
    view = beat(s, "b")
    assert (
        view["round"] == 2
        and view["nodes"] == ["b", "c"]
        and view["why"].startswith("node a stopped renewing")
    ), view


def test_a_round_does_not_form_while_a_member_of_the_last_is_still_stopping(clock):
    s = store()
    for node in "abc":
        join(s, node)
    s.answer({"job": "j", "op": "leave", "node": "c"})
    join(s, "a")  # b is still stopping its workers (and renewing its lease meanwhile)
    for _ in range(5):
        clock.now += 2
        beat(s, "b")
        assert not beat(s, "a")["running"]
    join(s, "b")
    clock.now += 3.1
    assert beat(s, "a")["nodes"] == ["a", "b"]


def test_a_newcomer_ends_a_round_below_max_and_waits_as_a_spare_at_max(clock):
    s = store()
    join(s, "a")
    join(s, "b")
    clock.now += 3.1
    assert beat(s, "a")["round"] == 1
    join(s, "c")
    assert not beat(s, "a")["running"] and "node c joined" in s._why
    join(s, "a")
    join(s, "b")
    assert beat(s, "a")["nodes"] == ["a", "b", "c"]
    join(s, "d")  # the round is full
    assert beat(s, "a")["running"] and beat(s, "d")["spare"]


def test_a_member_that_restarts_its_own_workers_ends_the_round_for_all(clock):
    s = store(min_nodes=2, max_nodes=2)
    join(s, "a")
    join(s, "b")
    assert beat(s, "a")["running"]
    join(s, "b")
    assert not beat(s, "a")["running"] and "node b restarted its workers" in s._why


def test_the_job_finishes_when_every_member_is_done(clock):
    s = store(min_nodes=2, max_nodes=2)
    join(s, "a")
    join(s, "b")
    s.answer({"job": "j", "op": "done", "node": "a"})
    assert not beat(s, "b")["finished"]
    s.answer({"job": "j", "op": "done", "node": "b"})
    clock.now += 60  # done nodes stop renewing: the job stays finished
    assert beat(s, "a")["finished"] and beat(s, "zz")["finished"]


def test_refusals_name_what_was_received():
    s = store()
    wrong = s.answer({"job": "other", "op": "join", "node": "a"})
    assert "serves job 'j', not 'other'" in wrong["error"] and "--rdzv-id" in wrong["error"]
    join(s, "a", nproc=2)
    assert "starts 1 worker(s) but the job's nodes start 2" in join(s, "b", nproc=1)["error"]
    assert beat(s, "ghost")["rejoin"]


def test_a_member_over_the_socket_is_refused_with_another_job_id():
    s = store(min_nodes=1, max_nodes=1)
    s.start()
    try:
        member = Member(s.endpoint, job="wrong", host="127.0.0.1", ports=[5000])
        with pytest.raises(RendezvousError, match="serves job 'j', not 'wrong'"):
            member.join()
        right = Member(s.endpoint, job="j", host="127.0.0.1", ports=[5000])
        right.join()
        assert right.wait_round(0, timeout=10).nodes == ("127.0.0.1:5000",)
    finally:
        s.close()


def test_a_name_another_node_holds_is_refused_until_its_lease_ends(clock):
    """Two launchers on one host that picked the same free worker ports: the second's
    workers could not listen, so its join is refused as taken (its own rejoin is not)."""
    s = store()
    answer = lambda node: s.answer(  # noqa: E731 - two nodes named alike
        {"job": "j", "op": "join", "node": node, "name": "h:5000", "nproc": 1}
    )
    assert "error" not in answer("first")
    refused = answer("second")
    assert refused["taken"] and "node name h:5000 is taken" in refused["error"]
    assert "error" not in answer("first")  # the holder joins again under its name
    clock.now += 6  # the holder stopped renewing
    assert "error" not in answer("second")


def test_a_member_whose_name_is_taken_repicks_its_ports_or_says_to_give_its_own_port():
    s = store(min_nodes=2, max_nodes=2, lease=2.0)  # renewed every second
    s.start()
    try:
        first = Member(s.endpoint, job="j", host="127.0.0.1", ports=[5000], lease=2.0)
        first.join()
        first.start_beating()
        fixed = Member(s.endpoint, job="j", host="127.0.0.1", ports=[5000], lease=2.0)
        with pytest.raises(RendezvousError, match=r"taken .* for 4 s: .* its own --port"):
            fixed.join()
        second = Member(s.endpoint, job="j", host="127.0.0.1", ports=[5000], lease=2.0)
        second.repick = lambda: [5002]
        second.join()
        rounds = [m.wait_round(0, timeout=10) for m in (first, second)]
        assert [r.nodes for r in rounds] == [("127.0.0.1:5000", "127.0.0.1:5002")] * 2
    finally:
        first.stop_beating()
        s.close()


def test_below_min_the_wait_names_the_missing_and_times_out(clock):
    s = store()
    join(s, "a")
    join(s, "b")
    clock.now += 3.1
    beat(s, "a")
    clock.now += 4
    beat(s, "a")
    clock.now += 2  # b is lost
    assert "b" in beat(s, "a")["lost"]
    view = beat(s, "a")
    assert rendezvous.member._awaited(view).startswith(
        "0 of at least 2 node(s) are here; missing: b"
    )


@pytest.mark.parametrize(("text", "pair"), [("3", (3, 3)), ("2:4", (2, 4)), ("1:1", (1, 1))])
def test_nnodes_takes_n_or_min_max(text, pair):
    assert parse_nnodes(text) == pair


@pytest.mark.parametrize("text", ["0", "3:2", "a:b", "2:", ""])
def test_nnodes_refuses_what_is_not_min_max(text):
    with pytest.raises(
        ConfigError, match=f"nnodes must be N or MIN:MAX.*Received: nnodes={text!r}"
    ):
        parse_nnodes(text)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("endpoints", ("127.0.0.1",), "rdzv_endpoint must be host:port"),
        ("job", "", "rdzv_id must be a non-empty job id"),
        ("min_nodes", 4, "nnodes must be MIN:MAX with MIN <= MAX"),
    ],
)
def test_elastic_options_name_the_bad_argument(field, value, words):
    args = {"min_nodes": 2, "max_nodes": 3, "endpoints": ("127.0.0.1:29400",), "job": "j"}
    with pytest.raises(ConfigError, match=words):
        ElasticOptions(**{**args, field: value})


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"hosts": "127.0.0.1"}, "numbers its nodes itself. Received: hosts='127.0.0.1'"),
        ({"rdzv_endpoint": None}, "needs where its nodes meet and a job id"),
        ({"rdzv_conf": "leese=3"}, "rdzv_conf takes lease, join_timeout, last_call_timeout"),
        ({"nnodes": "3:2"}, "nnodes must be N or MIN:MAX"),
    ],
)
def test_the_elastic_flags_are_checked_once_naming_what_was_received(flags, words):
    args = {"nnodes": "2:3", "rdzv_endpoint": "127.0.0.1:29400", "rdzv_id": "j"}
    with pytest.raises(ConfigError, match=re.escape(words)):
        ElasticOptions.from_flags(**{**args, **flags})


def test_which_flags_make_a_job_elastic():
    assert elastic.wanted("2:3", None) and elastic.wanted(None, "127.0.0.1:29400")
    assert not elastic.wanted("3", None) and not elastic.wanted("3:3", None)
    assert not elastic.wanted(None, None) and not elastic.wanted(2, None)  # from --config
    assert rendezvous.static_nnodes("3:3") == 3 and rendezvous.static_nnodes(2) == 2


def test_tfdist_launch_refuses_an_elastic_job_without_its_endpoint(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    code = cli.main(["launch", "--nnodes", "2:3", "-n", "1", str(script)])
    assert code == 2
    assert "an elastic job needs where its nodes meet" in capsys.readouterr().err


def test_the_store_listens_on_the_endpoints_address_only():
    s = store(min_nodes=1, max_nodes=1)
    s.start()
    try:
        assert s._server.server_address[0] == "127.0.0.1", s._server.server_address
        assert s.endpoint.startswith("127.0.0.1:")  # not 0.0.0.0: every interface
    finally:
        s.close()
