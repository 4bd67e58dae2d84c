"""A real one-member etcd cluster on 127.0.0.1 for the tests (Debian's ``etcd-server``).

``EtcdServer`` starts ``etcd`` with a data directory of its own on free loopback ports,
waits until it answers its v3 JSON API (at most ``ready_timeout`` seconds, else a clear
error with etcd's output), and kills it at ``close()``. ``endpoint`` is what
``--rdzv-endpoint`` takes. Without the ``etcd`` program the tests that need it skip, and
fail under CI (``CI=true``), whose ``.ci/run`` installs it.

Example::

    with EtcdServer(tmp_path) as etcd:
        subprocess.run(["tfdist", "launch", "--rdzv-backend", "etcd",
                        "--rdzv-endpoint", etcd.endpoint, ...])
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tfdist.launch.environment import free_ports
from tfdist.launch.rendezvous.etcd import Etcd

MISSING = "etcd is not installed (apt-get install etcd-server)"


def require_etcd() -> str:
    """The ``etcd`` program; skips without it (fails under CI, which installs it)."""
    found = shutil.which("etcd")
    if found:
        return found
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI: {MISSING}", pytrace=False)
    pytest.skip(MISSING)


class EtcdServer:
    def __init__(self, where: Path, ready_timeout: float = 60.0):
        program = require_etcd()
        client, peer = free_ports(2)
        self.endpoint = f"127.0.0.1:{client}"
        self.log = where / "etcd.log"
        peer_url = f"http://127.0.0.1:{peer}"
        argv = [
            program, "--name", "test", "--data-dir", str(where / "etcd-data"),
            "--listen-client-urls", f"http://{self.endpoint}",
            "--advertise-client-urls", f"http://{self.endpoint}",
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"test={peer_url}",
        ]  # fmt: skip
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:
        client, deadline = Etcd((self.endpoint,), timeout=2.0), time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                client.call("maintenance/status", {})
                return
            except OSError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError(
            f"etcd did not answer at {self.endpoint} within {timeout:g} s "
            f"(exit {self.proc.returncode}):\n{self.log.read_text(errors='replace')[-3000:]}"
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
