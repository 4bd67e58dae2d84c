"""A private network namespace for one node's workers, with a user-mode network stack for
their outbound connections (``tfdist.launch.network`` says when a job gets one).

The launcher stays in this host's namespace; each worker joins the namespace between fork
and exec (``PrivateNetwork.enter``). A short holder process creates the namespace (as
root a network namespace alone, otherwise inside a user namespace) and keeps it while
the launcher opens it. ``pasta`` (from passt) or else ``slirp4netns`` attaches to it and
carries the workers' outbound connections out through this host's sockets; no port is
forwarded in. Where namespaces are not available, ``PrivateNetwork.create`` raises
``NamespaceUnavailable``.

Example:
    >>> net = PrivateNetwork.create(egress=False)  # doctest: +SKIP
    >>> net.egress is None                          # doctest: +SKIP
    True
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile

__all__ = ["STACKS", "NamespaceUnavailable", "PrivateNetwork"]

logger = logging.getLogger(__name__)


CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_NAMESPACE_TIMEOUT_S = 10.0  # the holder process creating the namespace answering
_STACK_TIMEOUT_S = 10.0  # the user-mode network stack saying it is ready (or exiting)
_STACK_STOP_S = 5.0  # the stack exiting after its cue, then again after SIGKILL
STACKS = ("pasta", "slirp4netns")  # the user-mode network stacks, preferred first

# Run by `python -I -S -c` (no site: starts in milliseconds): creates the namespaces,
# maps this user into the user namespace (unprivileged case), brings loopback up, says
# "ready" and holds the namespaces until its stdin closes, while the launcher opens them.
_HOLDER = r"""
import ctypes, fcntl, os, socket, struct, sys
flags = int(sys.argv[1])
uid, gid = os.getuid(), os.getgid()
try:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    if flags & 0x10000000:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0))  # SIOCGIFFLAGS
        up = struct.unpack("16sH22x", req)[1] | 1  # IFF_UP
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", up))  # SIOCSIFFLAGS
except Exception as err:
    print("error", err, flush=True)
    sys.exit(1)
