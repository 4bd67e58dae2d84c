"""Test jobs forked from a warm interpreter that imported TensorFlow and Keras once.

Each test child used to pay ``import tensorflow, keras`` (6-9 s of CPU on 2 cores) before
its first line. A warm process (one per pytest process and backend) imports them once
and forks a fresh child per job *before any op runs*: TensorFlow creates its context, and
so fixes its devices and collectives, at the first op, in the child, from the child's own
environment (``TFDIST_CPU_DEVICES``, ``TF_CONFIG``, ``TFDIST_COMPAT_EXCLUDE``...). tfdist
itself is not imported by the warm process: each child imports it, after TensorFlow, which
is an order tfdist supports (tests/test_startup.py). A crash stays in its child.

What a child gets, as from ``subprocess.run([sys.executable, ...])``: its argv (a script,
``-m module`` or ``-c code``), environment, working directory, ``sys.path`` (the script's
folder, then ``PYTHONPATH``), stdin from /dev/null, stdout and stderr captured, a fresh
process group, its exit code (``-N`` for a signal), an uncaught exception through
``sys.excepthook`` with ``sys.last_value`` set, atexit handlers and non-daemon threads
joined at the end, and fresh seeds for ``random`` and numpy's global generator.

There is one warm process per Keras backend (``KERAS_BACKEND``: TensorFlow's or JAX's,
which imports jax but starts no jax backend). A job whose environment differs from the
warm one in a variable read at import (``IMPORT_TIME``, and any ``JAX_*``) starts cold, as
before; so do all jobs with ``TFDIST_TEST_WARM=0``. Example::

    from warm_start import run
    proc = run(["-c", "import tfdist; print(tfdist.num_replicas())"], env=env, cwd=REPO,
               timeout=60)
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from warm_python import warm_key  # the socket each warm process listens on

# Read when TensorFlow, Keras or Python start: a job that sets another value starts cold.
IMPORT_TIME = (
    "KERAS_BACKEND",
    "KERAS_HOME",
    "PYTHONHASHSEED",
    "PYTHONPATH",
    "TF_CPP_MIN_LOG_LEVEL",
    "TF_CPP_MAX_VLOG_LEVEL",
    "TF_ENABLE_ONEDNN_OPTS",
    "TFDIST_TEST_FULL_IMPORTS",
    "TF_USE_LEGACY_KERAS",
)
_WARM_BACKENDS = ("tensorflow", "jax")
_START_TIMEOUT_S = 120.0  # importing TensorFlow and Keras on a loaded 2-core machine
_PARENT_CHECK_S = 5.0  # how often the warm process looks for its pytest process


# ------------------------------------------------------------------ the warm process


def _become(request: dict, fds: list[int], sock: socket.socket) -> None:
    """The forked child takes the job's process group, files, environment and seeds.

    ``fds``: its stdout and stderr, or (a job of ``warm_python``) its stdin, stdout and
    stderr, then the network and user namespaces to join."""
    import atexit as child_atexit
    import posix
    import random

    # The warm process's own exit note (tests/lean_imports' ledger) is not the job's; the
    # exit functions its imports registered are, as in a fresh interpreter (jax's
    # clean_up, which shuts its distributed client down in order: without it a chief's
    # exit aborted the other process).
    os._exit = posix._exit
    ledger = sys.modules.get("sitecustomize")
    if getattr(ledger, "_AT_EXIT", None) is not None:
        child_atexit.unregister(ledger._AT_EXIT)  # type: ignore[union-attr]
    sock.close()
    for fd in request.get("close_fds", ()):
        os.close(fd)
    if len(fds) == 2:
        in_fd, out_fd, err_fd = os.open(os.devnull, os.O_RDONLY), fds[0], fds[1]
    else:
        in_fd, out_fd, err_fd = fds[:3]
        _join_namespaces(fds[3:])
    os.setsid()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    # As in a fresh interpreter: CPython ignores SIGPIPE (a write to a closed pipe raises
    # BrokenPipeError), and a child left at SIG_DFL died of it where a cold job would not.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd, target in ((in_fd, 0), (out_fd, 1), (err_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
    random.seed()
    import numpy

    numpy.random.seed()
    if env.get("TFDIST_TEST_LEDGER"):
        import sitecustomize  # tests/lean_imports: the child's own ledger lines

        sitecustomize._ledger(env["TFDIST_TEST_LEDGER"])


def _join_namespaces(fds: list[int]) -> None:
    """Enters the user, then the network namespace ``fds`` name (a launcher's private
    network: ``warm_python`` was started in it), where they are not this process's."""
    import ctypes

    setns = ctypes.CDLL(None, use_errno=True).setns
    for fd, kind, flag in zip(fds, ("user", "net"), (0x10000000, 0x40000000), strict=False):
        if os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino:
            if setns(fd, flag) != 0:
                raise OSError(ctypes.get_errno(), f"setns({kind})")
        os.close(fd)


