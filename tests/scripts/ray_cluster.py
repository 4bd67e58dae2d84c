"""Holds a one-node Ray cluster for tests/e2e/test_ray.py until its stdin closes.

Started inside a private network namespace (loopback only), so every port Ray opens
exists nowhere else. Prints one JSON line with the cluster's address, then waits.

    python ray_cluster.py TEMP_DIR NUM_CPUS < pipe
"""

import json
import sys

import ray

temp_dir, num_cpus = sys.argv[1], int(sys.argv[2])
context = ray.init(
    num_cpus=num_cpus,
    include_dashboard=False,
    _temp_dir=temp_dir,
    _node_ip_address="127.0.0.1",
)
print(json.dumps({"address": context.address_info["address"]}), flush=True)
sys.stdin.read()  # the test closes the pipe when the module is done
ray.shutdown()
