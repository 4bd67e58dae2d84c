"""The flags of ``tfdist launch``: each option, its help and its default (no checks here)."""

from __future__ import annotations

import argparse

from tfdist.core.config import UNSCOPED_MODELS_CHOICES  # a TensorFlow-free leaf

__all__ = ["DESCRIPTION", "EPILOG", "add_flags"]

DESCRIPTION = (
    "Start N worker processes of a multi-worker job on this host, each with TF_CONFIG "
    "(free ports on 127.0.0.1, in a private network namespace where Linux allows it: "
    "--shared-network opts out) and tfdist's fixes applied before the script runs. Output "
    "lines are prefixed [w0], [w1], ...; when a worker fails the others are stopped (fail "
    "fast); --max-restarts restarts the group. Exit code: 0, the failed worker's code, or "
    "75 when a restart was requested and none are left."
)
EPILOG = (
    "examples:\n"
    "  tfdist launch -n 2 train.py --epochs 3\n"
    "  tfdist launch -n 2 --devices-per-worker 2 --max-restarts 1 -m mypkg.train\n"
    "  tfdist launch -n 1 --nnodes 2 --node-rank 0 --hosts 10.0.0.1,10.0.0.2 "
    "--port 23456 --allow-remote --firewall apply train.py"
)


def add_flags(launch: argparse.ArgumentParser) -> None:
    """Every flag and argument of ``tfdist launch``, on its parser ``launch``."""
    _add_worker_flags(launch)
    _add_network_flags(launch)
    _add_supervision_flags(launch)
    _add_output_flags(launch)
    launch.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module name (like python -m)"
    )
    launch.add_argument("script", nargs="?", metavar="SCRIPT", help="the training script")
    launch.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script"
    )


def _nproc_value(text: str):
    """``-n``'s value: an int, ``auto`` or ``gpu`` (resolved when the job starts)."""
    if text in ("auto", "gpu"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an int, auto or gpu. Received: {text!r}"
        ) from None


def _add_worker_flags(launch: argparse.ArgumentParser) -> None:
    launch.add_argument(
        "-n",
        "--nproc",
        "--nproc-per-node",
        dest="nproc",
        type=_nproc_value,
        default=1,
        metavar="N",
        help="workers on this node: a number, auto (one per visible GPU, else 1) or gpu (one "
        "per visible GPU) (default: %(default)s)",
    )
    launch.add_argument(
        "--standalone",
        action="store_true",
        help="single node on loopback with free ports, as torchrun --standalone: what -n "
        "does without --hosts anyway (accepted for torchrun users)",
    )
    launch.add_argument(
        "--devices-per-worker",
        type=int,
        metavar="K",
        help="GPUs per worker (CUDA_VISIBLE_DEVICES), or on a machine without GPUs K logical "
        "CPU devices per worker (TFDIST_CPU_DEVICES); default: GPUs split evenly, else 1 CPU",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="restart the whole group at most R times after a failure or a restart request "
        "(exit code 75); the job resumes from its checkpoints (default: %(default)s)",
    )
    launch.add_argument(
        "--no-fixes",
        action="store_true",
        help="run the script with plain python, without tfdist's fixes",
    )


def _add_network_flags(launch: argparse.ArgumentParser) -> None:
    launch.add_argument(
        "--port",
        type=int,
        metavar="P",
        help="worker i of each node listens on P+i (default: free ports; required with "
        "--nnodes > 1)",
    )
    launch.add_argument(
        "--nnodes",
        metavar="M|MIN:MAX",
        help="nodes in the job (default: number of --hosts, or 1); MIN:MAX: an elastic job "
        "that goes on while at least MIN nodes are there (with --rdzv-endpoint, --rdzv-id)",
    )
    launch.add_argument(
        "--node-rank", type=int, default=0, metavar="I", help="this node's index in --hosts"
    )
    launch.add_argument(
        "--hosts",
        metavar="H0,H1,...",
        help="address of every node, in node-rank order (default: 127.0.0.1 per node)",
    )
    launch.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow non-loopback --hosts. TensorFlow's gRPC server has no authentication and "
        "listens on all interfaces: use only on a private network",
    )
    _add_protection_flags(launch)
    _add_rendezvous_flags(launch)
    launch.add_argument(
        "--unscoped-models",
        choices=UNSCOPED_MODELS_CHOICES,
        default=None,
        help="where models the script builds outside any scope train: job (default: every "
        "replica of the job; the script's batch_size is the global batch) or local (one "
        "replica per process, as upstream) (also TFDIST_UNSCOPED_MODELS)",
    )


