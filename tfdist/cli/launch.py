"""``tfdist launch``: the parsed flags as ``tfdist.launch.LaunchOptions``, then the job.

The flags themselves are in ``launch_flags``, ``--config``/``--write-config`` in
``launch_config``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tfdist.cli import launch_config, launch_flags
from tfdist.cli.shared import HelpFormatter
from tfdist.core.config import UNSCOPED_MODELS_ENV, ConfigError  # a TensorFlow-free leaf

__all__ = ["add_parser", "launch_options", "run"]


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


def launch_options(args: argparse.Namespace):
    """``tfdist.launch.LaunchOptions`` from the parsed flags (it checks them)."""
    from tfdist import launch

    if args.script is None:
        raise ConfigError(
            "launch: missing the script to run. Received: no SCRIPT. "
            "Usage: tfdist launch -n N script.py [ARGS...] (or -m MODULE [ARGS...])."
        )
    hosts = tuple(h.strip() for h in args.hosts.split(",")) if args.hosts else None
    nnodes = args.nnodes if args.nnodes is not None else (len(hosts) if hosts else 1)
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


def run(args: argparse.Namespace) -> int:
    """Launches the job (``--write-config``: writes the options; ``--firewall print``)."""
    # TensorFlow-free: the launcher only builds environments and supervises processes.
    from tfdist import launch

    _configure_launch_log(args.verbose)
    if args.write_config:  # a config needs no script; its values are checked when used
        return launch_config.write_config(args)
    options = launch_options(args)
    if args.unscoped_models:  # the workers inherit the launcher's environment
        os.environ[UNSCOPED_MODELS_ENV] = args.unscoped_models
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


def add_parser(sub) -> None:
    """Adds ``launch`` and its flags to the ``tfdist`` subcommands ``sub``."""
    launch = sub.add_parser(
        "launch",
        help="run a training script as N workers on this host (TF_CONFIG set for each)",
        description=launch_flags.DESCRIPTION,
        epilog=launch_flags.EPILOG,
        formatter_class=HelpFormatter,
    )
    launch_flags.add_flags(launch)
    launch.set_defaults(func=run, launch_parser=launch)
