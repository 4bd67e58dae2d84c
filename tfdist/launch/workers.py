"""The mechanism under the supervisor: start, signal and reap worker processes.

Each worker runs in its own process group with its output copied, line by line and
prefixed ``[wRANK] ``, to the launcher's streams; it gets SIGKILL if the launcher dies.
It may first enter a network (``enter``, e.g. ``PrivateNetwork.enter``) between fork
and exec, so the launcher itself stays where it is.
``LauncherSignals`` records the SIGINT/SIGTERM the launcher receives. Policy (when to
stop or restart) lives in ``tfdist.launch.supervise``.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from tfdist.core import quiet

__all__ = ["Worker", "Route", "LauncherSignals", "prefix_lines"]

logger = logging.getLogger(__name__)

_READER_JOIN_S = 5.0  # output still buffered in a pipe after its worker exited
# A reader blocked writing to the launcher's own stdout waits for whoever reads it (a pipe
# read late, a slow terminal) up to this long, so that no worker's last lines are cut.
_SLOW_READER_S = 600.0
_KILL_WAIT_S = 10.0  # a SIGKILLed process is gone long before this


class Worker:
    """One worker process, its output prefixer threads and how to stop it."""

    def __init__(
        self,
        rank: int,
        command: list[str],
        env: dict[str, str],
        out: TextIO,
        err: TextIO,
        lock: threading.Lock,
        enter: Callable[[], None] | None = None,
        route: Route | None = None,
    ):
        self.rank = rank
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Own process group: signals reach the worker and its children, and a
            # Ctrl-C in the terminal reaches the launcher only, which forwards it.
            start_new_session=True,
            preexec_fn=functools.partial(_setup_child, enter),
        )
        route = route or Route()
        self.writing = [threading.Event(), threading.Event()]  # a reader is passing lines on
        self.readers = [
            threading.Thread(
                target=prefix_lines,
                args=(pipe, stream, f"[w{rank}] ", lock),
                kwargs={"route": route, "writing": writing},
                daemon=True,
            )
            for pipe, stream, writing in (
                (self.proc.stdout, out, self.writing[0]),
                (self.proc.stderr, err, self.writing[1]),
            )
        ]
        for reader in self.readers:
            reader.start()

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        return self.proc.poll()

    def signal(self, sig: int, *, only_if_running: bool = True) -> None:
        """Sends ``sig`` to the worker's whole process group."""
        if only_if_running and self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):  # the whole group is gone
            pass

    def finish(self) -> None:
        """Kills what is left of the worker's process group, reaps it, drains its output.

        The group outlives the worker when the script started processes of its own;
        its id cannot be reused while any of them lives, so this kills only those.
        """
        self.signal(signal.SIGKILL, only_if_running=False)
        try:
            self.proc.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.error("worker w%d (pid %d) did not die after SIGKILL", self.rank, self.proc.pid)
        for reader, writing in zip(self.readers, self.writing, strict=True):
            reader.join(timeout=_READER_JOIN_S)
            # Still reading after that: a process the script started holds the pipe, and
            # its output is given up. Still writing: the launcher's stdout is read slowly,
            # and every line the worker wrote is passed on.
            deadline = time.monotonic() + _SLOW_READER_S
            while reader.is_alive() and writing.is_set() and time.monotonic() < deadline:
                reader.join(timeout=_READER_JOIN_S)
            if reader.is_alive() and writing.is_set():
                logger.warning(
                    "worker w%d: the rest of its output is dropped: this launcher's output "
                    "was not read for %.0f s",
                    self.rank,
                    _SLOW_READER_S,
                )


def _setup_child(enter) -> None:  # pragma: no cover - runs in the child between fork and exec
    if enter is not None:
        enter()
    # If the launcher is killed (even with SIGKILL) its workers get SIGKILL too, instead
    # of training on as orphans holding their ports. Set after ``enter``: joining a user
    # namespace changes credentials, which clears the parent-death signal.
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _split_ready(pending: bytes, at_end: bool) -> tuple[list[bytes], bytes]:
    """Complete lines and redraws of ``pending``, and the rest to wait for."""
    # Hold back a trailing "\r": it may be the first half of "\r\n".
    cut = len(pending) - 1 if not at_end and pending.endswith(b"\r") else len(pending)
    ready, rest = pending[:cut], pending[cut:]
    pieces = ready.replace(b"\r\n", b"\n").splitlines(keepends=True)
    if pieces and not pieces[-1].endswith((b"\n", b"\r")):
        if at_end:
            pieces[-1] += b"\n"  # the worker's last line had no newline
        else:
            rest = pieces.pop() + rest  # incomplete: wait for the rest
    return pieces, rest


