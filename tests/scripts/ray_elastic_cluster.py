"""Holds a Ray cluster of a head and worker nodes for tests/e2e/test_ray_elastic.py.

Every node has ``NUM_CPUS`` CPUs (1: one Train worker each) and runs on this machine
(``ray.cluster_utils.Cluster``), inside the private network namespace the test starts it
in. Prints one JSON line with the cluster's address, then reads commands from stdin, one
a line, and answers each with one JSON line:

* ``remove``: the newest worker node dies for good: its raylet and every process of it
  (its Train worker included) killed at once, no graceful shutdown;
* ``add``: a new worker node joins (the lost machine coming back).

Closing stdin shuts the cluster down.

    python ray_elastic_cluster.py TEMP_DIR WORKER_NODES NUM_CPUS < pipe
"""

import glob
import json
import os
import socket
import sys
import threading
import time

import ray
from ray._common.utils import get_default_ray_temp_dir
from ray._private.authentication.authentication_token_setup import (
    ensure_token_if_auth_enabled,
)
from ray._raylet import DASHBOARD_AGENT_LISTEN_PORT_NAME, persist_port
from ray.cluster_utils import Cluster

temp_dir, worker_nodes, num_cpus = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# RAY_AUTH_MODE=token (the test's): the token ray.init would write to ~/.ray, written first.
ensure_token_if_auth_enabled(None, create_token_if_missing=True)
os.makedirs(get_default_ray_temp_dir(), exist_ok=True)  # where the head writes its address


def free_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def add_node(add, **extra):
    """``add(**args)``: one node of ``num_cpus`` CPUs; its agents' ports are chosen here.

    Each raylet waits 15 s for its agents to say which ports they took (files in the
    session folder), then dies; an agent takes longer than that to start on a busy
    machine. With the ports given it does not wait, except for the dashboard agent's
    HTTP port, whose file this process writes itself (with the port the agent will
    take) as soon as the session folder exists: the node's id is chosen here for it
    (Ray's ``RAY_OVERRIDE_NODE_ID_FOR_TESTING``).
    """
    node_id = ray.NodeID.from_random().hex()
    listen_port = free_port()
    done = threading.Event()

    def announce():
        written = set()
        while not done.is_set():
            for session in glob.glob(os.path.join(temp_dir, "session_2*")):
                if session not in written:
                    persist_port(session, node_id, DASHBOARD_AGENT_LISTEN_PORT_NAME, listen_port)
                    written.add(session)
            time.sleep(0.05)

    announcer = threading.Thread(target=announce, daemon=True)
    announcer.start()
    try:
        return add(
            num_cpus=num_cpus,
            node_ip_address="127.0.0.1",
            metrics_agent_port=free_port(),
            metrics_export_port=free_port(),
            runtime_env_agent_port=free_port(),
            dashboard_agent_listen_port=listen_port,
            env_vars={"RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id},
            **extra,
        )
    finally:
        done.set()
        announcer.join()


cluster = Cluster()
add_node(cluster.add_node, include_dashboard=False, temp_dir=temp_dir)  # the head
workers = [add_node(cluster.add_node) for _ in range(worker_nodes)]
cluster.wait_for_nodes()
print(json.dumps({"address": cluster.address}), flush=True)
for command in sys.stdin:
    command = command.strip()
    if command == "remove":
        node = workers.pop()
        cluster.remove_node(node, allow_graceful=False)
        answer = {"removed": node.node_id, "at": time.time()}
    elif command == "add":
        node = add_node(cluster.add_node)
        workers.append(node)
        answer = {"added": node.node_id, "at": time.time()}
    else:
        answer = {"error": f"unknown command {command!r}"}
    print(json.dumps(answer), flush=True)
cluster.shutdown()