print("ready", flush=True)
sys.stdin.read()
"""


class NamespaceUnavailable(OSError):
    """This system does not let the launcher create a private network namespace."""


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def _attempts() -> list[int]:
    # root can make a network namespace alone; otherwise (or where root lacks
    # CAP_SYS_ADMIN, e.g. in a container) a user namespace grants the right to.
    both = CLONE_NEWUSER | CLONE_NEWNET
    return [CLONE_NEWNET, both] if os.geteuid() == 0 else [both]


def _hold(flags: int, timeout: float) -> tuple[subprocess.Popen, str]:
    """Starts a holder with ``flags``; returns it and its first line (``ready``/``error``)."""
    holder = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _HOLDER, str(flags)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert holder.stdout is not None  # stdout=PIPE above
    ready, _, _ = select.select([holder.stdout], [], [], timeout)
    line = holder.stdout.readline().strip() if ready else ""
    return holder, line or f"error: no answer within {timeout:.0f} s"


def _release(holder: subprocess.Popen) -> None:
    # A holder from _hold: its stdin and stdout are pipes.
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.close()  # the holder's cue to exit
    try:
        holder.wait(timeout=_NAMESPACE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait(timeout=_NAMESPACE_TIMEOUT_S)
    holder.stdout.close()


def _fd_path(fd: int) -> str:
    # The namespaces outlive their holder only through this launcher's fds; a stack
    # inherits them (pass_fds) and opens the namespace by this path in its own /proc.
    # No process has to stay alive in the namespace for it.
    return f"/proc/self/fd/{fd}"


def _pasta_argv(exe: str, net_fd: int, user_fd: int | None, ready_fd: int, log_fd: int):
    """pasta (passt's namespace mode) attached to the namespace, outbound only (man pasta)."""
    argv = [
        exe,
        "--foreground",  # stays our child: stopped by close, dies with the launcher
        "--quiet",
        "--config-net",  # addresses and default route in the namespace, as on this host
        # pasta's default for each is auto: -t/-u bind every port a worker listens on to
        # this host's addresses (checked every second), -T/-U bind this host's ports in
        # the namespace. None: no port of the job reachable from outside, outbound only.
        *("--tcp-ports", "none", "--udp-ports", "none", "--tcp-ns", "none", "--udp-ns", "none"),
        # Stay this user. Started as root pasta switches to nobody, who cannot join the
        # namespace (passt 2023-03: "Couldn't switch to pasta namespaces"), and a change
        # of user clears the parent-death signal.
        *("--runas", f"{os.geteuid()}:{os.getegid()}"),
        *("--pid", _fd_path(ready_fd)),  # written once set up: the ready signal
        *("--log-file", _fd_path(log_fd)),
        # Its quit-on-delete watches a netns file's directory; a /proc/self/fd path is
        # never deleted: close (or the launcher's death) ends it.
        "--no-netns-quit",
        *("--netns", _fd_path(net_fd)),
    ]
    return argv + (["--userns", _fd_path(user_fd)] if user_fd is not None else [])


def _slirp4netns_argv(exe: str, net_fd: int, user_fd: int | None, ready_fd: int, exit_fd: int):
    """slirp4netns attached to the namespace, outbound only (man slirp4netns).

    No ``--api-socket``: its ``add_hostfwd`` is slirp4netns's only way to forward a port
    in. Host loopback stays on (10.0.2.2 is this host's 127.0.0.1, as pasta's gateway).
    """
    argv = [exe, "--configure", "--mtu=65520", f"--ready-fd={ready_fd}"]
    argv += [f"--exit-fd={exit_fd}", "--enable-seccomp", "--netns-type=path"]
    if user_fd is None:  # root: the sandbox drops its capabilities
        argv.append("--enable-sandbox")
    else:  # no capabilities to drop; its setegid(0) fails in a namespace mapping this user
        argv.append(f"--userns-path={_fd_path(user_fd)}")
    return argv + [_fd_path(net_fd), "tap0"]


def _die_with_launcher() -> None:  # pragma: no cover - runs in the child between fork and exec
    # SIGKILL when the launcher dies, even by SIGKILL: a stack never outlives its job.
    # Kept through exec; both stacks keep this user (see _pasta_argv), which keeps it.
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Stack:
    """A running user-mode network stack of a private network (``pasta``, ``slirp4netns``)."""

    def __init__(self, name: str, proc: subprocess.Popen, log, exit_fd: int | None):
        self.name, self.proc, self.log = name, proc, log
        self._exit_fd = exit_fd  # slirp4netns --exit-fd: closing our end ends it

    @classmethod
    def start(cls, name: str, exe: str, net_fd: int, user_fd: int | None, timeout: float):
        """Starts ``name`` attached to the namespace; returns once it is ready.

        Raises:
            OSError: it could not start, exited, or was not ready within ``timeout``.
        """
        log = tempfile.TemporaryFile()  # its messages, for the reason it failed
        ready_r, ready_w = os.pipe()
        exit_r, exit_w = os.pipe() if name == "slirp4netns" else (None, None)
        try:
            if exit_r is None:  # pasta: no exit pipe
                argv = _pasta_argv(exe, net_fd, user_fd, ready_w, log.fileno())
            else:
                argv = _slirp4netns_argv(exe, net_fd, user_fd, ready_w, exit_r)
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=[
                    f for f in (net_fd, user_fd, ready_w, exit_r, log.fileno()) if f is not None
                ],
                # Its own session: a Ctrl-C meant for the launcher must not end egress
                # while the workers still save; the launcher stops it after them.
                start_new_session=True,
                preexec_fn=_die_with_launcher,
            )
        except (OSError, subprocess.SubprocessError) as err:
            for fd in (ready_r, exit_w):
                if fd is not None:
                    os.close(fd)
            log.close()
            raise OSError(f"{name} did not start: {err}") from err
        finally:
            for fd in (ready_w, exit_r):
                if fd is not None:
                    os.close(fd)
        stack = cls(name, proc, log, exit_w)
        try:  # pasta writes its pid, slirp4netns "1"; EOF: it exited first
            ready, _, _ = select.select([ready_r], [], [], timeout)
            said = os.read(ready_r, 64).strip() if ready else b""
        finally:
            os.close(ready_r)
        if said:
            return stack
        why = "exited" if ready else f"was not ready within {timeout:.0f} s"
        code = stack.stop()
        why += f" (exit status {code})" if code is not None and code >= 0 else ""
        last = stack.last_words()
        raise OSError(f"{name} {why}{': ' + last if last else ''}")

    def last_words(self) -> str:
        """The last line it logged (syslog complaints left out), or ""."""
        try:
            self.log.seek(0)
            lines = self.log.read().decode(errors="replace").splitlines()
        except (OSError, ValueError):  # closed
            return ""
        said = [line.strip() for line in lines if line.strip() and "syslog" not in line]
        return said[-1] if said else ""

    def stop(self) -> int | None:
        """Ends it (its cue, SIGTERM, then SIGKILL); returns its exit status."""
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None
        if self.proc.poll() is None:
            self.proc.terminate()
        for last_try in (False, True):
            try:
                return self.proc.wait(timeout=_STACK_STOP_S)
            except subprocess.TimeoutExpired:
                if last_try:
                    logger.error("%s (pid %d) did not exit after SIGKILL", self.name, self.proc.pid)
                    return None
                self.proc.kill()
        return None

    def close(self) -> None:
        self.stop()
        self.log.close()


