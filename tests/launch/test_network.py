"""Multi-node for real: two "hosts" in network namespaces on a private subnet.

Namespaces ``a`` and ``b`` are the job's hosts (2 workers each) and ``c`` is an outsider
on the same subnet; each has one veth pair whose other end is on a bridge in a fourth
namespace (the "switch"). Only addresses of 10.213.0.0/24 inside these namespaces are
used, and every namespace and process is removed at the end, also on failure. Needs
root and iproute2 (``ip netns``) and nftables (``nft``): CI runs as root; without them
the test fails with a message, it never skips.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import REPO, SCRIPTS, child_env

SUBNET = "10.213.0"
ADDRESS = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2", "c": f"{SUBNET}.3"}
PORT = 23456  # worker i of each host listens on PORT + i (inside the namespaces only)
_IP_TIMEOUT_S = 30

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]


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

    def start(self, host: str, argv: list[str]) -> Output:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[host], *argv],  # execs argv: proc.pid is argv's
            cwd=REPO,
            env=child_env(),
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


def start_job(lab: Lab, progress, *flags: str, epochs: int, step_sleep: float) -> list[Output]:
    """One launcher per host: 2 workers each, ranks 0-1 on a and 2-3 on b."""
    hosts = f"{ADDRESS['a']},{ADDRESS['b']}"
    progress.mkdir(parents=True, exist_ok=True)  # the chief saves its progress there
    job = [str(SCRIPTS / "mw_steps.py"), "--progress", str(progress)]
    job += ["--epochs", str(epochs), "--step-sleep", str(step_sleep)]
    return [
        lab.start(
            host,
            [sys.executable, "-m", "tfdist", "launch", "-n", "2", "--nnodes", "2"]
            + ["--node-rank", str(rank), "--hosts", hosts, "--port", str(PORT), "--allow-remote"]
            + [*flags, *job],
        )
        for rank, host in enumerate(("a", "b"))
    ]


PROBE = """
import json, socket, sys
result = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        result[target] = "open"
    except ConnectionRefusedError:
        result[target] = "refused"
    except OSError as err:
        result[target] = type(err).__name__
print(json.dumps(result))
"""


def probe_from_outsider(lab: Lab) -> dict[str, str]:
    """What the outsider ``c`` gets when it connects to each worker port of a and b."""
    targets = [f"{ADDRESS[h]}:{PORT + i}" for h in ("a", "b") for i in (0, 1)]
    proc = lab.run("c", [sys.executable, "-c", textwrap.dedent(PROBE), *targets])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def results(outputs: list[Output]) -> dict[str, dict]:
    """The JSON line every worker printed, by its prefix ``[wRANK]``."""
    found = {}
    for line in "".join(o.text() for o in outputs).splitlines():
        prefix, _, rest = line.partition(" ")
        if rest.startswith("{"):
            found[prefix] = json.loads(rest)
    return found


def finish_job(outputs: list[Output]) -> None:
    codes = [o.finish(timeout=300) for o in outputs]
    assert codes == [0, 0], "\n".join(o.text()[-3000:] for o in outputs)
    found = results(outputs)
    assert set(found) == {"[w0]", "[w1]", "[w2]", "[w3]"}, found
    for result in found.values():
        assert result["replicas"] == 4
        assert result["diff"] < 1e-5  # the same weights as one device, uninterrupted


def test_two_hosts_train_like_one_device_and_the_firewall_closes_their_ports(lab, tmp_path):
    # Without protection: the job trains, and the outsider reaches every worker port.
    outputs = start_job(lab, tmp_path / "open", epochs=3, step_sleep=0.5)
    outputs[0].wait_for("[w0] EPOCH 1 start", timeout=300)
    assert set(probe_from_outsider(lab).values()) == {"open"}
    finish_job(outputs)
    assert "multi-node job: worker ports 23456, 23457 listen unauthenticated" in outputs[0].text()

    # With the recommended rule applied by each launcher: only the job's hosts get in.
    outputs = start_job(lab, tmp_path / "guarded", "--firewall", "apply", epochs=3, step_sleep=0.5)
    outputs[0].wait_for("[w0] EPOCH 1 start", timeout=300)
    assert set(probe_from_outsider(lab).values()) == {"refused"}
    assert "table inet tfdist_" in lab.run("a", ["nft", "list", "tables"]).stdout
    finish_job(outputs)  # the workers of a and b still reach each other: same weights
    assert "firewall: nftables table inet tfdist_" in outputs[1].text()
    for host in ("a", "b"):  # the launcher removed its rules
        assert "tfdist_" not in lab.run(host, ["nft", "list", "tables"]).stdout


def test_a_lost_host_ends_the_other_within_60_s_naming_it(lab, tmp_path):
    outputs = start_job(lab, tmp_path, epochs=200, step_sleep=0.2)
    outputs[0].wait_for("[w0] EPOCH 1 start", timeout=300)
    lab.kill_host("b")  # launcher and workers 2 and 3 at once
    code = outputs[0].finish(timeout=60)
    out = outputs[0].text()
    assert code != 0, out[-3000:]
    survivors = "\n".join(line for line in out.splitlines() if line.startswith("[w"))
    assert any(f"/job:worker/replica:0/task:{r}" in survivors for r in (2, 3)), out[-4000:]
    assert "tfdist launch: failed: worker w" in out
