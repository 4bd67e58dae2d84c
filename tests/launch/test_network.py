"""Networks for real: multi-node across network namespaces, and the egress of the
single-node private network.

Multi-node: namespaces ``a`` and ``b`` are the job's hosts (2 workers each) and ``c`` is
an outsider on the same subnet; each has one veth pair whose other end is on a bridge in
a fourth namespace (the "switch"). Only addresses of 10.213.0.0/24 inside these
namespaces are used, and every namespace and process is removed at the end, also on
failure. Needs root and iproute2 (``ip netns``) and nftables (``nft``): CI runs as root;
without them the test fails with a message, it never skips.

Egress: a default ``tfdist launch -n 2`` of a plain script, its private network attached
to pasta or slirp4netns (the launcher's PATH holds only the tools under test: pasta
beside slirp4netns, slirp4netns alone, or none). The workers connect to a server this test runs on the host's 127.0.0.1, through the
namespace's default gateway (which both tools map to the host's loopback); the host
connects to the workers' ports and is refused. No other address is contacted. Needs
pasta and slirp4netns (``apt-get install passt slirp4netns``, as .ci/run does); without
them the test fails with a message, it never skips.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from netns_lab import ADDRESS, Lab, Output

from tfdist import cli
from tfdist.cli import launch as launch_command
from tfdist.core.config import ConfigError
from tfdist.launch import network
from tfdist.launch.options import LaunchOptions

from conftest import REPO, SCRIPTS, child_env

PORT = 23456  # worker i of each host listens on PORT + i (inside the namespaces only)

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]


def start_job(lab: Lab, progress, *flags: str, epochs: int, step_sleep: float = 0.0,
              hold: str = "") -> list[Output]:  # fmt: skip
    """One launcher per host: 2 workers each, ranks 0-1 on a and 2-3 on b. ``hold``: a
    file the workers wait for at the start of epoch 1 (mw_steps.py ``--hold``)."""
    hosts = f"{ADDRESS['a']},{ADDRESS['b']}"
    progress.mkdir(parents=True, exist_ok=True)  # the chief saves its progress there
    job = [str(SCRIPTS / "mw_steps.py"), "--progress", str(progress)]
    job += ["--epochs", str(epochs), "--step-sleep", str(step_sleep), "--hold", hold]
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


def while_held(outputs: list[Output], hold, look):
    """``look()`` once the job trained an epoch, while its workers wait for ``hold``."""
    try:
        outputs[0].wait_for("[w0] EPOCH 1 start", timeout=300)
        return look()
    finally:
        hold.touch()  # the job trains on


def test_two_hosts_train_like_one_device_and_the_firewall_closes_their_ports(lab, tmp_path):
    # Without protection: the job trains, and the outsider reaches every worker port.
    hold = tmp_path / "probed-open"
    outputs = start_job(lab, tmp_path / "open", epochs=3, hold=str(hold))
    assert set(while_held(outputs, hold, lambda: probe_from_outsider(lab)).values()) == {"open"}
    finish_job(outputs)
    assert "multi-node job: worker ports 23456, 23457 listen unauthenticated" in outputs[0].text()

    # With the recommended rule applied by each launcher: only the job's hosts get in.
    hold = tmp_path / "probed-guarded"
    outputs = start_job(lab, tmp_path / "guarded", "--firewall", "apply", epochs=3, hold=str(hold))
    probe, tables = while_held(outputs, hold, lambda: (
        probe_from_outsider(lab), lab.run("a", ["nft", "list", "tables"]).stdout))  # fmt: skip
    assert set(probe.values()) == {"refused"}
    assert "table inet tfdist_" in tables
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


# ------------------------------------------------------------------ egress of the private network

# A plain worker: its interfaces and default gateway; with a port argument, one line to
# the host's server at that port on the gateway (the stacks map it to the host's loopback).
ROUND_TRIP = """
import json, os, socket, struct, sys
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
with open("/proc/net/route") as routes:
    rows = [line.split() for line in routes.readlines()[1:]]
gateway = next(
    (socket.inet_ntoa(struct.pack("<L", int(r[2], 16))) for r in rows if r[1] == "00000000"),
    None,
)
result = {"rank": rank, "gateway": gateway, "interfaces": [n for _, n in socket.if_nameindex()]}
result["restart"] = int(os.environ["TFDIST_RESTART"])
if gateway is not None and len(sys.argv) > 1:
    with socket.create_connection((gateway, int(sys.argv[1])), timeout=10) as conn:
        conn.sendall(f"ping from w{rank}\\n".encode())
        result["reply"] = conn.makefile().readline().strip()
print("RESULT", json.dumps(result), flush=True)
if result["restart"] == 0 and rank == 0 and os.environ.get("ASK_RESTART"):
    sys.exit(75)  # "saved, restart me": a second group start