def _run_main(request: dict) -> None:
    """Runs the job's ``-c code``, ``-m module`` or script as ``__main__``."""
    import builtins
    import runpy
    import types

    argv, env = request["argv"], request["env"]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in request["base_path"] if p not in extra]
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[:] = ["", *extra, *base]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[:] = [request["cwd"], *extra, *base]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[:] = [str(Path(argv[0]).resolve().parent), *extra, *base]
        runpy.run_path(argv[0], run_name="__main__")


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _uncaught(exc: BaseException, traceback) -> None:
    """What CPython does with an exception that ends ``__main__``: ``sys.last_*`` set
    (``last_exc`` from 3.12), then ``sys.excepthook`` (a script's own, or the default
    traceback); atexit handlers run after it, as ``_child`` does next."""
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    try:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    except BaseException:  # a hook that fails: Python prints both, the hook's error first
        traceback.print_exc()
        traceback.print_exception(exc)


def _child(request: dict, fds: list[int], sock: socket.socket) -> None:
    """Runs in the forked child: becomes the job, then exits with its code."""
    import posix
    import traceback

    code = 1
    try:
        _become(request, fds, sock)
        _run_main(request)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:
        _uncaught(exc, traceback)
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            posix._exit(code & 0xFF)


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def import_time_difference(env: dict[str, str], warm_env: dict[str, str]) -> str | None:
    """The first variable read at import (``IMPORT_TIME``; on JAX ``JAX_*`` too) in which a
    job's environment differs from its warm process's, or None: then it can fork from it."""
    keys = set(IMPORT_TIME)
    if env.get("KERAS_BACKEND", "tensorflow") == "jax":
        keys |= {k for k in (*env, *warm_env) if k.startswith("JAX_")}
    defaults = {"KERAS_BACKEND": "tensorflow"}
    return next(
        (
            k
            for k in sorted(keys)
            if env.get(k, defaults.get(k)) != warm_env.get(k, defaults.get(k))
        ),
        None,
    )


