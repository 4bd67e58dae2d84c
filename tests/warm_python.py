"""A ``python`` for ``tfdist launch``'s workers in the tests (TFDIST_LAUNCH_PYTHON).

tests/warm_start.py writes it, after a ``#!`` line naming this interpreter, to an
executable in its folder (a ``#!/usr/bin/env`` line would depend on the job's PATH).

It asks the pytest process's warm process (tests/warm_start.py) to fork the job, which
then has the ``-m tfdist.bootstrap ...`` argv, environment, working directory, standard
files and network namespace of this process, and this process stands in for it: signals
sent here go to the job's process group, this process ends with the job's exit code or
signal, and if this process is killed the warm process kills the job. Where no warm
process fits (none started, ``TFDIST_TEST_WARM=0``, an import-time variable that differs)
it becomes the real interpreter (``TFDIST_TEST_PYTHON``): a cold start, as before.
"""

import hashlib
import json
import os
import signal
import socket
import sys

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
    code = json.loads(data)["returncode"]
    if code < 0:  # the job died of a signal: so does this process, for its launcher
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these take no handler
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)
    os._exit(code)


if __name__ == "__main__":  # the stand-in; tests/warm_start.py imports warm_key
    main()