class PrivateNetwork:
    """A new network namespace for workers to join (a context): its own loopback, and
    with a stack (``egress``) outbound connections through it.

    The namespaces live as long as this object holds them open (``close``) or a worker
    is inside; the stack until ``close`` or this process's end.

    Example:
        >>> with PrivateNetwork.create(egress=True) as net:  # doctest: +SKIP
        ...     subprocess.run(["ip", "route"], preexec_fn=net.enter)
    """

    def __init__(self, net_fd: int, user_fd: int | None):
        # Both None once closed (close).
        self.net_fd: int | None = net_fd
        self.user_fd: int | None = user_fd
        self.stack: _Stack | None = None  # started by start_egress
        self.no_egress = "not asked for"  # why there is no stack, for the log line

    @property
    def egress(self) -> str | None:
        """The stack carrying the workers' outbound connections (``pasta``, ...), or None."""
        return self.stack.name if self.stack is not None else None

    @classmethod
    def create(
        cls, timeout: float = _NAMESPACE_TIMEOUT_S, *, egress: bool = False
    ) -> PrivateNetwork:
        """Creates the namespaces (in a short-lived holder process): loopback only, or
        with ``egress`` (``tfdist launch``'s default) the first stack of ``STACKS`` that
        starts attached (``start_egress``).

        Raises:
            NamespaceUnavailable: not Linux, or the kernel refused (the reason is named).
        """
        if _LIBC is None:
            raise NamespaceUnavailable("network namespaces need Linux")
        reasons = []
        for flags in _attempts():
            holder, line = _hold(flags, timeout)
            try:
                if line == "ready":
                    user = CLONE_NEWUSER & flags
                    net_fd = os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                    path = f"/proc/{holder.pid}/ns/user"
                    user_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if user else None
                    network = cls(net_fd, user_fd)
                    break
                reasons.append(line.removeprefix("error").strip(" :"))
            finally:
                _release(holder)
        else:
            raise NamespaceUnavailable(f"unshare(CLONE_NEWNET) failed: {'; '.join(reasons)}")
        if egress:
            try:
                network.start_egress()
            except BaseException:
                network.close()
                raise
        return network

    def start_egress(self, timeout: float = _STACK_TIMEOUT_S) -> None:
        """Attaches the first of ``STACKS`` on PATH that starts; where none does the
        namespace keeps its loopback only and ``no_egress`` says why."""
        failed = []
        if self.net_fd is None:
            raise RuntimeError("private network: start_egress after close()")
        for name in STACKS:
            exe = shutil.which(name)
            if exe is None:
                continue
            try:
                self.stack = _Stack.start(name, exe, self.net_fd, self.user_fd, timeout)
                return
            except OSError as err:
                logger.debug("private network: %s did not start: %s", name, err)
                failed.append(str(err))
        self.no_egress = "; ".join(failed) or f"neither {' nor '.join(STACKS)} is on PATH"

    def enter(self) -> None:  # pragma: no cover - runs in the child between fork and exec
        """Moves the calling (single-threaded, just forked) process into the namespace."""
        for fd, kind in ((self.user_fd, CLONE_NEWUSER), (self.net_fd, CLONE_NEWNET)):
            if fd is not None and _LIBC.setns(fd, kind) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns: {os.strerror(err)}")

    def close(self) -> None:
        """Stops the stack; lets the namespaces go once no worker is inside."""
        if self.stack is not None:
            self.stack.close()
            self.stack = None
        for fd in (self.net_fd, self.user_fd):
            if fd is not None:
                os.close(fd)
        self.net_fd = self.user_fd = None

    def __enter__(self) -> PrivateNetwork:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
