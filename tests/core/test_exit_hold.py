"""tfdist.core.exit_hold: the other workers say they leave and never wait; the chief, at a
clean exit, waits (bounded) until each has said so or is gone. The multi-worker behaviour
is in tests/test_barrier.py (a late peer)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import types

import pytest

from tfdist import bootstrap
from tfdist.core import cluster, exit_hold, upstream


@pytest.fixture
def registered(monkeypatch):
    """A fresh hold whose atexit registrations are recorded, not made."""
    calls = []
    monkeypatch.setattr(exit_hold, "_HOLD", exit_hold._Hold())
    monkeypatch.setattr(exit_hold.atexit, "register", calls.append)
    for name in ("last_exc", "last_value"):
        monkeypatch.delattr(sys, name, raising=False)
    return calls


class Peers(exit_hold._Peers):
    """Workers that say they leave after ``late`` polls each, or never (None); ``dead``
    ones no longer answer."""

    def __init__(self, rank, others, timeout=60.0, late=None, dead=(), tell=None):
        super().__init__(rank, others, timeout)
        self.late, self.dead, self.told, self._tell = dict(late or {}), set(dead), [], tell
        self.polls = {r: 0 for r in others}

    def tell(self, clean):
        self.told.append(clean)
        if self._tell:
            self._tell()

    def arrived(self, rank, seconds):
        self.polls[rank] += 1
        late = self.late.get(rank, 0)
        if late is None or self.polls[rank] <= late:
            time.sleep(min(seconds, 0.02))
            return False
        return True

    def alive(self, rank):
        return rank not in self.dead


def test_an_exit_does_nothing_until_armed_and_arms_once(registered):
    exit_hold.hold()  # never armed: nothing to do
    assert not exit_hold.armed()
    first = Peers(0, (1,))
    exit_hold.arm(first)
    exit_hold.arm(Peers(0, (1, 2)))
    assert registered == [exit_hold.hold] and exit_hold._HOLD.peers is first


@pytest.mark.parametrize("clean", [True, False])
def test_a_worker_says_it_leaves_and_never_waits(registered, clean):
    peers = Peers(1, (0,), late={0: None})  # the chief would never say it leaves
    exit_hold.arm(peers)
    exit_hold.script_ended(clean=clean)
    exit_hold.hold()
    assert peers.told == [clean] and peers.polls == {0: 0}


def test_a_worker_whose_word_hangs_leaves_after_its_2_s_bound(registered, monkeypatch):
    """Nobody listens (the service hangs): the worker waits for its word TELL_S = 2 s, the
    documented bound, and leaves with the word still on its way."""
    joins, tellers = [], []

    class Teller(threading.Thread):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            tellers.append(self)

        def join(self, timeout=None):
            joins.append(timeout)
            super().join(timeout)

    monkeypatch.setattr(exit_hold, "threading", types.SimpleNamespace(Thread=Teller))
    started, release = threading.Event(), threading.Event()

    def hang():
        started.set()
        release.wait(60)

    exit_hold.arm(Peers(1, (0,), tell=hang))
    try:
        exit_hold.hold()  # returns although the word is still on its way
        assert exit_hold.TELL_S == 2.0 and joins == [2.0]
        assert started.is_set() and [t.is_alive() for t in tellers] == [True]
        assert tellers[0].daemon  # the interpreter does not wait for it either
    finally:
        release.set()


def test_the_chief_waits_for_every_worker_to_leave_or_be_gone(registered, capsys):
    peers = Peers(0, (1, 2, 3), late={1: 3, 2: None}, dead={2})
    exit_hold.arm(peers)
    exit_hold.hold()
    assert peers.polls == {1: 4, 2: 1, 3: 1}  # 1 said so late, 2 is gone, 3 said so at once
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("how", ["script_ended", "uncaught"])
def test_a_failed_chief_leaves_without_waiting(registered, monkeypatch, how):
    peers = Peers(0, (1,), late={1: None})
    exit_hold.arm(peers)
    if how == "script_ended":
        exit_hold.script_ended(clean=False)
    else:  # what Python records before atexit hooks run
        monkeypatch.setattr(sys, "last_value", ValueError("boom"), raising=False)
    exit_hold.hold()
    assert peers.polls == {1: 0} and peers.told == []


def test_the_chief_leaves_at_the_timeout_naming_whom_it_waited_for(registered, capsys):
    exit_hold.arm(Peers(0, (1, 2), timeout=0.2, late={1: None, 2: None}))
    exit_hold.hold()
    err = capsys.readouterr().err
    assert "tfdist: worker 0: workers 1, 2 did not finish within 0 s of this one" in err
    assert "(TFDIST_SHUTDOWN_TIMEOUT); leaving without them" in err


def test_a_long_wait_says_whom_it_waits_for(registered, monkeypatch, capsys):
    monkeypatch.setattr(exit_hold, "PROGRESS_AFTER_S", 0.01)
    exit_hold.arm(Peers(0, (1,), late={1: 5}))
    exit_hold.hold()
    err = capsys.readouterr().err
    assert "worker 0 finished; waiting up to 60 s for worker 1 to finish" in err
    assert "leaving without" not in err


def test_a_failed_service_ends_the_wait_quietly(registered, capsys):
    class Gone(Peers):
        def arrived(self, rank, seconds):
            raise RuntimeError("Failed to send RPC to coordination service")

    exit_hold.arm(Gone(0, (1,)))
    exit_hold.hold()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "ending, clean",
    [("pass", True), ("sys.exit(0)", True), ("sys.exit(75)", True),
     ("sys.exit(3)", False), ("raise ValueError('boom')", False)],
)  # fmt: skip
def test_bootstrap_tells_the_hold_how_the_script_ended(
    registered, tmp_path, monkeypatch, ending, clean
):
    script = tmp_path / "train.py"
    script.write_text(f"import sys\n{ending}\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    raises = pytest.raises((SystemExit, ValueError))
    with raises if ending != "pass" else contextlib.nullcontext():
        bootstrap.main([str(script)])
    assert exit_hold._HOLD.script_failed is (not clean)


def _info(rank, chiefs=0, workers=2):
    spec = {"worker": tuple(f"127.0.0.1:{2000 + i}" for i in range(workers))}
    if chiefs:
        spec["chief"] = ("127.0.0.1:1999",)
    task = ("chief", 0) if rank < chiefs else ("worker", rank - chiefs)
    return cluster.ClusterInfo("TF_CONFIG", spec, *task, num_workers=workers + chiefs)


@pytest.fixture
def service(monkeypatch):
    """The coordination service's store and health probe, as the TensorFlow calls see
    them: a dict, and the tasks that answer."""
    import tensorflow as tf

    store = types.SimpleNamespace(values={}, waits=[], probes=[], answers={})

    def get(key, timeout_ms):
        store.waits.append((key, timeout_ms))
        if key not in store.values:
            raise tf.errors.DeadlineExceededError(None, None, f"{key} not set in time")
        return store.values[key]

    def probe(task, timeout_ms):
        store.probes.append((task, timeout_ms))
        error = store.answers.get(task)
        if error is not None:
            raise error

    monkeypatch.setattr(upstream, "tf_key_value_set", store.values.__setitem__)
    monkeypatch.setattr(upstream, "tf_key_value_get", get)
    monkeypatch.setattr(upstream, "tf_check_peer_health", probe)
    return store


@pytest.mark.parametrize("clean, word", [(True, "clean"), (False, "failed")])
def test_tensorflow_peers_the_chief_reads_the_word_a_worker_writes(service, clean, word):
    chief = exit_hold._TensorFlowPeers(_info(0), 0, (1,), 60)
    worker = exit_hold._TensorFlowPeers(_info(1), 1, (0,), 60)
    assert not chief.arrived(1, 0.5)  # not said yet: the wait ran out
    worker.tell(clean)
    assert service.values == {"tfdist/exit/1": word}
    assert chief.arrived(1, 0.0001)
    assert service.waits == [("tfdist/exit/1", 500), ("tfdist/exit/1", 1)]


def test_tensorflow_peers_a_failed_service_is_not_a_word(service, monkeypatch):
    import tensorflow as tf

    def gone(key, timeout_ms):
        raise tf.errors.UnavailableError(None, None, "Failed to send RPC to coordination")

    monkeypatch.setattr(upstream, "tf_key_value_get", gone)
    with pytest.raises(tf.errors.UnavailableError):  # the chief's wait then ends quietly
        exit_hold._TensorFlowPeers(_info(0), 0, (1,), 60).arrived(1, 1.0)


def test_tensorflow_peers_a_worker_is_gone_only_when_nothing_answers(service):
    import tensorflow as tf

    chief = exit_hold._TensorFlowPeers(_info(0, workers=3), 0, (1, 2), 60)
    service.answers["/job:worker/replica:0/task:1"] = tf.errors.UnavailableError(
        None, None, "connection refused"
    )
    service.answers["/job:worker/replica:0/task:2"] = tf.errors.DeadlineExceededError(
        None, None, "slow"
    )
    assert not chief.alive(1)  # nothing listens there
    assert chief.alive(2)  # slow to answer: still there
    del service.answers["/job:worker/replica:0/task:2"]
    assert chief.alive(2)
    assert service.probes == [
        ("/job:worker/replica:0/task:1", 1000),
        ("/job:worker/replica:0/task:2", 1000),
        ("/job:worker/replica:0/task:2", 1000),
    ]


def test_tensorflow_peers_probe_the_task_of_each_rank_with_a_chief_job(service):
    chief = exit_hold._TensorFlowPeers(_info(0, chiefs=1, workers=2), 0, (1, 2), 60)
    worker = exit_hold._TensorFlowPeers(_info(2, chiefs=1, workers=2), 2, (0, 1), 60)
    for rank in (1, 2):
        chief.alive(rank)
    worker.alive(0)
    assert [task for task, _ in service.probes] == [
        "/job:worker/replica:0/task:0",
        "/job:worker/replica:0/task:1",
        "/job:chief/replica:0/task:0",
    ]
    worker.tell(True)
    assert service.values == {"tfdist/exit/2": "clean"}