@dataclass(frozen=True)
class Route:
    """Where a worker's output goes besides its console stream, and what is dropped.

    Attributes:
        console: copy lines to the launcher's stream (False: ``--log-dir`` without
            ``--tee``).
        log: a text file that gets every line, unfiltered (``--log-dir``).
        verbose: False drops the lines ``tfdist.core.quiet.is_harmless`` knows from the
            console (never from the log file).
        redraws: forward progress-bar redraws (lines ending in ``\\r``) to the console.
            None: only when the stream is a terminal; elsewhere (a pipe, a file, CI logs)
            only each line's final state is written, like Keras' ``verbose=2``.
    """

    console: bool = True
    log: TextIO | None = None
    verbose: bool = True
    redraws: bool | None = None


def _console_text(pieces: list[str], prefix: str, route: Route, redraws: bool, state: dict) -> str:
    kept = []
    for piece in pieces:
        # Python prints a warning as two lines: the message, then its source line
        # (indented); the source line of a dropped warning goes with it.
        follows_dropped = state.pop("dropped_warning", False) and piece.startswith("  ")
        if piece.endswith("\r") and not redraws:
            continue
        if not route.verbose and (follows_dropped or quiet.is_harmless(piece)):
            state["dropped_warning"] = "Warning: " in piece
            continue
        kept.append(prefix + (piece if redraws else piece.replace("\b", "")))
    return "".join(kept)


def _log_text(pieces: list[str]) -> str:
    return "".join(p.replace("\b", "") for p in pieces if not p.endswith("\r"))


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def prefix_lines(
    pipe,
    stream: TextIO,
    prefix: str,
    lock: threading.Lock,
    *,
    route: Route | None = None,
    writing: threading.Event | None = None,
) -> None:
    """Copies ``pipe`` to ``stream``, starting every line with ``prefix``.

    Progress bars redraw a line with ``\\r``; on a terminal each redraw keeps its
    ``\\r`` and gets the prefix too, so it shows one live ``[w0] ...`` bar. Output is
    forwarded as soon as a line or redraw is complete, not only at newlines. ``route``
    adds a log file and the quiet filter (see ``Route``). ``writing`` is set while lines
    wait for ``stream`` (whose reader may be slow), clear while waiting for ``pipe``.
    """
    route = route or Route()
    redraws = _is_terminal(stream) if route.redraws is None else route.redraws
    fd = pipe.fileno()
    pending = b""
    state: dict = {}  # carried from one chunk to the next
    with pipe:
        while True:
            chunk = os.read(fd, 65536)
            ready, pending = _split_ready(pending + chunk, at_end=not chunk)
            pieces = [p.decode("utf-8", errors="replace") for p in ready]
            text = _console_text(pieces, prefix, route, redraws, state) if route.console else ""
            logged = _log_text(pieces) if route.log is not None else ""
            if text or logged:
                if writing is not None:
                    writing.set()
                with lock:
                    _write(stream, text)
                    _write(route.log, logged)
                if writing is not None:
                    writing.clear()
            if not chunk:
                return


def _write(stream: TextIO | None, text: str) -> None:
    if text and stream is not None:
        stream.write(text)
        stream.flush()


class LauncherSignals:
    """Records SIGINT/SIGTERM sent to the launcher while the workers run (a context).

    Handlers are only installed from the main thread; elsewhere nothing is recorded.
    """

    def __init__(self) -> None:
        self.received: int | None = None  # the last signal
        self.count = 0
        self._previous: dict[int, Any] = {}  # signal -> the handler it had

    def __enter__(self) -> LauncherSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame):
        self.received = signum
        self.count += 1

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
