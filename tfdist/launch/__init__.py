"""Start and supervise the workers of a multi-worker job on this host, without TensorFlow.

``tfdist launch -n N script.py ARGS`` starts N worker processes, each running
``python -m tfdist.bootstrap script.py ARGS`` (tfdist's fixes applied before the script
runs; ``--no-fixes``: ``python script.py ARGS``). Every output line is prefixed with
its worker (``[w0] ...``); the known-harmless start-up noise (``tfdist.core.quiet``) is
dropped unless ``verbose``; progress-bar redraws (``\\r``) are only forwarded to a
terminal (elsewhere each line's final state, like Keras' ``verbose=2``). ``log_dir``
writes worker i's whole output to ``LOG_DIR/worker-<i>.log`` (``tee``: also printed).
The launcher fails fast: when a worker exits non-zero, the
others are stopped and the launcher exits non-zero naming the worker and its exit code.
With ``max_restarts=R`` it restarts the whole group at most R times; the job resumes
from its own checkpoints. The launcher never imports TensorFlow.

What a worker gets: the launcher's environment, plus

=========================  ==========================================================
``TF_CONFIG``              the whole job's workers (``host:port``, in rank order) and
                           this worker's task ``{"type": "worker", "index": RANK}``.
                           Single node: free ports on 127.0.0.1, new at every restart.
``TFDIST_RESTART``         how many times the group was restarted (0 at first start).
``RANK``, ``WORLD_SIZE``   torchrun's names: the global rank and worker count,
``LOCAL_RANK``,            the rank on this node and workers on this node, and
``LOCAL_WORLD_SIZE``,      rank 0's address (``MASTER_ADDR``/``MASTER_PORT``, the
``MASTER_ADDR/PORT``       first TF_CONFIG address).
``KERAS_DISTRIBUTION_*``   ``JOB_ADDRESSES`` (the TF_CONFIG addresses, comma-separated;
                           the first is JAX's coordinator), ``NUM_PROCESSES``,
                           ``PROCESS_ID`` (= RANK): a JAX script may call
                           ``keras.distribution.initialize()`` itself.
``TF_CPP_MIN_LOG_LEVEL``   ``2`` unless set or ``verbose`` (TensorFlow's C++ INFO and
                           WARNING lines off; errors stay).
``CUDA_VISIBLE_DEVICES``   on a GPU machine: this worker's slice of the visible GPUs
                           (``devices_per_worker`` each, default an even split).
``TFDIST_CPU_DEVICES``     without GPUs and with ``devices_per_worker=K``: K logical
                           CPU devices (removed on a GPU machine).
``PYTHONUNBUFFERED``       ``1``, so lines arrive as they are printed.
``TFDIST_COMPAT_EXCLUDE``  ``all`` with ``--no-fixes``: upstream behaviour even for a
                           script that imports tfdist.
``TF_NUM_INTRAOP_THREADS`` with several workers on a node, unless set: each worker's
                           share of the node's cores (TensorFlow would give each all of
                           them; torchrun's ``OMP_NUM_THREADS=1`` habit).
=========================  ==========================================================

and without ``SLURM_STEP_NUM_TASKS`` and ``SLURM_PROCID`` (a SLURM step around the
launcher must not make the workers resolve SLURM). Set other ``TFDIST_*`` variables
(``tfdist.core.config``) on the launcher; the workers inherit them.

Exit codes and restarts:

* every worker exits 0: the launcher exits 0.
* a worker exits with ``RESTART_EXIT_CODE`` (75: "saved, restart me", used by the
  checkpoint module on SIGTERM): the others are stopped and the group is restarted if
  restarts remain. Restart requests and failures draw on the same ``max_restarts``
  budget, so a job that keeps asking never loops forever; when the budget is spent the
  launcher itself exits 75, so an outer scheduler (SLURM ``--requeue``, Kubernetes) can
  restart it.
* a worker fails (any other non-zero code, or a signal), or is still running
  ``finish_timeout`` seconds after another finished: the others are stopped (SIGTERM,
  SIGKILL after ``stop_grace``); the group is restarted if restarts remain, else the
  launcher exits with that worker's code (128 + N when signal N killed it; 1 for a
  worker that did not finish).
* the launcher gets SIGINT/SIGTERM: it forwards the signal to every worker, waits up
  to ``grace`` seconds (then SIGKILL; a second signal kills at once), never restarts,
  and exits 0 if all workers exited 0, 75 if all of them exited 0 or 75 (saved), else
  128 + the signal number.
* the launcher is killed: its workers get SIGKILL (Linux), never train on as orphans.

Errors in the options, a missing script, a taken ``--port`` or GPUs that cannot be
split as asked raise ``tfdist.config.ConfigError`` (``tfdist launch`` prints one line
and exits 2); an argument of the wrong type raises ``TypeError``.

Security: TensorFlow's gRPC server has no authentication and listens on all
interfaces, whatever TF_CONFIG names. A single-node job's workers therefore run in a
private network on Linux: one network namespace (created with a user namespace when not
root) with its own loopback, so their ports exist nowhere else, and outbound
connections through pasta or slirp4netns with no port forwarded in
(``TFDIST_PRIVATE_EGRESS=0``: loopback only); the launcher logs ``private network:
...`` and itself stays on this host's network.
``shared_network=True`` (``--shared-network``, ``TFDIST_SHARED_NETWORK=1``) opts out;
where namespaces are not available the launcher warns, naming the exposed ports.
Multi-node jobs use the hosts' network: addresses on other hosts must be allowed
explicitly (``allow_remote=True``, ``--allow-remote``), and ``firewall=True``
(``--firewall apply``, root and nft) admits the worker ports only from loopback and the
job's hosts while the job runs (``--firewall print`` prints the rules). Threat model:
docs/security.md.

Modules: ``options`` (``LaunchOptions``), ``environment`` (addresses, command line and
environment of each worker: pure functions), ``workers`` (processes, output, signals),
``supervise`` (the supervision state machine, the restart policy, ``run``),
``network`` (the private network namespace and the firewall rule).

Example:
    >>> opts = LaunchOptions(nproc=2, target="train.py", args=("--epochs", "3"))
    >>> exit_code = run(opts)  # doctest: +SKIP

    $ tfdist launch -n 2 train.py --epochs 3
    $ tfdist launch --standalone --nproc-per-node auto --log-dir logs --tee train.py
    $ tfdist launch --config launch.toml train.py   # keys: long option names
    $ tfdist launch -n 2 --devices-per-worker 2 --max-restarts 1 -m mypkg.train
    $ tfdist launch -n 2 --nnodes 2 --node-rank 0 --hosts 10.0.0.1,10.0.0.2 --port 23456 \\
          --allow-remote --firewall apply train.py
"""

from __future__ import annotations

from tfdist.core.config import RESTART_ENV, RESTART_EXIT_CODE  # noqa: F401  (were attributes here)
from tfdist.launch.environment import (
    cluster_addresses,
    free_ports,
    visible_gpus,
    worker_command,
    worker_envs,
)
from tfdist.launch.options import LOOPBACK, LaunchOptions
from tfdist.launch.supervise import Outcome, run

__all__ = [
    "LOOPBACK",
    "LaunchOptions",
    "Outcome",
    "free_ports",
    "visible_gpus",
    "cluster_addresses",
    "worker_command",
    "worker_envs",
    "run",
]
