"""The ``tfdist`` command line: ``info``, ``launch``, ``train``, ``check``.

Parsing never imports TensorFlow, so ``tfdist --help`` answers at once; each command
imports what it needs when it runs.

Example:
    $ tfdist info --json
    $ tfdist launch -n 2 train.py --epochs 3
    $ tfdist check --steps 10 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from tfdist import __version__
from tfdist.core.config import (  # a TensorFlow-free leaf
    UNSCOPED_MODELS_CHOICES,
    UNSCOPED_MODELS_ENV,
    ConfigError,
)

__all__ = ["main", "build_parser", "console_main"]


def _quiet_tensorflow() -> None:
    # TensorFlow's C++ start-up chatter and the known-harmless warnings (tfdist.core.quiet)
    # would bury the answer; errors still show.
    from tfdist.core import quiet

    quiet.install()


def _cmd_info(args: argparse.Namespace) -> int:
    _quiet_tensorflow()
    from tfdist import info, startup
    from tfdist.core import quiet

    # It describes, never joins: under JAX, importing jax in a job's process (a TrainJob
    # pod, a launched worker) would otherwise register with the job's coordinator.
    startup.auto_strategy(False)

    with quiet.filtered_stderr():  # TensorFlow's C++ start-up lines, too
        report = info.report()
    print(json.dumps(report, indent=2) if args.json else info.render(report))
    return 0


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (it may be replaced)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def _configure_launch_log(verbose: bool) -> None:
    """The launcher's own messages, once, on stderr, as ``tfdist launch: ...``."""
    log = logging.getLogger("tfdist.launch")
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("tfdist launch: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.DEBUG if verbose else logging.INFO)


def _launch_options(args: argparse.Namespace):
    """``tfdist.launch.LaunchOptions`` from the parsed flags (it checks them)."""
    from tfdist import launch

    if args.script is None:
        raise ConfigError(
            "launch: missing the script to run. Received: no SCRIPT. "
            "Usage: tfdist launch -n N script.py [ARGS...] (or -m MODULE [ARGS...])."
        )
    hosts = tuple(h.strip() for h in args.hosts.split(",")) if args.hosts else None
    nnodes = _static_nnodes(args)
    if nnodes is None:
        nnodes = len(hosts) if hosts else 1
    _check_standalone(args, nnodes)
    return launch.LaunchOptions(
        nproc=_resolve_nproc(args.nproc),
        target=args.script,
        args=tuple(args.args),
        module=args.module,
        devices_per_worker=args.devices_per_worker,
        max_restarts=args.max_restarts,
        port=args.port,
        nnodes=nnodes,
        node_rank=args.node_rank,
        hosts=hosts or (launch.LOOPBACK,) * nnodes,
        allow_remote=args.allow_remote,
        shared_network=True if args.shared_network else None,  # None: TFDIST_SHARED_NETWORK
        private_egress=False if args.no_private_egress else None,  # TFDIST_PRIVATE_EGRESS
        firewall=args.firewall == "apply",
        fixes=not args.no_fixes,
        grace=args.grace,
        finish_timeout=args.finish_timeout,
        log_dir=args.log_dir,
        tee=args.tee,
        verbose=args.verbose,
    )


def _static_nnodes(args: argparse.Namespace) -> int | None:
    """``--nnodes N`` of a static job (None: not given); MIN:MAX belongs to elastic jobs."""
    if args.nnodes is None or _is_elastic(args):
        return None
    from tfdist.launch.rendezvous import parse_nnodes

    return parse_nnodes(args.nnodes)[0]


def _is_elastic(args: argparse.Namespace) -> bool:
    """An elastic job: ``--nnodes MIN:MAX`` with MIN < MAX, or a ``--rdzv-endpoint``."""
    if args.rdzv_endpoint:
        return True
    if args.nnodes is None or ":" not in args.nnodes:
        return False
    from tfdist.launch.rendezvous import parse_nnodes

    low, high = parse_nnodes(args.nnodes)
    return low < high


def _elastic_options(args: argparse.Namespace):
    """``(LaunchOptions, ElasticOptions)`` of an elastic job from the parsed flags."""
    from tfdist import launch
    from tfdist.launch.elastic import ElasticOptions
    from tfdist.launch.rendezvous import parse_nnodes

    if args.script is None:
        raise ConfigError(
            "launch: missing the script to run. Received: no SCRIPT. "
            "Usage: tfdist launch -n N script.py [ARGS...] (or -m MODULE [ARGS...])."
        )
    if args.hosts or args.node_rank or args.standalone:
        raise ConfigError(
            "launch: an elastic job (--nnodes MIN:MAX or --rdzv-endpoint) numbers its nodes "
            f"itself. Received: hosts={args.hosts!r}, node_rank={args.node_rank}, standalone="
            f"{args.standalone}. Leave out --hosts, --node-rank and --standalone."
        )
    if not args.rdzv_endpoint or not args.rdzv_id:
        raise ConfigError(
            "launch: an elastic job needs where its nodes meet and a job id. Received: "
            f"rdzv_endpoint={args.rdzv_endpoint!r}, rdzv_id={args.rdzv_id!r}. Pass "
            "--rdzv-endpoint HOST:PORT (an address of one of the nodes) and --rdzv-id NAME."
        )
    low, high = parse_nnodes(args.nnodes or "1:1")
    conf = _rdzv_conf(args.rdzv_conf)
    elastic = ElasticOptions(
        min_nodes=low,
        max_nodes=high,
        endpoints=tuple(e.strip() for e in args.rdzv_endpoint.split(",")),
        job=args.rdzv_id,
        host=args.local_addr,
        **conf,
    )
    options = launch.LaunchOptions(
        nproc=_resolve_nproc(args.nproc),
        target=args.script,
        args=tuple(args.args),
        module=args.module,
        devices_per_worker=args.devices_per_worker,
        max_restarts=args.max_restarts,
        port=args.port,
        allow_remote=args.allow_remote,
        firewall=args.firewall == "apply",
        fixes=not args.no_fixes,
        grace=args.grace,
        finish_timeout=args.finish_timeout,
        log_dir=args.log_dir,
        tee=args.tee,
        verbose=args.verbose,
    )
    return options, elastic


_RDZV_CONF = {"lease": "lease", "join_timeout": "join_timeout", "last_call_timeout": "last_call"}


def _rdzv_conf(text: str | None) -> dict:
    """``--rdzv-conf lease=5,join_timeout=600,last_call_timeout=3`` -> ElasticOptions fields."""
    conf = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        try:
            conf[_RDZV_CONF[key.strip()]] = float(value)
        except (KeyError, ValueError):
            raise ConfigError(
                f"launch: rdzv_conf takes {', '.join(_RDZV_CONF)} as KEY=SECONDS. Received: "
                f"rdzv_conf={text!r}. e.g. --rdzv-conf lease=5,join_timeout=600."
            ) from None
    return conf


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


def _resolve_nproc(value):
    """``auto``: one worker per visible GPU, else 1; ``gpu``: one per GPU (GPUs needed)."""
    if value not in ("auto", "gpu"):
        return value
    from tfdist.launch import visible_gpus

    gpus = len(visible_gpus())
    if gpus:
        return gpus
    if value == "gpu":
        raise ConfigError(
            "launch: --nproc-per-node gpu needs a GPU. Received: nproc_per_node='gpu', and "
            "none is visible (CUDA_VISIBLE_DEVICES, /proc/driver/nvidia/gpus). Pass a number, "
            "or auto (1 worker without GPUs)."
        )
    return 1


def _check_standalone(args: argparse.Namespace, nnodes: int) -> None:
    # torchrun's --standalone: one node, loopback, free ports (what -n does anyway).
    if args.standalone and (nnodes > 1 or args.hosts):
        raise ConfigError(
            "launch: --standalone runs a single-node job on loopback. Received: "
            f"nnodes={nnodes}, hosts={args.hosts!r}. Leave out --standalone, or --nnodes/--hosts."
        )


def _cmd_launch(args: argparse.Namespace) -> int:
    # TensorFlow-free: the launcher only builds environments and supervises processes.
    from tfdist import launch

    _configure_launch_log(args.verbose)
    if args.write_config:  # a config needs no script; its values are checked when used
        return _write_config(args)
    if args.unscoped_models:  # the workers inherit the launcher's environment
        os.environ[UNSCOPED_MODELS_ENV] = args.unscoped_models
    if _is_elastic(args):
        from tfdist.launch.elastic import run_elastic

        return run_elastic(*_elastic_options(args))
    options = _launch_options(args)
    if args.firewall == "print":
        return _print_firewall(options)
    return launch.run(options)


def _print_firewall(options) -> int:
    """``--firewall print``: this node's nftables rules on stdout (``| nft -f -``)."""
    from tfdist.launch import cluster_addresses, network

    if not options.fixed_ports:
        raise ConfigError(
            "launch: --firewall print needs fixed ports. Received: no --port. Pass --port P "
            "(or host:port in --hosts): the rules name the ports."
        )
    addresses = cluster_addresses(options)
    first = network.node_ports(options, addresses)[0]
    # A name that outlives this process: the rules are loaded by hand, for the job's ports.
    print(network.firewall_rules(options, addresses, table=f"tfdist_{first}"), end="")
    return 0


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks; every option's help names its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


# Not options: what argparse adds, and what a config file must not set.
_NOT_CONFIG = ("script", "args", "config", "write_config", "func", "launch_parser", "command")
_CONFIG_NAMES = {"nproc_per_node": "nproc"}  # long option name -> its dest, where they differ


def _config_defaults(parser: argparse.ArgumentParser, path: str) -> dict:
    """The options of a ``--config`` TOML file, as ``parser`` defaults (checked)."""
    import tomllib

    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(
            f"launch: config must be a readable TOML file ({err}). Received: config={path!r}"
        ) from None
    defaults = vars(parser.parse_args([]))
    values = {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        dest = _CONFIG_NAMES.get(dest, dest)
        if dest not in defaults or dest in _NOT_CONFIG:
            raise ConfigError(
                f"launch: config keys must be long option names of tfdist launch. Received: "
                f"{key}={value!r} in {path}. See tfdist launch --help (e.g. nproc-per-node = 2)."
            )
        flag = isinstance(defaults[dest], bool)
        if flag != isinstance(value, bool):
            what = "true or false" if flag else "a value, not true or false"
            raise ConfigError(f"launch: {key} must be {what}. Received: {key}={value!r} in {path}")
        values[dest] = value
    return values


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string uses JSON's escapes


def _write_config(args: argparse.Namespace) -> int:
    """``--write-config FILE``: the options in effect, as a file for ``--config``."""
    names = {dest: name for name, dest in _CONFIG_NAMES.items()}
    lines = [
        f"{names.get(dest, dest).replace('_', '-')} = {_toml_value(value)}"
        for dest, value in sorted(vars(args).items())
        if dest not in _NOT_CONFIG and value is not None
    ]
    with open(args.write_config, "w", encoding="utf-8") as file:
        file.write("# tfdist launch --config FILE; command-line flags override it\n")
        file.write("\n".join(lines) + "\n")
    print(f"tfdist launch: wrote {args.write_config}", file=sys.stderr)
    return 0


def _with_config(parser, args: argparse.Namespace, argv) -> argparse.Namespace:
    """With ``launch --config FILE``: ``argv`` parsed again, FILE's options as defaults."""
    path = getattr(args, "config", None)
    if not path:
        return args
    args.launch_parser.set_defaults(**_config_defaults(args.launch_parser, path))
    return parser.parse_args(argv)


_LAUNCH_DESCRIPTION = (
    "Start N worker processes of a multi-worker job on this host, each with TF_CONFIG "
    "(free ports on 127.0.0.1, in a private network namespace where Linux allows it: "
    "--shared-network opts out) and tfdist's fixes applied before the script runs. Output "
    "lines are prefixed [w0], [w1], ...; when a worker fails the others are stopped (fail "
    "fast); --max-restarts restarts the group. Exit code: 0, the failed worker's code, or "
    "75 when a restart was requested and none are left."
)
_LAUNCH_EPILOG = (
    "examples:\n"
    "  tfdist launch -n 2 train.py --epochs 3\n"
    "  tfdist launch -n 2 --devices-per-worker 2 --max-restarts 1 -m mypkg.train\n"
    "  tfdist launch -n 1 --nnodes 2 --node-rank 0 --hosts 10.0.0.1,10.0.0.2 "
    "--port 23456 --allow-remote --firewall apply train.py"
)


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
        choices=("c10d",),
        default="c10d",
        help="elastic jobs: where the nodes meet: c10d, a store served by the launcher of "
        "the node that owns --rdzv-endpoint, as torchrun's",
    )
    launch.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT[,...]",
        help="elastic jobs: the rendezvous store's address, on one of the nodes; more "
        "endpoints (comma-separated) are where it moves when its node is lost",
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


def _add_launch_parser(sub) -> None:
    launch = sub.add_parser(
        "launch",
        help="run a training script as N workers on this host (TF_CONFIG set for each)",
        description=_LAUNCH_DESCRIPTION,
        epilog=_LAUNCH_EPILOG,
        formatter_class=_HelpFormatter,
    )
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
    launch.set_defaults(func=_cmd_launch, launch_parser=launch)


def _cmd_train(args: argparse.Namespace) -> int:
    _quiet_tensorflow()
    from tfdist.core import quiet
    from tfdist.examples import mnist  # TensorFlow-free until it trains

    with quiet.filtered_stderr():  # TensorFlow's C++ start-up lines, as under launch
        return mnist.main(args)


def _add_train(sub) -> None:
    train = sub.add_parser(
        "train",
        help="run a walkthrough job (mnist) as a restartable job",
        description="Train a walkthrough job. Run the same command again after a kill or "
        "SIGTERM and it resumes from its checkpoints.",
    )
    jobs = train.add_subparsers(dest="job", metavar="JOB")
    jobs.required = True
    mnist = jobs.add_parser(
        "mnist",
        help="MNIST convnet: --recipe fast (>= 99%% test accuracy) or tutorial (the guides')",
        description="Train MNIST (from tensorflow_datasets; set TFDS_DATA_DIR to run offline). "
        "Writes OUTPUT/model.keras, metrics.json, history.csv, curves.png, checkpoints and "
        "TensorBoard logs, and ends with a line `test_accuracy=...`. Rerun the same command to "
        "resume, also on another number of devices or workers with the same global batch "
        "(--per-replica-batch); a checkpoint folder made with another recipe, global batch or "
        "split is refused (OUTPUT/ckpt/job.json records them and the total training time).",
    )
    _add_train_mnist_options(mnist)
    train.set_defaults(func=_cmd_train)


def _add_train_mnist_options(mnist) -> None:
    mnist.add_argument(
        "--recipe",
        choices=("fast", "tutorial"),
        default="fast",
        help="fast: >= 99%% test accuracy in little time; tutorial: the guides' model and "
        "12 epochs (default: %(default)s)",
    )
    mnist.add_argument("--epochs", type=int, help="total epochs (default: the recipe's)")
    mnist.add_argument("--per-replica-batch", type=int, help="default: the recipe's")
    mnist.add_argument("--output", default=None, help="default: runs/mnist-RECIPE")
    mnist.add_argument(
        "--checkpoint-dir", help="a folder or a URL (s3://, gs://...); default: OUTPUT/ckpt"
    )
    mnist.add_argument(
        "--devices", type=int, help="devices per process: GPUs if any, else logical CPUs"
    )
    mnist.add_argument(
        "--workers",
        type=int,
        default=1,
        help="run N workers on this host via `tfdist launch`, in a private network "
        "namespace; MNIST is fetched first (default: %(default)s)",
    )
    mnist.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="with --workers: group restarts allowed (default: %(default)s)",
    )
    mnist.add_argument(
        "--seed", type=int, default=0, help="data order and initial weights (default: %(default)s)"
    )
    mnist.add_argument(
        "--save-freq",
        default="200",
        help="checkpoint every N steps as well as every epoch ('epoch': epochs only) "
        "(default: %(default)s)",
    )
    mnist.add_argument(
        "--verbose",
        default="auto",
        choices=("auto", "0", "1", "2"),
        help="Keras progress output on the chief: 0 none, 1 progress bar, 2 one line per "
        "epoch, auto as Keras (default: %(default)s)",
    )
    mnist.add_argument(
        "--backend",
        choices=("tensorflow", "jax"),
        default=None,
        help="Keras backend of the job: sets KERAS_BACKEND (default: $KERAS_BACKEND, "
        "else tensorflow)",
    )
    mnist.add_argument(
        "--train-split",
        default="train",
        help="tfds split to train on, e.g. 'train[:10%%]' for a quick run (default: train)",
    )