"""

# Listens on every interface like TensorFlow's gRPC server, then waits to be told to end.
LISTENER = """
import json, os, socket, sys, time
config = json.loads(os.environ["TF_CONFIG"])
rank = config["task"]["index"]
port = int(config["cluster"]["worker"][rank].rpartition(":")[2])
servers = [socket.create_server(("0.0.0.0", port))]
try:  # and IPv6 where the namespace has it
    servers.append(socket.create_server(("::", port), family=socket.AF_INET6))
except OSError:
    pass
print("LISTEN", port, flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""

# pasta's default port forwarding (auto) checks the namespace's listening ports every
# second: a port it would forward has been forwarded after this long.
_PASTA_SCAN_S = 2.5
# The process names of the stacks (pasta runs as passt or passt.avx2).
_STACK_NAMES = ("pasta", "passt", "passt.avx2", "slirp4netns")


class EchoServer:
    """A TCP server on this host's 127.0.0.1, outside every namespace: answers a line
    with ``echo: LINE`` and notes the address of each peer."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.peers: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                self.peers.append(peer[0])
                line = conn.makefile().readline().strip()
                conn.sendall(f"echo: {line}\n".encode())

    def close(self):
        self._stop.set()
        self._thread.join(timeout=10)
        self.sock.close()


@pytest.fixture
def echo_server():
    server = EchoServer()
    yield server
    server.close()


def stack_path(tmp_path, *tools: str) -> str:
    """A directory holding only ``tools`` (links to the installed ones): the launcher's
    PATH, so that exactly these stacks can be found."""
    directory = tmp_path / "bin"
    directory.mkdir(exist_ok=True)
    for tool in tools:
        found = shutil.which(tool)
        if found is None:
            pytest.fail(
                f"the egress test needs {tool} (apt-get install passt slirp4netns; .ci/run "
                "installs them as root)"
            )
        (directory / tool).symlink_to(found)
    return str(directory)


def start_launcher(tmp_path, body: str, *args: str, path: str, **env: str) -> Output:
    """``tfdist launch -n 2 --no-fixes`` of the plain script ``body`` on this host, with
    ``path`` as the launcher's PATH (the workers' interpreter is named in full)."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(body))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfdist", "launch", "-n", "2", "--no-fixes", *env.pop("flags", ())]
        + [str(script), *args],
        cwd=REPO,
        env=child_env(PATH=path, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Output(proc)


def worker_results(output: Output) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in output.seen if "] RESULT {" in line]


def stack_pids(launcher_pid: int) -> list[int]:
    """The launcher's children that are a network stack."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                head, _, rest = stat.read().rpartition(")")
        except OSError:
            continue
        name, ppid = head.partition("(")[2], int(rest.split()[1])
        if ppid == launcher_pid and name in _STACK_NAMES:
            found.append(int(entry))
    return found


def listening_sockets(pid: int) -> list[str]:
    """The sockets ``pid`` listens on (TCP) or is bound to (UDP) in this host's namespace."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, state in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        with open(f"/proc/net/{table}") as rows:
            for row in rows.readlines()[1:]:
                fields = row.split()
                if fields[3] == state and fields[9] in inodes:
                    found.append(f"{table} {fields[1]}")
    return found


