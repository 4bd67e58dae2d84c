"""A real S3 API on 127.0.0.1 for the tests: moto's server, in a process of its own.

``S3Server`` starts ``moto.server.ThreadedMotoServer`` on a free port in a child process
(its port comes back on the child's stdout, so no port is guessed), waits until it
answers HTTP (at most ``ready_timeout`` seconds, else a clear error with the child's
output), and kills the child at ``close()``. ``env()`` is what a job needs to reach it:
fake credentials, a region, and ``AWS_ENDPOINT_URL``, which botocore (>= 1.31) reads
whenever it creates a client, so that s3fs, boto3 and the aws CLI in any child process
go to the server with no change to the user's script. (``FSSPEC_S3_ENDPOINT_URL`` works
too, for fsspec only, and is read once, when fsspec is imported.)

Example::

    with S3Server() as server:
        server.create_bucket("bucket")
        subprocess.run([sys.executable, "job.py", "--dir", "s3://bucket/run"],
                       env={**os.environ, **server.env()})
"""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}

# Straight to the server, whatever proxy the environment names: urllib's default opener
# keeps the proxies of the environment it was first used in, and a test elsewhere in the
# process points them at a closed port (tests/data/test_data.py's failing download): the
# server then "refused" every connection although it listened (seen in CI).
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# The child: moto's threaded server on a port the OS picks, which it prints, then serves
# until its stdin closes (the parent closed it, or died).
_SERVE = """
import logging, sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A bucket on the server: its name, the job environment, an s3fs filesystem on it."""

    name: str
    env: dict[str, str]
    fs: Any

    def url(self, path: str = "") -> str:
        """``s3://name/path``."""
        return f"s3://{self.name}/{path}".rstrip("/")

    def names(self, path: str) -> list[str]:
        """The object names under ``path`` (fresh from the server, no listing cache)."""
        return sorted(p.rsplit("/", 1)[-1] for p in self.fs.ls(f"{self.name}/{path}", refresh=True))


class S3Server:
    """moto's S3 server in a child process; ``close()`` (or the ``with`` block) ends it."""

    def __init__(self, ready_timeout: float = 60.0):
        self._start(ready_timeout)

    def _start(self, ready_timeout: float) -> None:
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            start_new_session=True,
        )
        try:
            port = self._read_port(ready_timeout)
            self.endpoint = f"http://127.0.0.1:{port}"
            self._wait_until_it_answers(ready_timeout)
        except BaseException:
            self.close()
            raise

    def _output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def _read_port(self, timeout: float) -> int:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline().decode().strip() if ready else ""
        if not line.isdigit():
            raise RuntimeError(
                f"moto's S3 server did not start within {timeout:.0f} s (exit code "
                f"{self._proc.poll()}, no port printed: {line!r}); is moto[server] "
                f"installed (`pip install -e '.[test]'`)? Its output:\n{self._output()}"
            )
        return int(line)

    def _wait_until_it_answers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                _DIRECT.open(self.endpoint + "/moto-api/", timeout=5).close()
                return
            except urllib.error.HTTPError:
                return  # an HTTP answer of any status: it serves
            except OSError as err:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"moto's S3 server at {self.endpoint} did not answer within "
                        f"{timeout:.0f} s ({err}; {self._where()}); its output:\n"
                        f"{self._output()}"
                    ) from None
                time.sleep(0.1)

    def _where(self) -> str:
        """The server's network namespace against this thread's, and whether its port
        listens there (from its own /proc/PID/net/tcp)."""
        pid, port = self._proc.pid, self.endpoint.rsplit(":", 1)[1]
        try:
            theirs = os.readlink(f"/proc/{pid}/ns/net")
            ours = os.readlink("/proc/thread-self/ns/net")
            with open(f"/proc/{pid}/net/tcp") as tcp:
                rows = [line.split() for line in tcp.readlines()[1:]]
            listening = any(int(r[1].split(":")[1], 16) == int(port) and r[3] == "0A" for r in rows)
        except OSError as err:
            return f"could not look: {err}"
        return f"its netns {theirs}, this thread's {ours}; port {port} listening there: {listening}"

    def env(self) -> dict[str, str]:
        """The variables a job needs to use ``s3://`` URLs on this server."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def filesystem(self):
        """An s3fs filesystem on this server, for the test's own reads and writes (its
        own instance: fsspec's cache of instances would outlive the server)."""
        import s3fs

        return s3fs.S3FileSystem(
            key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=self.endpoint,
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def create_bucket(self, name: str) -> Bucket:
        fs = self.filesystem()
        fs.mkdir(name)
        return Bucket(name, self.env(), fs)

    def close(self) -> None:
        """Ends the server: stdin closed, then SIGKILL to its process group if it lingers."""
        if self._proc.poll() is None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(10)
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()
        self._log.close()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