def _check_options(args: argparse.Namespace):
    """``tfdist.check.CheckOptions`` from the flags, each checked (ConfigError: exit 2)."""
    import os

    from tfdist.check import CheckOptions, topology

    if args.script is None or not os.path.isfile(args.script):
        raise ConfigError(
            "check: script must be an existing Python file. Received: "
            f"script={args.script!r}. Usage: tfdist check [OPTIONS] script.py [ARGS...]"
        )
    for name, value, low in (("steps", args.steps, 1), ("timeout", args.timeout, 1e-9)):
        if value < low:
            raise ConfigError(f"check: --{name} must be positive. Received: --{name}={value!r}")
    if not args.tolerance >= 0:  # also refuses NaN
        raise ConfigError(
            f"check: --tolerance must be >= 0. Received: --tolerance={args.tolerance!r}"
        )
    topology.parse_topologies(
        args.topologies or topology.DEFAULTS, args.backend
    )  # names a bad item
    return CheckOptions(
        script=args.script,
        args=tuple(args.args),
        steps=args.steps,
        backend=args.backend,
        topologies=args.topologies or "",
        tolerance=args.tolerance,
        timeout=args.timeout,
        keep=args.keep,
    )


def _cmd_check(args: argparse.Namespace) -> int:
    # TensorFlow-free here: every run is a fresh process (tfdist.check.runner).
    from tfdist import check
    from tfdist.check import report

    options = _check_options(args)
    result = check.check(options, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(report.as_json(result), indent=2) if args.json else report.render(result))
    return result.exit_code


