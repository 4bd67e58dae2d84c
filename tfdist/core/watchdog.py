"""Ends every process of a multi-process JAX job in time when a peer is stuck or gone.

jax's collectives on CPU (gloo) have no timeout: a process that is alive but never joins
the next collective (stuck in a callback, a data read, a lock) leaves every other process
waiting in that collective forever (jax#38503), and jax's heartbeats do not notice, since
the stuck process's runtime still sends them. A Python exception cannot interrupt a jax
collective, so a daemon thread ends the process itself.

* ``fit``/``evaluate``/``predict`` of a multi-process job run inside ``watched(...)``,
  with a callback that reports each finished batch (``progress``) after every other
  callback of that batch (the ``keras_jax_watchdog`` fix, ``tfdist.compat.jax_watchdog``).
* A daemon thread checks every second. When no batch has finished for
  ``TFDIST_JAX_STALL_TIMEOUT`` seconds (``config.jax_stall_timeout``: default 45,
  0 disables the watchdog) it ends the process. The first batch of each call and the
  time from an epoch's end to the next batch (validation set-up, checkpoint saves at
  the epoch's end, the next epoch's input) get ``ALLOWANCE_S`` instead (compiling,
  saving); a save in a batch-end callback does not, so raise the timeout for those.
* Every ``PUBLISH_S`` seconds the thread publishes this process's batch count and a beat
  in jax's coordination store (one small RPC; nothing per batch). Before ending, it reads
  its peers' entries twice, ``PUBLISH_S`` apart: a peer with fewer batches has not
  reached this point; a peer whose beat did not move is gone or stopped. If a batch
  finishes meanwhile, it was only a slow step and the watchdog carries on.
* It prints one line naming them, e.g. ``tfdist: process 0 of 2: no batch finished for
  45 s in fit (7 batches done; TFDIST_JAX_STALL_TIMEOUT=45): waiting for process 1 (6
  batches done, in fit, alive but not progressing); ending this process (exit code 69)``
  (batches: every finished batch of fit/evaluate/predict so far, the same count on every
  process of a job that makes the same calls). A process that finds itself behind says
  where its main thread is and ends at once; one that names a peer still alive first
  waits ``CULPRIT_GRACE_S``, so that peer reports and ends first (and ``tfdist launch``,
  which then stops the others, names it). The verdict takes at most ``VERDICT_MAX_S``
  (11 s): with the default, a stuck job ends within 56 s.
* A collective that fails because a peer is gone (gloo: "Connection closed by peer")
  ends the process the same way (``end_if_peer_lost``), with one line naming the peer
  that stopped publishing, instead of a traceback and jax's abort a few seconds later.
* The process ends with ``os._exit(config.WATCHDOG_EXIT_CODE)`` (69), without running
  ``finally`` blocks or ``atexit``: an exception cannot leave a jax collective, and a
  normal exit would wait at jax's shutdown barrier for the lost peer, then abort (jax
  itself aborts every process once its service declares a peer dead).

Not watched: ``train_on_batch`` loops and other hand-written loops, and one process.

Example:
    >>> with watched("fit"):  # what the fix does around fit  # doctest: +SKIP
    ...     model.fit(data, epochs=3)
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback

from tfdist.core import config, roles, upstream

__all__ = [
    "ALLOWANCE_S",
    "PUBLISH_S",
    "CULPRIT_GRACE_S",
    "VERDICT_MAX_S",
    "enabled",
    "watched",
    "progress",
    "allowance",
    "end_if_peer_lost",
]

logger = logging.getLogger(__name__)

ALLOWANCE_S = 300.0  # the first batch of a call, an epoch's end: compiling, saving
PUBLISH_S = 2.0  # how often a process publishes its progress
CULPRIT_GRACE_S = 3.0  # a process naming a live laggard lets it report and end first
_TICK_S = 1.0
_READ_S = 2.0  # the coordination service answering a read (it takes about 1 ms)
# The longest a verdict takes after the timeout: noticing it, reading the peers twice,
# letting a stuck peer end first. TFDIST_JAX_STALL_TIMEOUT + this ends a stuck job.
VERDICT_MAX_S = _TICK_S + 2 * _READ_S + 1.5 * PUBLISH_S + CULPRIT_GRACE_S
_KEY = "tfdist/watchdog/{}"
# What a collective's error says when a peer is gone (gloo on CPU, jax's runtime).
_LOST_PEER_WORDS = (
    "Gloo",
    "Connection closed by peer",
    "Connection reset by peer",
    "UNAVAILABLE",
    "heartbeat",
    "Socket closed",
)


class _Dog:
    """This process's progress, and the thread that watches and publishes it."""

    def __init__(self, timeout: float, rank: int, size: int):
        self.timeout, self.rank, self.size = timeout, rank, size
        self.lock = threading.Lock()
        self.count = 0  # batches finished, every phase
        self.last = time.monotonic()  # when the last batch finished, or a wait began
        self.allowed = True  # the current wait gets ALLOWANCE_S
        self.phases: list[str] = []  # the calls running, innermost last
        self.beat = 0
        self.checked: BaseException | None = None  # the last error end_if_peer_lost read
        threading.Thread(target=self._watch, name="tfdist-watchdog", daemon=True).start()
        threading.Thread(target=self._publish, name="tfdist-watchdog-publish", daemon=True).start()

    def mark(self, *, batch: bool) -> None:
        with self.lock:
            self.count += batch
            self.last, self.allowed = time.monotonic(), not batch

    def limit(self) -> float:
        return max(ALLOWANCE_S, self.timeout) if self.allowed else self.timeout

    def where(self) -> str:
        return self.phases[-1] if self.phases else "idle"

    def _publish(self) -> None:
        while True:
            with self.lock:
                self.beat += 1
                value = f"{self.count} {self.beat} {self.where()}"
            try:
                upstream.jax_key_value_put(_KEY.format(self.rank), value)
            except Exception as err:  # noqa: BLE001 - jax shut down, or the service is gone
                logger.debug("tfdist.watchdog: stopped publishing (%s)", err)
                return
            time.sleep(PUBLISH_S)

    def _watch(self) -> None:
        while True:
            time.sleep(_TICK_S)
            with self.lock:
                since, last = time.monotonic() - self.last, self.last
                overdue = bool(self.phases) and since > self.limit()
            if overdue:
                _verdict(self, since, last)


