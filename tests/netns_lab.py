"""A lab of network namespaces for multi-node tests: hosts ``a``, ``b`` and ``c`` on one
subnet, each with one veth pair whose other end is on a bridge in a fourth namespace (the
"switch"). Only addresses of 10.213.0.0/24 inside these namespaces are used, and every
namespace and process is removed at the end, also on failure. Needs root and iproute2
(``ip netns``) and nftables (``nft``): CI runs as root; without them a test that uses the
``lab`` fixture fails with a message, it never skips.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SUBNET = "10.213.0"
ADDRESS = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2", "c": f"{SUBNET}.3"}
_IP_TIMEOUT_S = 30


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


class Lab:
    """The namespaces, their addresses, and every process started in them."""

    def __init__(self):
        self.ns = {k: f"tfdist{os.getpid()}{k}" for k in ("a", "b", "c", "switch")}
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def build(self) -> None:
        for name in self.ns.values():
            _ip("netns", "add", name)
            self.created.append(name)
        switch = self.ns["switch"]
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host, address in ADDRESS.items():
            ns = self.ns[host]
            _ip(
                "-n",
                switch,
                "link",
                "add",
                f"v{host}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _ip("-n", switch, "link", "set", f"v{host}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def run(self, host: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns[host], *argv],
            capture_output=True,
            text=True,
            timeout=60,
            **kwargs,
        )

    def start(self, host: str, argv: list[str], env: dict | None = None) -> Output:
        from conftest import child_env  # conftest imports this module

        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[host], *argv],  # execs argv: proc.pid is argv's
            cwd=REPO,
            env=child_env() if env is None else env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.procs.append(proc)
        return Output(proc)

    def pids(self, host: str) -> list[int]:
        proc = subprocess.run(
            ["ip", "netns", "pids", self.ns[host]], capture_output=True, text=True, timeout=30
        )
        return [int(pid) for pid in proc.stdout.split()]

    def kill_host(self, host: str) -> None:
        """SIGKILL to every process in ``host``'s namespace (a lost machine)."""
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for host in ("a", "b", "c"):
            if self.ns[host] in self.created:
                self.kill_host(host)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        errors = []
        for name in reversed(self.created):
            try:
                _ip("netns", "del", name)
            except RuntimeError as err:
                errors.append(str(err))
        self.created.clear()
        assert not errors, errors


class Output:
    """A launcher's output, read in a thread, so a test can wait for a line."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.seen, self._queue = proc, [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def text(self) -> str:
        return "".join(self.seen)

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(needle in line for line in self.seen):
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                pytest.fail(f"never saw {needle!r} in {timeout} s:\n{self.text()[-4000:]}")
            self.seen.append(line)

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        while (line := self._queue.get(timeout=10)) is not None:
            self.seen.append(line)
        return code


@pytest.fixture
def lab():
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        pytest.fail(
            "the multi-node test needs root (ip netns add) and iproute2 and nftables; "
            f"euid={os.geteuid()}, missing={missing}. CI runs it as root (.ci/run installs them)."
        )
    built = Lab()
    try:
        try:
            built.build()
        except RuntimeError as err:
            pytest.fail(f"network namespaces are not available: {err}")
        yield built
    finally:
        built.remove()
