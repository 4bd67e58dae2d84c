"""The first step of an epoch on TensorFlow: finished data iterators released off the main
thread.

Keras's TensorFlow ``fit`` drops each epoch's data iterator on the main thread at the next
epoch's first step: the loop variable holding it is rebound there, and
``EpochIterator._enumerate_iterator`` replaces the iterator it made at the previous
epoch's end. Destroying a tf.data iterator whose pipeline autotunes waits for its
autotuning thread, which sleeps in a timed wait of up to a minute that the destructor's
cancellation does not cut short. Measured (tools/bench_epoch_start.py, 2 logical CPU
devices, a quiet 2-core machine): first steps of 3 to 30 s against a median step of
0.05 s; the main thread's stack during the wait is
``EagerTensor_dealloc -> ~IteratorResource -> ~RootDataset::Iterator ->
~LogicalThreadWrapper``. With autotuning off in every dataset (the user's and the
per-device ones a ``MultiDeviceIterator`` builds) the wait is gone, which names the
thread it waits for.

The fix ``keras_tf_iterators_released_in_background`` keeps a reference to every iterator
``TFEpochIterator`` makes; a thread of tfdist's drops it once Keras no longer holds it, so the
destructor's wait happens on that thread (TensorFlow releases the GIL while it deletes a
tensor handle) and training goes on. Nothing else changes: Keras makes the same
iterators in the same order (one shuffle order each), uses them as before, and every
iterator is still destroyed, a fraction of a second later. The thread ends one poll
after the main thread (Python joins it before finalizing, so an exit waits for a
destruction under way, as upstream's exit waits for it on the main thread); iterators
still in use then are dropped as upstream drops them.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

import atexit
import sys
import threading

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = ["FIXES", "IteratorReleaser", "RELEASER", "fix_iterators_released_in_background"]

THREAD_NAME = "tfdist-iterator-release"


class IteratorReleaser:
    """Holds iterators and drops each one on its own thread once nothing else holds it.

    Example:
        >>> releaser = IteratorReleaser(poll_s=0.01)
        >>> it = releaser.keep(iter([1, 2]))
        >>> del it          # its thread drops the last reference soon after
    """

    # getrefcount's argument, the comprehension's variable and our list.
    _ONLY_OURS = 3

    def __init__(self, poll_s: float = 0.25):
        self.poll_s = poll_s
        self._held: list = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def keep(self, iterator):
        """Holds ``iterator`` until its other holders have dropped it; returns it."""
        with self._lock:
            self._held.append(iterator)
            if self._thread is None:
                # Not a daemon: a daemon thread inside a destructor at interpreter exit is
                # unwound through TensorFlow's C++ frames, which aborts the process
                # ("FATAL: exception not rethrown"). Python joins this thread before
                # finalizing; it ends one poll after the main thread does.
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME)
                self._thread.start()
                atexit.register(self.release_all)
        return iterator

    def held(self) -> int:
        """How many iterators are held now (some may still be in use)."""
        with self._lock:
            return len(self._held)

    def _run(self) -> None:
        main = threading.main_thread()
        while main.is_alive():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            self._release_unused()
        self._release_unused()  # what the main thread let go of last

    def _release_unused(self) -> None:
        with self._lock:
            unused = [it for it in self._held if sys.getrefcount(it) <= self._ONLY_OURS]
            ids = {id(it) for it in unused}
            self._held = [it for it in self._held if id(it) not in ids]
        # The last references go here, on this thread: the destructors (and their waits)
        # run now, outside the lock.
        unused.clear()

    def release_all(self) -> None:
        """Drops every held reference on the calling thread (at interpreter exit)."""
        with self._lock:
            self._held = []


RELEASER = IteratorReleaser()


class _KeptDataset:
    """What ``TFEpochIterator._get_iterator`` returns under the fix: ``iter()`` of it is
    ``iter()`` of the distributed dataset, with the iterator handed to ``RELEASER``."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return RELEASER.keep(iter(self.dataset))


def fix_iterators_released_in_background() -> None:
    """Routes every iterator Keras's TensorFlow ``EpochIterator`` makes through
    ``RELEASER``, so that its destruction (and tf.data's wait for the iterator's
    autotuning thread) happens on the releaser's thread, not in the next epoch's first step.
    ``_get_iterator`` is only ever called as ``iter(self._get_iterator())``.
    """

    def make(original):
        def _get_iterator(self):
            return _KeptDataset(original(self))

        return _get_iterator

    patch(
        upstream.keras_tf_epoch_iterator_class(),
        "_get_iterator",
        "keras_tf_iterators_released_in_background",
        make,
    )


FIXES = [
    Fix(
        "keras_tf_iterators_released_in_background",
        "Keras 3 fit on TensorFlow destroys the previous epoch's tf.data iterator in the "
        "next epoch's first step, which waits for the iterator's autotuning thread: first "
        "steps of seconds to tens of seconds",
        on_keras_backend("tensorflow"),
        fix_iterators_released_in_background,
        targets=targets(
            "keras.src.backend.tensorflow.trainer:TFEpochIterator._get_iterator",
            "keras.src.trainers.epoch_iterator:EpochIterator._enumerate_iterator",
        ),
    ),
]