def _add_check(sub) -> None:
    check = sub.add_parser(
        "check",
        help="run a script's first training steps on 1 device, 2 devices and 2 workers "
        "(this machine's CPU) and say whether they train the same model",
        description="Run SCRIPT unchanged for the first --steps steps of its first fit on "
        "each topology (fresh processes on this machine's CPU; `N workers` through tfdist "
        "launch), compare the weights and the loss history with `1 device`, and show the "
        "likely causes of a difference with evidence (unsynchronized BatchNormalization, "
        "a hang, per-worker seeds or unsharded data). Exit code: 0 all equal, 1 a "
        "topology differs or hangs, 2 the script could not be run or stopped.",
        epilog="examples:\n  tfdist check train.py --epochs 3\n"
        "  tfdist check --backend jax --steps 10 --json train.py",
        formatter_class=_HelpFormatter,
    )
    check.add_argument(
        "--steps", type=int, default=20, help="training steps of the first fit to compare"
    )
    check.add_argument(
        "--backend",
        choices=("tensorflow", "jax"),
        default="tensorflow",
        help="the Keras backend of every run (KERAS_BACKEND)",
    )
    check.add_argument(
        "--topologies",
        default=None,
        metavar="LIST",
        help="comma-separated 'N devices' and 'N workers' (JAX: 'N processes'); 1 device, "
        "the reference, always runs (default: 1 device,2 devices,2 workers, or 2 processes)",
    )
    check.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="largest absolute difference still equal, per weight and per logged value",
    )
    check.add_argument("--timeout", type=float, default=300.0, help="seconds each run may take")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("--keep", metavar="DIR", help="keep each run's files and output in DIR")
    check.add_argument("script", nargs="?", metavar="SCRIPT", help="the training script")
    check.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script"
    )
    check.set_defaults(func=_cmd_check)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tfdist`` command (no TensorFlow import)."""
    parser = argparse.ArgumentParser(
        prog="tfdist",
        description="Distributed training of Keras 3 models with TensorFlow.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tfdist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    info = sub.add_parser(
        "info",
        help="show versions, devices, the strategy tfdist would use, and the cluster",
        description="Show versions, devices, the strategy `auto` picks (and its replica "
        "count), the cluster from TF_CONFIG/SLURM, and TFDS_DATA_DIR.",
        formatter_class=_HelpFormatter,
    )
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_cmd_info)
    _add_launch_parser(sub)
    _add_train(sub)
    _add_check(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code.

    Example:
        >>> main(["info", "--json"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args = _with_config(parser, args, argv)
        return args.func(args)
    except ConfigError as err:
        # A wrong tfdist setting (option, TFDIST_* variable, TF_CONFIG): one clear line.
        # Anything else is a bug or an unexpected failure and keeps its traceback.
        print(f"tfdist {args.command}: error: {err}", file=sys.stderr)
        return 2


def console_main() -> None:
    """Entry point of the ``tfdist`` console script."""
    sys.exit(main())
