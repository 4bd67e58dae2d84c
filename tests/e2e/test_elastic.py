"""Elastic jobs under ``tfdist launch --nnodes MIN:MAX``: lose a node for good, go on.

Three node launchers (each ``-n 1``), meeting at a rendezvous store the first one hosts:
on three hosts of network namespaces (tests/netns_lab.py: a lost host is every process in
its namespace killed -9), or on this host's loopback, each with its own free ports. The script is a
user's (tests/scripts/elastic_job.py: make_or_restore, a checkpoint directory, a fixed
global batch of 12, BatchNormalization). The test follows the chief's ``STEP n WORKERS w``
lines and acts mid-epoch:

* one node's launcher is killed -9 (its worker dies with it): the two others re-form and
  train on; the node started again with the same command joins at once (the round ends
  with a save at the exact step); the job ends equal to an uninterrupted run on one device
  at the same global batch (within 1e-5, the world-size resume tests' tolerance);
* the node hosting the store is killed: the store moves to the next ``--rdzv-endpoint``
  and the two others finish, equal too;
* below MIN nodes the launcher waits, says who is missing, then exits 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_lab import ADDRESS

from tfdist.launch.environment import free_ports

from conftest import REPO, SCRIPTS, child_env, equivalence, warm_start

JOB = SCRIPTS / "elastic_job.py"
TOLERANCE = 1e-5  # tests/e2e/test_resume_world_size.py's
RDZV_CONF = "lease=3,last_call_timeout=2,join_timeout=120"


class Node:
    """One node's launcher, its output in a file (a machine of the job); ``lab`` and
    ``host``: it runs in that host's namespace (else on loopback)."""

    def __init__(
        self, tmp: Path, name: str, endpoints: str, env: dict, *extra: str, lab=None, host=""
    ):
        self.log, self.lab, self.host = tmp / f"{name}.log", lab, host
        inside = ["ip", "netns", "exec", lab.ns[host]] if lab else []
        if lab:  # the hosts' addresses are not loopback
            extra = ("--allow-remote", *extra)
        argv = [
            *inside, sys.executable, "-m", "tfdist", "launch", "--nnodes", "2:3",
            "--rdzv-endpoint", endpoints, "--rdzv-id", "elastic-test", "--rdzv-conf", RDZV_CONF,
            "-n", "1", *extra, str(JOB), "--dir", str(tmp / "ckpt"), "--step-seconds", "0.3",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        if lab:
            lab.procs.append(self.proc)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """The machine is lost: its launcher and workers get SIGKILL at once."""
        if self.lab:
            self.lab.kill_host(self.host)
        else:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def end(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def wait_for(nodes: list[Node], pattern: str, timeout: float = 240) -> re.Match:
    """The first match of ``pattern`` in the nodes' output; fails with their tails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in nodes:
            found = re.search(pattern, node.text())
            if found:
                return found
        if all(node.proc.poll() is not None for node in nodes):
            break
        time.sleep(0.2)
    tails = "\n".join(f"--- {n.log.name}\n{n.text()[-3000:]}" for n in nodes)
    pytest.fail(f"no {pattern!r} in {timeout} s:\n{tails}")


def wait_step(nodes: list[Node], workers: int, at_least: int) -> int:
    """Waits for the chief to finish a step >= ``at_least`` on ``workers`` workers."""
    pattern = rf"STEP (\d+) WORKERS {workers}\n"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        steps = [int(s) for n in nodes for s in re.findall(pattern, n.text())]
        if steps and max(steps) >= at_least:
            return max(steps)
        time.sleep(0.2)
    pytest.fail(f"no step >= {at_least} on {workers} workers: {[n.text()[-2000:] for n in nodes]}")


def finish(nodes: list[Node]) -> None:
    for node in nodes:
        try:
            code = node.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            node.end()
            code = "timeout"
        assert code == 0, f"{node.log.name} exited {code}:\n{node.text()[-4000:]}"


def final_weights(nodes: list[Node]) -> dict:
    for node in nodes:
        for line in reversed(node.text().splitlines()):
            body = line.split("] ", 1)[-1]
            if body.startswith("{") and '"worker": 0' in body:
                return json.loads(body)
    pytest.fail("no chief result line")


def starts(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "ckpt" / "starts.jsonl").read_text().splitlines()]


def reference(tmp: Path, env: dict) -> dict:
    """The uninterrupted run: one process, one device, the same global batch."""
    proc = subprocess.run(
        [sys.executable, str(JOB), "--dir", str(tmp / "reference")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["replicas"] == 1 and result["resumed_step"] is None, result
    return result


def environment(backend: str) -> dict:
    env = child_env(KERAS_BACKEND=backend, TFDIST_UNSCOPED_MODELS="local")
    warm_start.prepare(env, child_env())
    return env


def start_nodes(tmp: Path, endpoints: str, env: dict, lab=None, *extra: str) -> list[Node]:
    """Node 0 first (it hosts the store at the first endpoint; its record goes to
    ``tmp/logs``), then nodes 1 and 2 (on hosts a, b, c of ``lab`` when given).
    ``extra``: more launch flags for every node (``--rdzv-backend etcd``: nobody hosts)."""
    where = [{"lab": lab, "host": h} if lab else {} for h in "abc"]
    logs = ("--log-dir", str(tmp / "logs"), "--tee")
    first = Node(tmp, "node0", endpoints, env, *extra, *logs, **where[0])
    if "etcd" not in extra:
        wait_for([first], "this node hosts the store")
    rest = [Node(tmp, f"node{i}", endpoints, env, *extra, **where[i]) for i in (1, 2)]
    return [first, *rest]


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("jax", marks=pytest.mark.jax)])
def test_a_lost_node_leaves_and_a_returning_node_joins_and_the_job_ends_equal(
    request, tmp_path, backend
):
    """TensorFlow on the lab's hosts; JAX on loopback nodes: JAX's CPU collectives (gloo)
    take their address from the host name, which the lab's namespaces share, so across
    them every worker would dial its own loopback (machines have names of their own)."""
    lab = request.getfixturevalue("lab") if backend == "tensorflow" else None
    # Cold workers on the lab (its hosts are other network namespaces than the warm
    # process's); warm ones on loopback.
    env = child_env(KERAS_BACKEND=backend) if lab else environment(backend)
    env["TFDIST_UNSCOPED_MODELS"] = "local"
    expected = reference(tmp_path, env)
    endpoint = f"{ADDRESS['a']}:29400" if lab else f"127.0.0.1:{free_ports(1)[0]}"
    nodes = start_nodes(tmp_path, endpoint, env, lab)
    try:
        wait_step(nodes, workers=3, at_least=10)
        nodes[2].kill()  # for good: its launcher and its worker, mid-epoch 1
        lost = wait_for(nodes[:2], r"re-formed \((.*?)\): 3 node\(s\) \(3 workers\) -> 2 node")
        assert "stopped renewing its lease" in lost.group(1), lost.group(0)
        wait_step(nodes[:2], workers=2, at_least=1)
        again = {"lab": lab, "host": "c"} if lab else {}  # the same command, on the same host
        nodes[2] = Node(tmp_path, "node2-again", endpoint, env, **again)
        joined = wait_for(nodes[:2], r"re-formed \((.*?)\): 2 node\(s\) \(2 workers\) -> 3 node")
        assert "joined" in joined.group(1), joined.group(0)
        finish(nodes)
    finally:
        for node in nodes:
            node.end()
    seen = starts(tmp_path)
    assert [s["workers"] for s in seen] == [3, 2, 3], seen
    assert seen[0]["resumed_step"] is None and seen[1]["resumed_step"] >= 8, seen
    assert seen[2]["resumed_step"] > seen[1]["resumed_step"], seen  # saved as it re-formed
    assert [re.search(r"round (\d+) of (\d+) node", s["rendezvous"]).groups() for s in seen] == [
        ("1", "3"),
        ("2", "2"),
        ("3", "3"),
    ], seen
    record = [json.loads(line) for line in (tmp_path / "logs" / "elastic.jsonl").open()]
    assert [r["resumed_step"] for r in record] == [s["resumed_step"] for s in seen], record
    assert [len(r["nodes"]) for r in record] == [3, 2, 3], record
    assert all(r["seconds_to_first_step"] > 0 for r in record[1:]), record
    assert f"resumed from step {seen[1]['resumed_step']};" in record[1]["line"], record
    result = final_weights(nodes)
    assert result["workers"] == 3 and result["steps"] == expected["steps"], result
    equivalence.assert_close(expected["weights"], result["weights"], TOLERANCE, backend)


@pytest.mark.slow
@pytest.mark.multiworker
def test_the_store_moves_on_when_its_node_is_lost(tmp_path):
    env = environment("tensorflow")
    expected = reference(tmp_path, env)
    endpoints = ",".join(f"127.0.0.1:{port}" for port in free_ports(2))
    nodes = start_nodes(tmp_path, endpoints, env)
    try:
        wait_step(nodes, workers=3, at_least=10)
        nodes[0].kill()  # the store's host, and the chief
        moved = wait_for(nodes[1:], r"the store at (\S+) is gone; moving to (\S+)")
        assert moved.groups() == tuple(endpoints.split(",")), moved.group(0)
        wait_for(nodes[1:], r"-> 2 node\(s\) \(2 workers\)")
        finish(nodes[1:])
    finally:
        for node in nodes:
            node.end()
    assert [s["workers"] for s in starts(tmp_path)] == [3, 2]
    result = final_weights(nodes[1:])
    equivalence.assert_close(expected["weights"], result["weights"], TOLERANCE, "store moved")


@pytest.mark.slow
@pytest.mark.multiworker
def test_with_etcd_the_chief_is_lost_like_any_node_and_the_job_ends_equal(tmp_path):
    """``--rdzv-backend etcd``: no node hosts the rendezvous, so losing node 0 (the chief,
    the first to come) is losing any node: the two others re-form and finish."""
    from etcd_server import EtcdServer

    env = environment("tensorflow")
    expected = reference(tmp_path, env)
    with EtcdServer(tmp_path) as etcd:
        nodes = start_nodes(tmp_path, etcd.endpoint, env, None, "--rdzv-backend", "etcd")
        try:
            wait_step(nodes, workers=3, at_least=10)
            nodes[0].kill()  # the chief: its launcher and its worker, mid-epoch 1
            lost = wait_for(nodes[1:], r"re-formed \((.*?)\): 3 node\(s\) \(3 workers\) -> 2 node")
            assert "stopped renewing its lease" in lost.group(1), lost.group(0)
            finish(nodes[1:])
        finally:
            for node in nodes:
                node.end()
    seen = starts(tmp_path)
    assert [s["workers"] for s in seen] == [3, 2], seen
    assert all(s["rendezvous"].startswith(f"etcd store at {etcd.endpoint}") for s in seen), seen
    assert seen[1]["resumed_step"] >= 8, seen
    result = final_weights(nodes[1:])
    assert result["workers"] == 2 and result["steps"] == expected["steps"], result
    equivalence.assert_close(expected["weights"], result["weights"], TOLERANCE, "chief lost")


@pytest.mark.multiworker
def test_below_min_nodes_the_launcher_says_who_is_missing_then_fails(tmp_path):
    env = environment("tensorflow")
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    conf = "lease=3,last_call_timeout=1,join_timeout=12"
    argv = [
        sys.executable, "-m", "tfdist", "launch", "--nnodes", "2:3", "--rdzv-endpoint",
        endpoint, "--rdzv-id", "alone", "--rdzv-conf", conf, "-n", "1", str(JOB), "--dir",
        str(tmp_path / "ckpt"),
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "waiting for the job to form: 1 of at least 2 node(s) are here" in proc.stderr
    assert "no round of at least 2 node(s) formed in 12 s" in proc.stderr, proc.stderr
    assert not (tmp_path / "ckpt").exists()  # no worker ever started
