"""What a TensorFlow worker waits for at start-up, said while it waits.

TensorFlow's coordination service blocks in C++, holding the GIL, until every task has
registered: no Python runs, so neither a progress line nor a SIGTERM/SIGINT handler
can. ``watch_startup`` runs the wait next to a watcher process that, every
``interval`` seconds, prints the peers whose server is not reachable yet (index and
address), and gives SIGTERM/SIGINT their default action (end the process) meanwhile.

Once the coordination service starts (TensorFlow 2.21), its preemption notifier
installs a C++ SIGTERM handler in the worker, which only records the signal. The
watcher shares the worker's process group and ends it on a SIGTERM/SIGINT of its own,
so a signal to the group ends the wait at once: ``tfdist launch`` signals each
worker's group, as do a terminal's Ctrl-C and SLURM. Known limit: a SIGTERM sent to
the worker's pid alone only takes effect when the wait ends
(``TFDIST_REGISTER_TIMEOUT``, 300 s by default); ``kill -TERM -<pgid>`` or SIGINT work.

Example:
    >>> watch_startup(["127.0.0.1:2222", "127.0.0.1:2223"], 0, lambda: None)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

__all__ = ["missing_peers", "missing_workers", "watch_startup"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def missing_peers(addresses: Sequence[str], me: int, timeout: float = 0.5) -> list[int]:
    """Indexes of the peers (not ``me``) whose address accepts no TCP connection yet.

    Example:
        >>> missing_peers(["127.0.0.1:1", "127.0.0.1:1"], 0)  # doctest: +SKIP
        [1]
    """
    missing = []
    for index, address in enumerate(addresses):
        if index == me:
            continue
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                pass
        except (OSError, ValueError):
            missing.append(index)
    return missing


def missing_workers(addresses: Sequence[str], indexes: Sequence[int], job: str = "worker") -> str:
    """``/job:worker/replica:0/task:1 (host:port)``, comma-separated."""
    return ", ".join(f"/job:{job}/replica:0/task:{i} ({addresses[i]})" for i in indexes)


def _end_worker(parent: int, me: int, signum: int) -> None:
    name = signal.Signals(signum).name
    print(
        f"tfdist: worker {me} got {name} while waiting for the other workers; ending it.",
        file=sys.stderr,
        flush=True,
    )
    os.kill(parent, signal.SIGKILL)
    os._exit(0)


def _watch(addresses, me: int, parent: int, interval: float) -> None:
    """The watcher process: a line every ``interval`` s naming the peers not up yet, and
    the end of the worker when a signal byte arrives on stdin (its wakeup fd) or a
    SIGTERM/SIGINT reaches the watcher itself: it shares the worker's process group, so
    a signal to the group (``tfdist launch``, Ctrl-C in a terminal, SLURM's ``scancel``)
    reaches it even while TensorFlow's own SIGTERM handler holds the worker's."""
    for signum in _SIGNALS:
        signal.signal(signum, lambda s, _frame: _end_worker(parent, me, s))
    waited = said = 0.0
    while os.getppid() == parent:  # else the worker is gone
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        if ready:
            got = os.read(sys.stdin.fileno(), 1)
            if got and got[0] in _SIGNALS:
                _end_worker(parent, me, got[0])
            return
        waited += 0.5
        if waited - said < interval:
            continue
        said = waited
        missing = missing_peers(addresses, me)
        if missing:
            print(
                f"tfdist: worker {me} waiting {waited:.0f} s for {missing_workers(addresses, missing)}"
                " to start",
                file=sys.stderr,
                flush=True,
            )


def watch_startup(
    addresses: Sequence[str], me: int, wait: Callable[[], object], interval: float = 10.0
):
    """Runs ``wait()`` (the blocking start-up) with progress lines and prompt signals.

    TensorFlow holds the GIL while it waits, so no Python thread runs: the progress
    lines come from a small watcher process, and SIGTERM/SIGINT get their default
    action (end the process) for the wait, unless the script set its own handler.
    Returns what ``wait`` returns; its exceptions pass through.
    """
    on_main = threading.current_thread() is threading.main_thread()
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = {s: signal.getsignal(s) for s in _SIGNALS} if on_main else {}
    for signum, handler in previous.items():
        if handler in (signal.SIG_DFL, signal.default_int_handler, None):
            # The kernel's default action ends the process at once; a Python handler
            # (even one that only writes the wakeup fd) waits behind the held GIL.
            signal.signal(signum, signal.SIG_DFL)
    old_fd = signal.set_wakeup_fd(write_end) if on_main else None
    watcher = subprocess.Popen(
        [sys.executable, __file__, str(os.getpid()), str(me), str(interval), *addresses],
        stdin=read_end,
    )
    os.close(read_end)
    try:
        return wait()
    finally:
        if old_fd is not None:  # None exactly when not on the main thread
            signal.set_wakeup_fd(old_fd)
        watcher.kill()
        watcher.wait()
        os.close(write_end)
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)


if __name__ == "__main__":  # the watcher process: parent pid, index, interval, addresses
    _watch(sys.argv[4:], int(sys.argv[2]), int(sys.argv[1]), float(sys.argv[3]))
