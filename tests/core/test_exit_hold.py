"""tfdist.core.exit_hold: a clean exit waits (bounded) for the other workers, a failed one
does not; the multi-worker behaviour is in tests/test_barrier.py (a late peer)."""

from __future__ import annotations

import contextlib
import sys
import time

import pytest

from tfdist import bootstrap
from tfdist.core import exit_hold


@pytest.fixture
def hold(monkeypatch):
    """A fresh hold whose atexit registrations are recorded, not made."""
    registered = []
    monkeypatch.setattr(exit_hold, "_HOLD", exit_hold._Hold())
    monkeypatch.setattr(exit_hold.atexit, "register", registered.append)
    for name in ("last_exc", "last_value"):
        monkeypatch.delattr(sys, name, raising=False)
    return registered


def test_a_clean_exit_waits_once_armed_and_only_then(hold):
    waits = []
    exit_hold.hold()  # never armed: nothing to wait for
    assert waits == [] and not exit_hold.armed()
    exit_hold.arm(waits.append, timeout=12, who="worker 1")
    exit_hold.arm(lambda s: pytest.fail("a second arm replaced the first"), timeout=1)
    assert hold == [exit_hold.hold] and exit_hold.armed()  # registered once
    exit_hold.hold()
    assert waits == [12.0]


@pytest.mark.parametrize("how", ["script_ended", "uncaught"])
def test_a_failed_script_leaves_without_waiting(hold, monkeypatch, how):
    exit_hold.arm(lambda s: pytest.fail("a failed script waited for its peers"), timeout=5)
    if how == "script_ended":
        exit_hold.script_ended(clean=False)
    else:  # what Python records before atexit hooks run
        monkeypatch.setattr(sys, "last_value", ValueError("boom"), raising=False)
    exit_hold.hold()


def test_a_failed_wait_is_quiet_unless_it_timed_out(hold, capsys):
    def gone(seconds):
        raise RuntimeError("Failed to send RPC to coordination service")

    exit_hold.arm(gone, timeout=30, who="worker 1")
    exit_hold.hold()  # the chief left after the barrier: the work is done, nothing to say
    assert capsys.readouterr().err == ""
    exit_hold._HOLD.timeout = 0.5

    def timed_out(seconds):
        time.sleep(seconds)
        raise RuntimeError("Barrier timed out")

    exit_hold._HOLD.wait = timed_out
    exit_hold.hold()
    err = capsys.readouterr().err
    assert "worker 1: not every worker finished within 0 s of this one" in err
    assert "TFDIST_SHUTDOWN_TIMEOUT" in err and "leaving without them" in err


def test_a_long_wait_says_what_it_waits_for(hold, monkeypatch, capsys):
    monkeypatch.setattr(exit_hold, "PROGRESS_AFTER_S", 0.05)
    exit_hold.arm(lambda s: time.sleep(0.5), timeout=60, who="worker 0")
    exit_hold.hold()
    err = capsys.readouterr().err
    assert "worker 0 finished; waiting up to 60 s for the other workers" in err


@pytest.mark.parametrize(
    "ending, clean",
    [("pass", True), ("sys.exit(0)", True), ("sys.exit(75)", True),
     ("sys.exit(3)", False), ("raise ValueError('boom')", False)],
)  # fmt: skip
def test_bootstrap_tells_the_hold_how_the_script_ended(hold, tmp_path, monkeypatch, ending, clean):
    script = tmp_path / "train.py"
    script.write_text(f"import sys\n{ending}\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises((SystemExit, ValueError)) if ending != "pass" else contextlib.nullcontext():
        bootstrap.main([str(script)])
    assert exit_hold._HOLD.script_failed is (not clean)
