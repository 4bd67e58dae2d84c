"""The chief of a multi-worker TensorFlow job leaves after the other workers, not before.

TensorFlow's coordination service (barriers, the key-value store) runs inside the chief's
process (rank 0), and TensorFlow's Python never runs the service's shutdown barrier: a
chief that leaves right after a barrier takes the service with it while the other
workers' answers are still on their way, and they fail with "Failed to send RPC to
coordination service" (seen on worker 1 in ``tfdist.save``'s last barrier: the chief had
saved and exited).

So once tfdist has used the service in this process (``arm_tensorflow``: a barrier, a
key-value read or write), its exit does one more thing:

* every other worker, at any exit, writes ``tfdist/exit/<rank>`` (at most ``TELL_S``
  seconds, in a thread: a service already gone changes nothing) and leaves: it never
  waits, as upstream;
* the chief, at a clean exit, waits until every other worker has written its key or is
  gone (its process no longer answers), at most ``TFDIST_SHUTDOWN_TIMEOUT`` seconds
  (default 60); after ``PROGRESS_AFTER_S`` a line names whom it waits for, and at the
  timeout one line says it leaves without them. A chief whose script failed (an uncaught
  exception, or ``sys.exit`` with a code other than 0 or the restart code, as
  ``tfdist.bootstrap`` reports through ``script_ended``) leaves at once.

JAX needs none of this: ``jax.distributed`` runs its own shutdown barrier at exit.

Example:
    >>> arm(_Peers(rank=1, others=(0,)))   # what the TensorFlow backend does, on worker 1
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from dataclasses import dataclass

__all__ = ["PROGRESS_AFTER_S", "TELL_S", "arm", "arm_tensorflow", "armed", "script_ended", "hold"]

PROGRESS_AFTER_S = 5.0  # the chief's wait says nothing before this
TELL_S = 2.0  # the longest a worker spends saying it leaves
_POLL_S = 1.0  # the chief looks for the next key, then at that worker's process, this often


class _Peers:
    """The other workers as the exit sees them. The TensorFlow backend's subclass talks to
    the coordination service; this base (for tests) has nobody to wait for."""

    def __init__(self, rank: int, others: tuple[int, ...], timeout: float = 60.0):
        self.rank, self.others, self.timeout = rank, others, float(timeout)

    def tell(self, clean: bool) -> None:
        """Says that this worker leaves (a non-chief, at any exit)."""

    def arrived(self, rank: int, seconds: float) -> bool:
        """Whether worker ``rank`` said it leaves, waiting up to ``seconds``."""
        return True

    def alive(self, rank: int) -> bool:
        """Whether worker ``rank``'s process still answers."""
        return False


@dataclass
class _Hold:
    peers: _Peers | None = None
    script_failed: bool = False


_HOLD = _Hold()


def arm(peers: _Peers) -> None:
    """Makes this process's exit tell the chief it leaves, or (the chief) wait for the rest.

    Idempotent: the first call registers the ``atexit`` hook; later calls change nothing.
    """
    if _HOLD.peers is not None:
        return
    _HOLD.peers = peers
    # atexit runs last-registered first: this hook, registered when the job first used
    # the service, runs after hooks registered later (an async checkpoint's close).
    atexit.register(hold)


def arm_tensorflow() -> None:
    """``arm`` for a multi-worker TensorFlow job: called wherever tfdist uses TensorFlow's
    coordination service (barriers, the key-value store), which lives in the chief."""
    if armed():
        return
    from tfdist.core import cluster, config, process, roles

    info = cluster.cluster_from_env()
    role = roles.of_cluster(info)
    timeouts = process.state().multi_worker_timeouts or config.MultiWorkerTimeouts.from_env()
    others = tuple(r for r in range(role.count) if r != role.rank)
    arm(_TensorFlowPeers(info, role.rank, others, timeouts.shutdown))


class _TensorFlowPeers(_Peers):
    def __init__(self, info, rank: int, others: tuple[int, ...], timeout: float):
        super().__init__(rank, others, timeout)
        self.chiefs = len(info.cluster.get("chief", ()))

    def _task(self, rank: int) -> str:
        if rank < self.chiefs:
            return f"/job:chief/replica:0/task:{rank}"
        return f"/job:worker/replica:0/task:{rank - self.chiefs}"

    def tell(self, clean: bool) -> None:
        from tfdist.core import upstream

        upstream.tf_key_value_set(f"tfdist/exit/{self.rank}", "clean" if clean else "failed")

    def arrived(self, rank: int, seconds: float) -> bool:
        import tensorflow as tf

        from tfdist.core import upstream

        try:
            upstream.tf_key_value_get(f"tfdist/exit/{rank}", max(1, int(seconds * 1000)))
        except tf.errors.DeadlineExceededError:
            return False
        return True

    def alive(self, rank: int) -> bool:
        import tensorflow as tf

        from tfdist.core import upstream

        try:
            upstream.tf_check_peer_health(self._task(rank), int(_POLL_S * 1000))
        except tf.errors.UnavailableError:
            return False  # nothing listens there any more
        except tf.errors.OpError:
            return True  # slow to answer, or restarted: keep waiting, within the timeout
        return True


def armed() -> bool:
    """Whether this process's exit tells the chief, or (the chief) waits for the others."""
    return _HOLD.peers is not None


def script_ended(*, clean: bool) -> None:
    """Records how the script ended: a failed chief leaves without waiting for its peers."""
    _HOLD.script_failed = not clean


def _failed() -> bool:
    # Python records an uncaught exception in sys.last_exc (3.12+) or sys.last_value
    # before it runs the atexit hooks.
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return _HOLD.script_failed or uncaught is not None


def hold() -> None:
    """The ``atexit`` hook: a worker says it leaves; the chief waits for the others."""
    peers = _HOLD.peers
    if peers is None or not peers.others:
        return
    if peers.rank != 0:
        teller = threading.Thread(
            target=_quietly, args=(peers.tell, not _failed()), name="tfdist-exit", daemon=True
        )
        teller.start()
        teller.join(TELL_S)
        return
    if not _failed():
        _wait_for(peers)


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except Exception:  # the service is gone already: nobody is left to tell
        pass


def _wait_for(peers: _Peers) -> None:
    """The chief's wait: until every other worker said it leaves or is gone, or the timeout."""
    start = time.monotonic()
    pending = list(peers.others)
    announced = False
    while pending:
        left = peers.timeout - (time.monotonic() - start)
        if left <= 0:
            _say(
                f"tfdist: worker {peers.rank}: {_workers(pending)} did not finish within "
                f"{peers.timeout:.0f} s of this one (TFDIST_SHUTDOWN_TIMEOUT); leaving "
                "without them"
            )
            return
        if not announced and time.monotonic() - start >= PROGRESS_AFTER_S:
            _say(
                f"tfdist: worker {peers.rank} finished; waiting up to {peers.timeout:.0f} s "
                f"for {_workers(pending)} to finish (TFDIST_SHUTDOWN_TIMEOUT)"
            )
            announced = True
        rank = pending[0]
        try:
            if peers.arrived(rank, min(_POLL_S, left)) or not peers.alive(rank):
                pending.pop(0)
        except Exception:  # the service itself failed: there is nothing to wait with
            return


def _workers(ranks: list[int]) -> str:
    return ("worker " if len(ranks) == 1 else "workers ") + ", ".join(map(str, ranks))


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
