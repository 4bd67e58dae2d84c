"""A ``python`` for ``tfdist launch``'s workers in the tests (TFDIST_LAUNCH_PYTHON).

tests/warm_start.py writes it, after a ``#!`` line naming this interpreter, to an
executable in its folder (a ``#!/usr/bin/env`` line would depend on the job's PATH).

It asks the pytest process's warm process (tests/warm_start.py) to fork the job, which
then has the ``-m tfdist.bootstrap ...`` argv, environment, working directory, standard
files and network namespace of this process, and this process stands in for it: signals
sent here go to the job's process group, this process ends with the job's exit code or
signal, and if this process is killed the warm process kills the job. What the job leaves
running in its group is killed when the launcher kills this process's group, as a cold
worker's leftovers are (``_keep_leftovers``). Where no warm
process fits (none started, ``TFDIST_TEST_WARM=0``, an import-time variable that differs)
it becomes the real interpreter (``TFDIST_TEST_PYTHON``): a cold start, as before.
"""

import hashlib
import json
import os
import signal
import socket
import sys
import time

_FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def cold(reason: str):
    if os.environ.get("TFDIST_TEST_WARM_DEBUG"):
        print(f"warm_python: a cold start: {reason}", file=sys.stderr)
    python = os.environ.get("TFDIST_TEST_PYTHON") or "python3"
    os.execv(python, [python, *sys.argv[1:]])


def warm_key(env: dict[str, str]) -> str:
    """Which warm process a job can fork from: its Keras backend and, on JAX, the ``JAX_*``
    variables jax reads at import (the name of its socket in ``TFDIST_TEST_WARM_DIR``;
    tests/warm_start.py names its sockets with this function too).

    Example:
        >>> warm_key({}), warm_key({"KERAS_BACKEND": "tensorflow", "JAX_ENABLE_X64": "1"})
        ('tensorflow', 'tensorflow')
    """
    backend = env.get("KERAS_BACKEND", "tensorflow")
    flags = sorted(f"{k}={v}" for k, v in env.items() if k.startswith("JAX_"))
    if backend != "jax" or not flags:
        return backend
    return f"{backend}-{hashlib.sha1(chr(10).join(flags).encode()).hexdigest()[:12]}"


def _keep_leftovers(conn, pid: int) -> None:
    """A keeper of what the ended job left in its process group (``pid``).

    A cold worker's leftovers share its process group, which the launcher kills when it
    finishes the worker (tfdist/launch/workers.py). A warm job has a group of its own, in
    the warm process's session, which this group cannot hold. So a forked keeper stays in
    this group, holding the connection, while the job's group has members: when the
    launcher's kill ends it, the connection closes and the warm process kills the job's
    group. It leaves by itself once that group is empty.
    """
    try:
        os.killpg(pid, 0)
    except OSError:  # nothing left behind
        return
    if os.fork() != 0:
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the launcher's pipes stay the job's and its leftovers' alone
        os.dup2(devnull, fd)
    while True:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except OSError:
            pass
        time.sleep(0.2)


def connect():
    if os.environ.get("TFDIST_TEST_WARM", "1") == "0" or not os.environ.get("TFDIST_TEST_WARM_DIR"):
        return None
    path = os.path.join(os.environ["TFDIST_TEST_WARM_DIR"], warm_key(os.environ) + ".sock")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    return conn


def main():
    conn = connect()
    if conn is None:
        cold("no warm process")
    pending = []
    job = {}

    def forward(sig, _frame):
        if "pid" in job:
            try:
                os.killpg(job["pid"], sig)
            except OSError:  # not yet its own group leader
                try:
                    os.kill(job["pid"], sig)
                except OSError:
                    pass
        else:
            pending.append(sig)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    namespaces = [os.open(f"/proc/self/ns/{kind}", os.O_RDONLY) for kind in ("user", "net")]
    request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}
    try:
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2, *namespaces])
        reply = json.loads(conn.recv(1 << 16) or b"{}")
    except (OSError, ValueError):  # the warm process ended before forking: the job starts cold
        reply = {}
    for fd in namespaces:
        os.close(fd)
    if "cold" in reply or "pid" not in reply:
        conn.close()
        for sig in _FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        cold(reply.get("cold", "the warm process did not answer"))
    job["pid"] = reply["pid"]
    for sig in pending:
        forward(sig, None)
    try:
        data = conn.recv(1 << 16)
    except OSError:
        data = b""
    if not data:
        print("warm_python: the warm process ended before the job", file=sys.stderr)
        os._exit(1)
    _keep_leftovers(conn, job["pid"])
    _end_as(json.loads(data)["returncode"])


def _end_as(code: int) -> None:
    """Ends this process as the job ended: its exit code, or its signal (``code`` < 0)."""
    if code < 0:  # the job died of a signal: so does this process, for its launcher
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these take no handler
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)
    os._exit(code)


if __name__ == "__main__":  # the stand-in; tests/warm_start.py imports warm_key
    main()
