"""``tfdist check``: a script's first steps on 1 device, 2 devices and 2 workers, compared."""

from __future__ import annotations

import argparse
import json
import sys

from tfdist.cli.shared import HelpFormatter
from tfdist.core.config import ConfigError  # a TensorFlow-free leaf

__all__ = ["add_parser", "run"]


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


def run(args: argparse.Namespace) -> int:
    """Checks the script; prints the report; exit code 0 same, 1 differs, 2 not run."""
    # TensorFlow-free here: every run is a fresh process (tfdist.check.runner).
    from tfdist import check
    from tfdist.check import report

    options = _check_options(args)
    result = check.check(options, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(report.as_json(result), indent=2) if args.json else report.render(result))
    return result.exit_code


def add_parser(sub) -> None:
    """Adds ``check`` to the ``tfdist`` subcommands ``sub``."""
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
        formatter_class=HelpFormatter,
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
    check.set_defaults(func=run)