def gone(pid: int, timeout: float) -> bool:
    """True once ``pid`` has exited (a zombie waiting for its reaper counts as exited)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def refused_from_here(port: int) -> dict[str, str]:
    """What connecting from this host to ``port`` gets, on every loopback address a stack
    would bind a forwarded port to."""
    result = {}
    for host in ("127.0.0.1", "::1"):
        try:
            socket.create_connection((host, port), timeout=5).close()
            result[host] = "open"
        except ConnectionRefusedError:
            result[host] = "refused"
        except OSError as err:
            result[host] = type(err).__name__
    return result


@pytest.mark.parametrize("tool", ["pasta", "slirp4netns"])
def test_private_workers_reach_a_server_on_this_hosts_loopback_through_the_stack(
    tmp_path, echo_server, tool
):
    # pasta with slirp4netns beside it: pasta is preferred.
    tools = ("pasta", "slirp4netns") if tool == "pasta" else (tool,)
    output = start_launcher(
        tmp_path, ROUND_TRIP, str(echo_server.port), path=stack_path(tmp_path, *tools)
    )
    code = output.finish(timeout=120)
    out = output.text()
    assert code == 0, out[-3000:]
    assert f"their outbound connections go out through {tool}" in out, out[-3000:]
    results = sorted(worker_results(output), key=lambda r: r["rank"])
    assert [r["reply"] for r in results] == ["echo: ping from w0", "echo: ping from w1"], out
    assert len(results[0]["interfaces"]) == 2  # lo and the stack's tap device
    if tool == "slirp4netns":
        assert results[0]["gateway"] == "10.0.2.2"
    assert echo_server.peers == ["127.0.0.1", "127.0.0.1"]  # through the host's loopback
    assert stack_pids(output.proc.pid) == []


@pytest.mark.parametrize("tool", ["pasta", "slirp4netns"])
def test_no_worker_port_is_reachable_from_this_host_through_the_stack(tmp_path, tool):
    done = tmp_path / "done"
    output = start_launcher(tmp_path, LISTENER, str(done), path=stack_path(tmp_path, tool))
    try:
        output.wait_for("[w0] LISTEN", timeout=60)
        output.wait_for("[w1] LISTEN", timeout=60)
        ports = [int(line.split()[-1]) for line in output.seen if "LISTEN" in line]
        time.sleep(_PASTA_SCAN_S)
        stacks = stack_pids(output.proc.pid)
        assert len(stacks) == 1, output.text()[-3000:]
        assert listening_sockets(stacks[0]) == []
        for port in ports:
            assert refused_from_here(port) == {"127.0.0.1": "refused", "::1": "refused"}
    finally:
        done.touch()
    code = output.finish(timeout=60)
    assert code == 0, output.text()[-3000:]
    assert f"through {tool}" in output.text()
    assert all(gone(pid, timeout=0) for pid in stacks), "the stack outlived the job"


def test_the_stack_dies_with_a_killed_launcher(tmp_path):
    done = tmp_path / "done"
    output = start_launcher(tmp_path, LISTENER, str(done), path=stack_path(tmp_path, "pasta"))
    stacks: list[int] = []
    try:
        output.wait_for("[w1] LISTEN", timeout=60)
        stacks = stack_pids(output.proc.pid)
        assert len(stacks) == 1, output.text()[-3000:]
        output.proc.kill()
        output.finish(timeout=30)
        assert gone(stacks[0], timeout=15), "the stack outlived its launcher"
    finally:
        done.touch()  # the workers die with the launcher too; this ends any that did not
        for pid in stacks:  # a stack that outlived it: not past this test
            if not gone(pid, timeout=0):
                os.kill(pid, signal.SIGKILL)


def test_without_a_stack_the_job_runs_on_loopback_and_one_line_warns(tmp_path):
    # Two group starts (a restart request): still one warning.
    output = start_launcher(
        tmp_path,
        ROUND_TRIP,
        path=stack_path(tmp_path),
        flags=("--max-restarts", "1"),
        ASK_RESTART="1",
    )
    code = output.finish(timeout=120)
    out = output.text()
    assert code == 0, out[-3000:]
    results = worker_results(output)
    # Both group starts ran: w0 asks for the restart after its first result (w1's first
    # may not come out before the launcher stops it), then both workers' second.
    started = {(r["rank"], r["restart"]) for r in results}
    assert {(0, 0), (0, 1), (1, 1)} <= started and started <= {(0, 0), (1, 0), (0, 1), (1, 1)}, out
    assert all(r["interfaces"] == ["lo"] and r["gateway"] is None for r in results)
    warnings = [line for line in out.splitlines() if "cannot reach anything outside it" in line]
    assert len(warnings) == 1, out
    assert "neither pasta nor slirp4netns is on PATH" in warnings[0]
    assert "install passt (or slirp4netns), or pass --shared-network" in warnings[0]
    assert warnings[0].startswith("tfdist launch: private network: the workers share")


def test_private_egress_0_keeps_the_workers_on_their_loopback(tmp_path):
    path = stack_path(tmp_path, "pasta", "slirp4netns")
    output = start_launcher(tmp_path, ROUND_TRIP, path=path, TFDIST_PRIVATE_EGRESS="0")
    code = output.finish(timeout=120)
    out = output.text()
    assert code == 0, out[-3000:]
    assert all(r["interfaces"] == ["lo"] for r in worker_results(output)), out
    assert "nor anything outside it from them (TFDIST_PRIVATE_EGRESS=0;" in out
    assert "cannot reach" not in out


def test_the_egress_knob():
    assert network.private_egress(environ={}) is True
    assert network.private_egress(environ={"TFDIST_PRIVATE_EGRESS": "no"}) is False
    assert network.private_egress(True, environ={"TFDIST_PRIVATE_EGRESS": "0"}) is True
    with pytest.raises(ConfigError, match=r"TFDIST_PRIVATE_EGRESS must be 1 or 0.*'maybe'"):
        network.private_egress(environ={"TFDIST_PRIVATE_EGRESS": "maybe"})
    with pytest.raises(TypeError, match=r"launch: private_egress must be a bool"):
        network.private_egress("yes")
    # The argument (--no-private-egress: private_egress=False) wins over the variable.
    off = LaunchOptions(nproc=2, target="t.py", private_egress=False)
    assert network.JobNetwork(off).egress is False
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TFDIST_PRIVATE_EGRESS", "0")
        assert network.JobNetwork(LaunchOptions(nproc=2, target="t.py")).egress is False
        on = LaunchOptions(nproc=2, target="t.py", private_egress=True)
        assert network.JobNetwork(on).egress is True
    parsed = cli.build_parser().parse_args(["launch", "-n", "2", "--no-private-egress", "t.py"])
    assert launch_command.launch_options(parsed).private_egress is False
