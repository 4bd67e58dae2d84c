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


def launch_options(args: argparse.Namespace, *, elastic: bool = False):
    """``tfdist.launch.LaunchOptions`` from the parsed flags; LaunchOptions checks them.

    Its ``TypeError`` (a value of the wrong type, from a ``--config`` file) is a
    ``ConfigError`` here: one line and exit code 2, as for any other bad option.
    ``elastic``: the options of each round's workers (the rounds set the nodes).
    """
    from tfdist.launch import LaunchOptions
    from tfdist.launch.rendezvous import static_nnodes

    return _checked(
        LaunchOptions.from_flags,
        nproc=args.nproc,
        target=args.script,
        hosts=None if elastic else args.hosts,
        nnodes=None if elastic else static_nnodes(args.nnodes),
        standalone=args.standalone,
        args=tuple(args.args),
        module=args.module,
        devices_per_worker=args.devices_per_worker,
        max_restarts=args.max_restarts,
        port=args.port,
        node_rank=args.node_rank,
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


def _checked(build, **fields):
    """``build(**fields)``; its ``TypeError`` (a wrong-typed ``--config`` value) becomes a
    ``ConfigError``: one line and exit code 2, as for any other bad option."""
    try:
        return build(**fields)
    except TypeError as err:
        raise ConfigError(str(err)) from None


def _elastic_options(args: argparse.Namespace):
    """``tfdist.launch.elastic.ElasticOptions`` from the parsed flags (it checks them)."""
    from tfdist.launch.elastic import ElasticOptions

    return _checked(
        ElasticOptions.from_flags,
        nnodes=args.nnodes,
        rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_conf=args.rdzv_conf,
        local_addr=args.local_addr,
        hosts=args.hosts,
        node_rank=args.node_rank,
        standalone=args.standalone,
    )


def run(args: argparse.Namespace) -> int:
    """Launches the job (``--write-config``: writes the options; ``--firewall print``)."""
    # TensorFlow-free: the launcher only builds environments and supervises processes.
    from tfdist import launch
    from tfdist.launch import elastic, network

    _configure_launch_log(args.verbose)
    if args.write_config:  # a config needs no script; its values are checked when used
        return launch_config.write_config(args)
    if args.unscoped_models:  # the workers inherit the launcher's environment
        os.environ[UNSCOPED_MODELS_ENV] = args.unscoped_models
    if elastic.wanted(args.nnodes, args.rdzv_endpoint):
        return elastic.run_elastic(launch_options(args, elastic=True), _elastic_options(args))
    options = launch_options(args)
    if args.firewall == "print":  # this node's nftables rules, for `| nft -f -`
        print(network.printed_firewall_rules(options), end="")
        return 0
    return launch.run(options)


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