_dog: _Dog | None = None
_dog_lock = threading.Lock()


def enabled() -> bool:
    """Whether this is a process of a multi-process JAX job with the watchdog on."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized() or roles.jax_process().count < 2:
        return False
    return config.jax_stall_timeout() is not None


def _get() -> _Dog:
    global _dog
    with _dog_lock:
        if _dog is None:
            timeout = config.jax_stall_timeout()
            assert timeout is not None  # callers check enabled() first
            role = roles.jax_process()
            _dog = _Dog(timeout, role.rank, role.count)
            logger.info(
                "tfdist.watchdog: on, %.0f s without a finished batch ends the job", timeout
            )
        return _dog


@contextlib.contextmanager
def watched(phase: str):
    """Watches the block (a ``fit``, ``evaluate`` or ``predict``) in a multi-process job.

    Its first batch gets ``ALLOWANCE_S``, every later one ``TFDIST_JAX_STALL_TIMEOUT``
    s; a peer lost in a collective ends the process with one line (``end_if_peer_lost``).

    Example:
        >>> with watched("evaluate"):  # doctest: +SKIP
        ...     model.evaluate(data)
    """
    if not enabled():
        yield
        return
    dog = _get()
    with dog.lock:
        dog.phases.append(phase)
    dog.mark(batch=False)
    try:
        yield
    except Exception as err:
        end_if_peer_lost(err, phase)
        raise
    finally:
        with dog.lock:
            dog.phases.pop()
        dog.mark(batch=False)


def progress() -> None:
    """One more batch finished (the fix's callback calls it after the batch's others)."""
    if _dog is not None:
        _dog.mark(batch=True)


def allowance() -> None:
    """The wait starting now gets ``ALLOWANCE_S`` (an epoch's end: saves, the next input)."""
    if _dog is not None:
        _dog.mark(batch=False)


# ------------------------------------------------------------------ verdicts


def _bounded(fn, seconds: float):
    """``fn()``, or TimeoutError when it takes longer (a stopped coordinator never answers)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as err:  # noqa: BLE001 - handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer in {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _read_peers(dog: _Dog) -> dict[int, tuple[int, int, str] | None]:
    """Every peer's published ``(batches, beat, phase)``, None for one never published."""

    def read():
        found = {}
        for rank in range(dog.size):
            if rank != dog.rank:
                text = upstream.jax_key_value_try_get(_KEY.format(rank))
                count, beat, phase = text.split() if text else (0, 0, None)
                found[rank] = (int(count), int(beat), phase) if text else None
        return found

    return _bounded(read, _READ_S)


def _peers(dog: _Dog) -> tuple[dict, set[int]] | str:
    """The peers' entries and those whose beat stopped, or why they cannot be read."""
    try:
        first = _read_peers(dog)
        time.sleep(PUBLISH_S * 1.5)
        second = _read_peers(dog)
    except Exception as err:  # noqa: BLE001 - jax's runtime error, TimeoutError
        summary = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        return f"the job's coordination service (process 0) does not answer ({summary})"
    gone = {
        r
        for r, entry in second.items()
        if entry is None or ((before := first.get(r)) is not None and entry[1] == before[1])
    }
    return second, gone


def _peer_line(rank: int, entry, gone: set[int]) -> str:
    if entry is None:
        return f"process {rank} (never reported)"
    state = "not answering" if rank in gone else "alive but not progressing"
    return f"process {rank} ({entry[0]} batches done, in {entry[2]}, {state})"


def _main_thread_at() -> str:
    ident = threading.main_thread().ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "an unknown place"
    code = frame.f_code
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"


def _stuck_line(dog: _Dog, since: float, found) -> tuple[str, bool]:
    """The verdict's line, and whether it names a live peer that should end first."""
    head = (
        f"tfdist: process {dog.rank} of {dog.size}: no batch finished for {since:.0f} s in "
        f"{dog.where()} ({dog.count} batches done; TFDIST_JAX_STALL_TIMEOUT={dog.timeout:g})"
    )
    if isinstance(found, str):
        return f"{head}; {found}", False
    entries, gone = found
    behind = [r for r, e in sorted(entries.items()) if e is None or e[0] < dog.count]
    ahead = [r for r, e in sorted(entries.items()) if e is not None and e[0] > dog.count]
    if behind:
        names = ", ".join(_peer_line(r, entries[r], gone) for r in behind)
        return f"{head}: waiting for {names}", any(r not in gone for r in behind)
    if ahead:
        further = ", ".join(f"process {r}" for r in ahead)
        return (
            f"{head}: no other process is behind and {further} got further, so this one is "
            f"stuck, in {_main_thread_at()}"
        ), False
    names = ", ".join(_peer_line(r, e, gone) for r, e in sorted(entries.items()))
    return (
        f"{head}: every process got as far and none progressed since ({names}); this one "
        f"is in {_main_thread_at()}"
    ), False


def _end(line: str, wait: float = 0.0, note: str = "") -> None:
    """Prints ``line`` and ends the process, after ``wait`` s (no cleanup: see above)."""
    line += f"; ending this process (exit code {config.WATCHDOG_EXIT_CODE}{note})"
    print(line, file=sys.stderr, flush=True)  # not logging: its handlers may buffer
    time.sleep(wait)
    sys.stdout.flush()
    os._exit(config.WATCHDOG_EXIT_CODE)


def _verdict(dog: _Dog, since: float, last: float) -> None:
    """Ends the process, naming the peers it waits for, unless a batch finishes meanwhile."""
    found = _peers(dog)
    with dog.lock:
        if dog.last != last or not dog.phases:
            return  # only a slow step: it finished while the peers were read
    line, wait_for_peer = _stuck_line(dog, since, found)
    _end(line, CULPRIT_GRACE_S if wait_for_peer else 0.0)


def end_if_peer_lost(err: BaseException, phase: str) -> None:
    """Ends the process with one line if ``err`` is a collective failing for a lost peer.

    Returns (the caller re-raises ``err``) when it is not: another error, or every peer
    still publishing. jax itself aborts every process a few seconds later anyway (its
    heartbeats): ending now only says which peer it was, once.
    """
    dog = _dog
    text = str(err)
    if dog is None or dog.checked is err or not any(w in text for w in _LOST_PEER_WORDS):
        return
    dog.checked = err  # an enclosing watched() (evaluate inside fit) need not ask again
    found = _peers(dog)
    head = (
        f"tfdist: process {dog.rank} of {dog.size}: a collective in {phase} failed after "
        f"{dog.count} batches ({text.strip().splitlines()[0][:200]})"
    )
    if isinstance(found, str):
        line = f"{head}: {found}"
    else:
        entries, gone = found
        if not gone:
            return
        line = f"{head}: lost " + ", ".join(_peer_line(r, entries[r], gone) for r in sorted(gone))
    if config.debug():
        traceback.print_exception(err)
    _end(line, note="; TFDIST_DEBUG=1 shows the traceback")
