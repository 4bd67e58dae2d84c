"""At a clean exit, the workers of a multi-worker TensorFlow job leave together.

TensorFlow's coordination service (barriers, the key-value store) runs inside the chief's
process, and TensorFlow's Python never runs the service's shutdown barrier: a chief that
leaves right after a barrier takes the service with it while the other workers' answers
are still on their way, and they fail with "Failed to send RPC to coordination service"
(seen on worker 1 in ``tfdist.save``'s last barrier, the chief having saved and exited).

So once tfdist has used the service in this process (``arm``: a barrier, a key-value
read or write), a clean exit waits at one more barrier, ``tfdist/exit``, for at most
``TFDIST_SHUTDOWN_TIMEOUT`` seconds (default 60): the chief leaves only when every
worker has finished its own calls. The wait is bounded and says so:

* a process whose script failed (an uncaught exception, or ``sys.exit`` with a code
  other than 0 or the restart code, as ``tfdist.bootstrap`` reports through
  ``script_ended``) leaves at once: its peers learn of it from the launcher or the
  heartbeats, and nobody waits for it longer than the heartbeat timeout;
* after ``PROGRESS_AFTER_S`` a line says whom it waits for and until when; at the
  timeout one line says it leaves without them;
* a failed wait (a peer already declared dead, the chief gone after the barrier) ends
  it quietly: the script's work is done either way.

JAX needs none of this: ``jax.distributed`` runs its own shutdown barrier at exit.

Example:
    >>> arm(lambda seconds: None, timeout=60)   # what the TensorFlow backend does
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "PROGRESS_AFTER_S",
    "EXIT_BARRIER",
    "arm",
    "arm_tensorflow",
    "armed",
    "script_ended",
    "hold",
]

PROGRESS_AFTER_S = 5.0  # a wait shorter than this says nothing
EXIT_BARRIER = "tfdist/exit"


@dataclass
class _Hold:
    wait: Callable[[float], None] | None = None  # waits at the exit barrier, or raises
    timeout: float = 60.0
    who: str = "this worker"
    script_failed: bool = False


_HOLD = _Hold()


def arm(wait: Callable[[float], None], *, timeout: float, who: str = "this worker") -> None:
    """Makes a clean exit of this process wait (``wait(timeout)``) for the other workers.

    Idempotent: the first call registers the ``atexit`` hook; later calls change nothing.

    Args:
        wait: blocks until every worker reaches the exit barrier, raising when it cannot
            (timeout, a peer gone).
        timeout: seconds the exit waits at most.
        who: this process, as messages name it ("worker 1").
    """
    if _HOLD.wait is not None:
        return
    _HOLD.wait, _HOLD.timeout, _HOLD.who = wait, float(timeout), who
    # atexit runs last-registered first: this hook, registered when the job first used
    # the service, runs after hooks registered later (an async checkpoint's close).
    atexit.register(hold)


def arm_tensorflow() -> None:
    """``arm`` for a multi-worker TensorFlow job: called wherever tfdist uses TensorFlow's
    coordination service (barriers, the key-value store), which lives in the chief."""
    if armed():
        return
    from tfdist.core import cluster, config, process, upstream

    timeouts = process.state().multi_worker_timeouts or config.MultiWorkerTimeouts.from_env()

    def wait(seconds: float) -> None:
        upstream.tf_wait_at_barrier(EXIT_BARRIER, int(seconds * 1000))

    arm(wait, timeout=timeouts.shutdown, who=f"worker {cluster.cluster_from_env().rank}")


def armed() -> bool:
    """Whether a clean exit of this process waits for the other workers."""
    return _HOLD.wait is not None


def script_ended(*, clean: bool) -> None:
    """Records how the script ended: a failed one leaves without waiting for its peers."""
    _HOLD.script_failed = not clean


def _failed_uncaught() -> bool:
    # Python records an uncaught exception here before running atexit hooks.
    return (
        getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
    )


def hold() -> None:
    """The ``atexit`` hook: waits at the exit barrier when the script ended cleanly."""
    wait = _HOLD.wait
    if wait is None or _HOLD.script_failed or _failed_uncaught():
        return
    done = threading.Event()
    start = time.monotonic()

    def progress() -> None:
        if not done.wait(PROGRESS_AFTER_S):
            print(
                f"tfdist: {_HOLD.who} finished; waiting up to {_HOLD.timeout:.0f} s for the "
                "other workers to finish theirs (TFDIST_SHUTDOWN_TIMEOUT)",
                file=sys.stderr,
                flush=True,
            )

    threading.Thread(target=progress, name="tfdist-exit-progress", daemon=True).start()
    try:
        wait(_HOLD.timeout)
    except Exception:  # the work is done: a failed wait only ends the wait
        if time.monotonic() - start >= _HOLD.timeout - 1.0:
            print(
                f"tfdist: {_HOLD.who}: not every worker finished within {_HOLD.timeout:.0f} s "
                "of this one (TFDIST_SHUTDOWN_TIMEOUT); leaving without them",
                file=sys.stderr,
                flush=True,
            )
    finally:
        done.set()