class _Warm:
    """The warm process's state: its sockets and the jobs it forked."""

    def __init__(self, fd: int, listen_path: str | None):
        import selectors

        self.base_path = list(sys.path[1:])  # without this file's folder
        self.sock = socket.socket(fileno=fd)
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.listener = None
        if listen_path:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.listener.bind(listen_path)
            self.listener.listen(64)
            self.selector.register(self.listener, selectors.EVENT_READ)
        self.children: dict[int, int | socket.socket] = {}  # pid -> pytest's job id, or shim
        self.shims: dict[socket.socket, int] = {}  # a warm_python connection -> its job (0)
        self.groups: dict[socket.socket, int] = {}  # ... -> its job's process group, to the end

    def fork(self, request: dict, fds: list[int]) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            others = [c.fileno() for c in self.shims]
            others += [self.listener.fileno()] if self.listener else []
            request = {**request, "base_path": self.base_path, "close_fds": others}
            _child(request, fds, self.sock)
        for fd in fds:
            os.close(fd)
        return pid

    def from_pytest(self) -> bool:
        """A job from the pytest process; False when it closed its socket."""
        msg, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, 2)
        if not msg:
            return False
        request = json.loads(msg)
        pid = self.fork(request, fds)
        self.children[pid] = request["id"]
        self.sock.sendall(json.dumps({"id": request["id"], "pid": pid}).encode() + b"\n")
        return True

    def accept(self) -> None:
        import selectors

        assert self.listener is not None
        conn, _ = self.listener.accept()
        self.selector.register(conn, selectors.EVENT_READ)
        self.shims[conn] = 0

    def from_shim(self, conn: socket.socket) -> None:
        """A ``warm_python``'s job, or its end (then its job is killed)."""
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 5)
        except OSError:
            msg, fds = b"", []
        if not msg:
            self.drop(conn)
            return
        request = json.loads(msg)
        differs = import_time_difference(request["env"], dict(os.environ))
        if differs is not None:
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"cold": f"{differs} differs"}).encode())
            return
        pid = self.fork(request, fds)
        self.children[pid] = conn
        self.shims[conn] = self.groups[conn] = pid
        conn.sendall(json.dumps({"pid": pid}).encode())

    def drop(self, conn: socket.socket) -> None:
        """A ``warm_python`` connection that ended (or failed): its job's process group is
        killed, the job if it still runs and, after it ended, what it left there (a cold
        worker's launcher kills those too; warm_python keeps the connection until then)."""
        self.shims.pop(conn, None)
        group = self.groups.pop(conn, 0)
        if group:
            _kill_group(group)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def reap(self) -> None:
        """Reports each ended job's exit code to whoever asked for it."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            job = self.children.pop(pid, None)
            code = _returncode(status)
            if isinstance(job, socket.socket):
                if self.shims.get(job) == pid:
                    self.shims[job] = 0
                    try:
                        job.sendall(json.dumps({"returncode": code}).encode())
                    except OSError:
                        pass
            elif job is not None:
                message = {"id": job, "returncode": code}
                self.sock.sendall(json.dumps(message).encode() + b"\n")

    def kill_all(self) -> None:
        for pid in self.children:
            _kill_group(pid)


def serve(fd: int, listen_path: str | None = None) -> None:
    """The warm process: imports, then forks a child per request until its socket closes.

    Requests come from the pytest process (``fd``) and, when ``listen_path`` is given, from
    ``warm_python`` processes (one connection each: the job's files and namespaces, its pid
    back, then its exit code; a connection closed first kills the job).
    """
    import keras  # noqa: F401 - the point: imported once, before any fork
    import numpy  # noqa: F401
    import tensorflow  # noqa: F401

    warm = _Warm(fd, listen_path)
    warm.sock.sendall(b'{"ready": true}\n')
    parent = os.getppid()
    while os.getppid() == parent:  # else the pytest process is gone: end as if it closed
        for key, _ in warm.selector.select(timeout=_PARENT_CHECK_S):
            if key.fileobj is warm.sock:
                if not warm.from_pytest():
                    warm.kill_all()
                    return
                continue
            try:
                if key.fileobj is warm.listener:
                    warm.accept()
                elif isinstance(key.fileobj, socket.socket):
                    warm.from_shim(key.fileobj)
                else:
                    os.read(warm.wake_r, 4096)
            except Exception:  # one stand-in's failure must not end every later job's parent
                traceback.print_exc()  # into the warm process's log
                if isinstance(key.fileobj, socket.socket) and key.fileobj in warm.shims:
                    warm.drop(key.fileobj)
        warm.reap()
    warm.kill_all()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


# ------------------------------------------------------------------ the test side


class WarmProcess:
    """A job forked by the warm process: ``pid``, ``wait``, ``kill``, ``communicate``
    (what ``subprocess.Popen`` offers the tests), its output in temporary files."""

    def __init__(self, server: _Server, job: int, pid: int, out, err, text: bool):
        self._server, self._job, self.pid = server, job, pid
        self._out, self._err, self._text = out, err, text
        self.returncode: int | None = None
        self.args = ["<warm>"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self._job, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._server.returncode(self._job, timeout=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = code
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            _kill_group(self.pid)

    def terminate(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except OSError:
                pass

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def _read(self, file):
        file.seek(0)
        data = file.read()
        file.close()
        return data.decode(errors="replace") if self._text else data

    def communicate(self, timeout: float | None = None):
        self.wait(timeout)
        return self._read(self._out), self._read(self._err)


# Where this pytest process's warm processes listen for ``warm_python`` (tests/warm_python:
# ``tfdist launch``'s workers, TFDIST_LAUNCH_PYTHON): one socket per backend.
WARM_DIR = tempfile.mkdtemp(prefix="tfdist-warm-")
atexit.register(shutil.rmtree, WARM_DIR, True)
# What a test child needs to start launch workers warm (conftest puts it on os.environ).
_SHIM = Path(WARM_DIR) / "python"
_SHIM.write_text(
    f"#!{sys.executable} -IS\n" + (Path(__file__).resolve().parent / "warm_python.py").read_text()
)
_SHIM.chmod(0o755)
LAUNCH_ENV = {
    "TFDIST_LAUNCH_PYTHON": str(_SHIM),
    "TFDIST_TEST_WARM_DIR": WARM_DIR,
    "TFDIST_TEST_PYTHON": sys.executable,
}


class _Server:
    """The test side of one warm process."""

    def __init__(self, env: dict[str, str], *, listen: bool = False):
        """``listen``: also serve ``warm_python`` (one warm process per backend does)."""
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()  # the imports' warnings: no pipe to fill
        path = os.path.join(WARM_DIR, warm_key(env) + ".sock")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno()), *([path] if listen else [])],
            env=self.env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
        )
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()
        self._next = 0
        self._pids: dict[int, int] = {}
        self._codes: dict[int, int] = {}
        self._buffer = b""
        message = self._receive(_START_TIMEOUT_S)
        if message != {"ready": True}:
            self.close()
            raise RuntimeError(f"warm_start: the warm process did not start: {message!r}")

    def _receive(self, timeout: float | None) -> dict | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 16)
        except (TimeoutError, BlockingIOError):
            return None
        if not data:
            raise RuntimeError(f"warm_start: the warm process ended:\n{self.log()}")
        return json.loads(data)

    def log(self) -> str:
        """The end of what the warm process printed (its imports' warnings, a crash)."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def _dispatch(self, message: dict) -> None:
        if "pid" in message:
            self._pids[message["id"]] = message["pid"]
        elif "returncode" in message:
            self._codes[message["id"]] = message["returncode"]

    def start(self, argv: list[str], env: dict[str, str], cwd: str, text: bool) -> WarmProcess:
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        with self._lock:
            self._next += 1
            job = self._next
            request = json.dumps({"id": job, "argv": argv, "env": env, "cwd": str(cwd)})
            try:
                socket.send_fds(self.sock, [request.encode()], [out.fileno(), err.fileno()])
            except OSError as error:
                raise RuntimeError(f"warm_start: the warm process ended:\n{self.log()}") from error
            while job not in self._pids:
                message = self._receive(_START_TIMEOUT_S)
                if message is None:
                    raise RuntimeError("warm_start: the warm process did not fork in time")
                self._dispatch(message)
        return WarmProcess(self, job, self._pids.pop(job), out, err, text)

    def returncode(self, job: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while job not in self._codes:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                message = self._receive(left if left is None or left > 0 else 0.0001)
                if message is None:
                    return None
                self._dispatch(message)
            return self._codes.pop(job)

    def close(self) -> None:
        self.sock.close()  # the warm process kills its children and ends
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_SERVERS: dict[str, _Server] = {}
_FAILED: set[str] = set()
_STARTING = threading.Lock()  # jobs started from several threads share one warm process


def _server_for(env: dict[str, str], base_env: dict[str, str]) -> _Server | None:
    """The warm process this job can fork from (started on first use), or None."""
    if os.environ.get("TFDIST_TEST_WARM", "1") == "0":
        return None
    backend, key = env.get("KERAS_BACKEND", "tensorflow"), warm_key(env)
    if backend not in _WARM_BACKENDS or key in _FAILED:
        return None
    with _STARTING:
        server = _SERVERS.get(key)
        if server is not None and server.proc.poll() is not None:
            # It ended (a crash is in its log): one failed job, not every later one.
            print(
                f"warm_start: a warm process ended; starting another\n{server.log()}",
                file=sys.stderr,
            )
            server = _SERVERS.pop(key)
            server.close()
            server = None
        if server is None and key not in _FAILED:
            jax_flags = {k: v for k, v in env.items() if k.startswith("JAX_")}
            warm_env = {**base_env, "KERAS_BACKEND": backend}
            if backend == "jax":
                warm_env = {k: v for k, v in warm_env.items() if not k.startswith("JAX_")}
                warm_env.update(jax_flags)
            try:
                server = _SERVERS[key] = _Server(warm_env, listen=True)
            except (OSError, RuntimeError) as err:
                _FAILED.add(key)
                print(f"warm_start: jobs start cold ({err})", file=sys.stderr)
    if server is None or import_time_difference(env, server.env) is not None:
        return None
    return server


def prepare(env: dict[str, str], base_env: dict[str, str]) -> None:
    """Starts the warm process a job with ``env`` would use, for the ``tfdist launch``
    workers it starts (``warm_python``); they start cold where there is none."""
    _server_for(env, base_env)


def popen(argv: list[str], *, env: dict[str, str], base_env: dict[str, str], cwd, text=True):
    """A warm ``WarmProcess`` for ``python *argv``, or a cold ``subprocess.Popen``."""
    server = _server_for(env, base_env)
    if server is not None:
        return server.start(argv, env, str(cwd), text)
    return subprocess.Popen(
        [sys.executable, *argv],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=text,
    )


def run(argv: list[str], *, env, base_env, cwd, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True)``, warm
    where it can be; the job's process group is killed on timeout."""
    proc = popen(argv, env=env, base_env=base_env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        if isinstance(proc, WarmProcess):
            proc.wait(30)
        else:
            proc.communicate()
        raise
    return subprocess.CompletedProcess([sys.executable, *argv], proc.returncode, out, err)


@atexit.register
def _close_all() -> None:
    for server in _SERVERS.values():
        server.close()
    _SERVERS.clear()


if __name__ == "__main__":
    # Ends with the pytest process that started it, however that one ends: its end of the
    # socket closes (serve returns), and a pytest process gone any other way leaves this
    # one reparented (serve's select wakes every few seconds to see). Not PR_SET_PDEATHSIG:
    # that fires when the *thread* that started this process ends, and jobs start from
    # thread pools too (tests/e2e/test_checks_catch_faults.py): the pool's end killed the
    # warm process under the next test's job (a BrokenPipeError in CI).
    serve(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
