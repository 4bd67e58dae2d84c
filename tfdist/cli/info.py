"""``tfdist info``: versions, devices, the strategy tfdist would use, and the cluster."""

from __future__ import annotations

import argparse
import json

from tfdist.cli.shared import HelpFormatter, quiet_tensorflow

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Prints the report (``--json``: as JSON); exit code 0."""
    quiet_tensorflow()
    from tfdist import info, startup
    from tfdist.core import quiet

    # It describes, never joins: under JAX, importing jax in a job's process (a TrainJob
    # pod, a launched worker) would otherwise register with the job's coordinator.
    startup.auto_strategy(False)

    with quiet.filtered_stderr():  # TensorFlow's C++ start-up lines, too
        report = info.report()
    print(json.dumps(report, indent=2) if args.json else info.render(report))
    return 0


def add_parser(sub) -> None:
    """Adds ``info`` to the ``tfdist`` subcommands ``sub``."""
    info = sub.add_parser(
        "info",
        help="show versions, devices, the strategy tfdist would use, and the cluster",
        description="Show versions, devices, the strategy `auto` picks (and its replica "
        "count), the cluster from TF_CONFIG/SLURM, and TFDS_DATA_DIR.",
        formatter_class=HelpFormatter,
    )
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=run)
