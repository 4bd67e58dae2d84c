"""The ``tfdist`` command line: ``info``, ``launch``, ``train``, ``check``.

Parsing never imports TensorFlow, so ``tfdist --help`` answers at once; each command
imports what it needs when it runs. One module per command (``info``, ``launch``,
``train``, ``check``), each with ``add_parser(sub)`` and ``run(args)``; this module
assembles the parser and turns a ``ConfigError`` into one line and exit code 2.

Example:
    $ tfdist info --json
    $ tfdist launch -n 2 train.py --epochs 3
    $ tfdist check --steps 10 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tfdist import __version__
from tfdist.cli import check, info, launch, launch_config, train
from tfdist.cli.shared import HelpFormatter
from tfdist.core.config import ConfigError  # a TensorFlow-free leaf

__all__ = ["main", "build_parser", "console_main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tfdist`` command (no TensorFlow import)."""
    parser = argparse.ArgumentParser(
        prog="tfdist",
        description="Distributed training of Keras 3 models with TensorFlow.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tfdist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    info.add_parser(sub)
    launch.add_parser(sub)
    train.add_parser(sub)
    check.add_parser(sub)
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
        args = launch_config.with_config(parser, args, argv)
        return args.func(args)
    except ConfigError as err:
        # A wrong tfdist setting (option, TFDIST_* variable, TF_CONFIG): one clear line.
        # Anything else is a bug or an unexpected failure and keeps its traceback.
        print(f"tfdist {args.command}: error: {err}", file=sys.stderr)
        return 2


def console_main() -> None:
    """Entry point of the ``tfdist`` console script."""
    sys.exit(main())
