"""The SIGTERM protocol: save at a step every worker agrees on, then exit "restart me".

One process: the step is the next step boundary. Several workers: the first worker that
gets SIGTERM publishes "save after step s+1" through the coordination service's
key-value store (the backend's ``key_value_set``/``key_value_get``: TensorFlow's, or
jax's distributed runtime under JAX) and waits (with a timeout) until every worker's
watcher thread has acknowledged it; since synchronous workers are at most one step
apart, every worker then saves after the same step. This is the protocol of
``tf.distribute.experimental.PreemptionCheckpointHandler``, which tfdist does not use
directly: it saves only ``tf.train.Checkpoint``s, and its constructor probes the GCE
metadata server over the network.

Example:
    >>> watch = PreemptionWatch(multi_worker=False, rank=0, num_workers=1,
    ...                         key="tfdist/preempt/1", timeout=60.0)
    >>> watch.should_save(step=10)
    False
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from tfdist import backends
from tfdist.backends import StoreGone

__all__ = ["PreemptionWatch", "StoreGone", "key_value_store"]

logger = logging.getLogger(__name__)


class _BackendStore:
    """The backend's coordination store, behind the two calls the protocol needs."""

    def __init__(self, backend: backends.Backend):
        self._backend = backend

    def set(self, key: str, value: str) -> bool:
        """Sets ``key``; False when another worker set it first."""
        return self._backend.key_value_set(key, value)

    def get(self, key: str, timeout_ms: int) -> str | None:
        """The value of ``key``, or None when it is not set within ``timeout_ms``."""
        return self._backend.key_value_get(key, timeout_ms / 1000)


def key_value_store() -> _BackendStore:
    """The coordination store of this process's backend (``set``/``get``, see above).

    Both raise ``StoreGone`` when the store cannot be reached.

    Example:
        >>> key_value_store().set("tfdist/preempt/1", "42")  # doctest: +SKIP
        True
    """
    return _BackendStore(backends.get())


class PreemptionWatch:
    """Turns SIGTERM into "save at an agreed step, then exit with RESTART_EXIT_CODE".

    Args:
        multi_worker: whether several workers must agree on the step (through the
            coordination service); False saves at this process's next step.
        rank, num_workers: this worker's index and the number of workers.
        key: the key-value store key of this fit's notice (unique per fit).
        timeout: seconds the announcing worker waits for every acknowledgement.
        store: the key-value store (``key_value_store()`` of the backend when None).
    """

    def __init__(
        self,
        *,
        multi_worker: bool,
        rank: int,
        num_workers: int,
        key: str,
        timeout: float,
        store=None,
    ):
        self.multi_worker = multi_worker
        self._store = store if store is not None or not multi_worker else key_value_store()
        self.rank = rank
        self.num_workers = num_workers
        self.key = key
        self.timeout = timeout
        self._received = threading.Event()
        self._stop = threading.Event()
        self._target: int | None = None
        self._announced = False
        # The SIGTERM handler start() replaced (what signal.signal returns).
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None
        self._installed = False
        self._thread: threading.Thread | None = None

    @property
    def received(self) -> bool:
        """Whether this process got SIGTERM."""
        return self._received.is_set()

    def start(self) -> None:
        """Installs the SIGTERM handler and, with several workers, the watcher thread."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "tfdist: fit runs outside the main thread, so SIGTERM cannot be caught; "
                "preemption saves are off (periodic checkpoints still work)."
            )
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        if self.multi_worker:
            self._thread = threading.Thread(
                target=self._watch_peers, name=f"tfdist-preemption-{self.rank}", daemon=True
            )
            self._thread.start()

    def cancel(self) -> None:
        """Tells the watcher thread to stop, without waiting for it (the process exits)."""
        self._stop.set()

    def stop(self) -> None:
        """Stops the watcher thread and puts the previous SIGTERM handler back."""
        self._stop.set()
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._installed = False
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _on_sigterm(self, signum, frame) -> None:
        if self._received.is_set():
            # A second SIGTERM: stop waiting for a save point and terminate as asked.
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._received.set()
        logger.warning("tfdist: SIGTERM received; saving at the next step, then exiting")

    def should_save(self, step: int) -> bool:
        """Whether to save and exit after ``step`` (the global step just finished)."""
        if not self.multi_worker:
            return self._received.is_set()
        if self._target is not None:
            return step >= self._target
        if self._received.is_set() and not self._announced:
            self._announced = True
            self._announce(step + 1)
        return self._target is not None and step >= self._target

    def _announce(self, step: int) -> None:
        """Publishes ``step`` and waits for every worker's acknowledgement (or the timeout)."""
        try:
            if not self._store.set(self.key, str(step)):
                return  # another worker announced first; our watcher thread will read it
        except StoreGone as err:
            logger.error("tfdist: cannot announce the preemption save step (%s)", err)
            self._target = step
            return
        deadline = time.monotonic() + self.timeout
        for rank in range(self.num_workers):
            remaining_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            try:
                acknowledged = self._store.get(f"{self.key}/ack/{rank}", remaining_ms)
            except StoreGone:
                acknowledged = None
            if acknowledged is None:
                logger.error(
                    "tfdist: worker %d did not acknowledge the preemption save step within "
                    "%.0f s; saving and exiting anyway.",
                    rank,
                    self.timeout,
                )
                self._target = step
                return

    def _watch_peers(self) -> None:
        """Watcher thread: waits for another worker's notice, adopts it, acknowledges."""
        while not self._stop.is_set():
            try:
                value = self._store.get(self.key, 500)
            except StoreGone as err:  # the coordination service is gone: job ending
                logger.debug("tfdist: preemption watcher stops: %s", err)
                return
            if value is None:
                continue
            # Set the target before acknowledging: the announcer resumes training only
            # after every acknowledgement, so every worker knows the step in time.
            self._target = int(value)
            with contextlib.suppress(StoreGone):
                self._store.set(f"{self.key}/ack/{self.rank}", "1")
            return