def _add_rendezvous_flags(launch: argparse.ArgumentParser) -> None:
    launch.add_argument(
        "--rdzv-backend",
        choices=("c10d", "etcd"),
        default="c10d",
        help="elastic jobs: where the nodes meet: c10d, a store served by the launcher of "
        "the node that owns --rdzv-endpoint; etcd, an etcd cluster at --rdzv-endpoint "
        "(any node may be lost), as torchrun's",
    )
    launch.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT[,...]",
        help="elastic jobs: c10d: the store's address, on one of the nodes, then where it "
        "moves when its node is lost; etcd: the etcd cluster's members (comma-separated)",
    )
    launch.add_argument(
        "--rdzv-id", metavar="ID", help="elastic jobs: the job's id, the same on every node"
    )
    launch.add_argument(
        "--rdzv-conf",
        metavar="K=V,...",
        help="elastic jobs: lease (s without renewal before a node counts as lost, 5), "
        "join_timeout (s to wait for MIN nodes, 600), last_call_timeout (s to wait for more "
        "once MIN are there, 3)",
    )
    launch.add_argument(
        "--local-addr",
        metavar="HOST",
        help="elastic jobs: the address other nodes reach this node's workers at (default: "
        "the one this machine uses towards --rdzv-endpoint)",
    )


def _add_protection_flags(launch: argparse.ArgumentParser) -> None:
    launch.add_argument(
        "--shared-network",
        action="store_true",
        help="run a single-node job's workers on this host's network (their ports reachable "
        "from it) instead of a private network namespace (its own loopback, outbound "
        "connections only) (also TFDIST_SHARED_NETWORK=1)",
    )
    launch.add_argument(
        "--no-private-egress",
        action="store_true",
        help="give the private network's workers no outbound connection at all: loopback "
        "only (also TFDIST_PRIVATE_EGRESS=0)",
    )
    launch.add_argument(
        "--firewall",
        choices=("print", "apply"),
        help="nftables rules that admit this node's worker ports only from loopback and the "
        "job's --hosts: print them and exit (for `| nft -f -`), or apply them while the job "
        "runs (root; for multi-node or --shared-network jobs)",
    )


def _add_supervision_flags(launch: argparse.ArgumentParser) -> None:
    launch.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds between forwarding SIGINT/SIGTERM to the workers and SIGKILL "
        "(default: %(default)s)",
    )
    launch.add_argument(
        "--finish-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="once a worker finished, seconds the others may still run (default: %(default)s)",
    )
    launch.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="more launcher messages, and every worker line: without it the known-harmless "
        "start-up noise (tfdist.quiet) is dropped and workers get TF_CPP_MIN_LOG_LEVEL=2 "
        "unless it is set",
    )


def _add_output_flags(launch: argparse.ArgumentParser) -> None:
    launch.add_argument(
        "--log-dir",
        metavar="DIR",
        help="write worker i's whole output (unfiltered) to DIR/worker-<i>.log instead of the "
        "console (default: console only)",
    )
    launch.add_argument(
        "--tee",
        action="store_true",
        help="with --log-dir, also print the workers' output, prefixed (as torchrun --tee)",
    )
    launch.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file of launch options: keys are the long option names (nproc-per-node = "
        "2, log-dir = 'logs', standalone = true); command-line flags override it",
    )
    launch.add_argument(
        "--write-config",
        metavar="FILE",
        help="write the options given (config file and flags merged) to FILE as TOML and "
        "exit without launching",
    )
