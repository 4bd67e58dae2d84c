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
process group, its exit code (``-N`` for a signal), atexit handlers and non-daemon threads
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
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

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


def _become(request: dict, out_fd: int, err_fd: int, sock: socket.socket) -> None:
    """The forked child takes the job's process group, files, environment and seeds."""
    import atexit as child_atexit
    import posix
    import random

    # The warm process's own exit notes (tests/lean_imports' ledger) are not the job's.
    os._exit = posix._exit
    child_atexit._clear()
    sock.close()
    os.setsid()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    # As in a fresh interpreter: CPython ignores SIGPIPE (a write to a closed pipe raises
    # BrokenPipeError), and a child left at SIG_DFL died of it where a cold job would not.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out_fd, 1), (err_fd, 2)):
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


def _child(request: dict, out_fd: int, err_fd: int, sock: socket.socket) -> None:
    """Runs in the forked child: becomes the job, then exits with its code."""
    import posix
    import traceback

    code = 1
    try:
        _become(request, out_fd, err_fd, sock)
        _run_main(request)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
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


def serve(fd: int) -> None:
    """The warm process: imports, then forks a child per request until its socket closes."""
    import selectors

    import keras  # noqa: F401 - the point: imported once, before any fork
    import numpy  # noqa: F401
    import tensorflow  # noqa: F401

    base_path = list(sys.path[1:])  # without this file's folder
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sock.sendall(b'{"ready": true}\n')
    children: dict[int, int] = {}
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    parent = os.getppid()
    while os.getppid() == parent:  # else the pytest process is gone: end as if it closed
        for key, _ in selector.select(timeout=_PARENT_CHECK_S):
            if key.fileobj is sock:
                msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
                if not msg:
                    for pid in children:
                        _kill_group(pid)
                    return
                request = json.loads(msg)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child({**request, "base_path": base_path}, fds[0], fds[1], sock)
                for fd_ in fds:
                    os.close(fd_)
                children[pid] = request["id"]
                sock.sendall(json.dumps({"id": request["id"], "pid": pid}).encode() + b"\n")
            else:
                os.read(wake_r, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            job = children.pop(pid, None)
            if job is not None:
                message = {"id": job, "returncode": _returncode(status)}
                sock.sendall(json.dumps(message).encode() + b"\n")

    for pid in children:
        _kill_group(pid)


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


class _Server:
    """The test side of one warm process."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()  # the imports' warnings: no pipe to fill
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
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
            self._log.seek(0)
            log = self._log.read().decode(errors="replace")
            raise RuntimeError(f"warm_start: the warm process ended:\n{log[-3000:]}")
        return json.loads(data)

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
            socket.send_fds(self.sock, [request.encode()], [out.fileno(), err.fileno()])
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
    backend = env.get("KERAS_BACKEND", "tensorflow")
    if backend not in _WARM_BACKENDS or backend in _FAILED:
        return None
    with _STARTING:
        server = _SERVERS.get(backend)
        if server is None and backend not in _FAILED:
            try:
                server = _SERVERS[backend] = _Server({**base_env, "KERAS_BACKEND": backend})
            except (OSError, RuntimeError) as err:
                _FAILED.add(backend)
                print(f"warm_start: jobs start cold ({err})", file=sys.stderr)
    if server is None:
        return None
    keys = set(IMPORT_TIME) - {"KERAS_BACKEND"}
    keys |= {k for k in (*env, *server.env) if k.startswith("JAX_")}  # jax reads them at import
    same = all(env.get(k) == server.env.get(k) for k in keys)
    return server if same else None


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
    serve(int(sys.argv[1]))
