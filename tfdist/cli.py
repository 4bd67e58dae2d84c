"""The ``tfdist`` command line: ``info``, ``launch``, ``train``.

Parsing never imports TensorFlow, so ``tfdist --help`` answers at once; each command
imports what it needs when it runs.

Example:
    $ tfdist info --json
    $ tfdist launch -n 2 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from tfdist import __version__

__all__ = ["main", "build_parser", "console_main"]


def _quiet_tensorflow() -> None:
    # TensorFlow's C++ start-up chatter goes to stderr; keep warnings, drop INFO.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


def _cmd_info(args: argparse.Namespace) -> int:
    _quiet_tensorflow()
    from tfdist.strategy import describe

    report = describe()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    v, d, s, c = report["versions"], report["devices"], report["strategy"], report["cluster"]
    lines = [
        f"tfdist {v['tfdist']}  (python {v['python']}, tensorflow {v['tensorflow']}, "
        f"keras {v['keras']}, tensorflow-datasets {v['tensorflow_datasets']})",
        f"GPUs:           {len(d['gpus'])} {d['gpus'] or ''}".rstrip(),
        f"logical CPUs:   {len(d['cpus'])}"
        + (f"  (TFDIST_CPU_DEVICES={d['TFDIST_CPU_DEVICES']})" if d["TFDIST_CPU_DEVICES"] else ""),
        f"strategy:       {s['kind']}  replicas={s['num_replicas']}  "
        f"workers={s['num_workers']}  devices/worker={len(s['devices'])}",
    ]
    if c["source"] == "none":
        lines.append("cluster:        none (single process; chief)")
    else:
        lines.append(
            f"cluster:        {c['source']}  {c['num_workers']} worker(s), this is "
            f"{c['task_type']}:{c['task_index']}{' (chief)' if c['is_chief'] else ''}"
        )
    lines.append(f"TFDS_DATA_DIR:  {report['TFDS_DATA_DIR'] or '(unset: ~/tensorflow_datasets)'}")
    print("\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tfdist`` command (no TensorFlow import)."""
    parser = argparse.ArgumentParser(
        prog="tfdist",
        description="Distributed training of Keras 3 models with TensorFlow.",
    )
    parser.add_argument("--version", action="version", version=f"tfdist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    info = sub.add_parser(
        "info",
        help="show versions, devices, the strategy tfdist would use, and the cluster",
        description="Show versions, devices, the strategy `auto` picks (and its replica "
        "count), the cluster from TF_CONFIG/SLURM, and TFDS_DATA_DIR.",
    )
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_cmd_info)
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
        return args.func(args)
    except (ValueError, TypeError, RuntimeError, FileNotFoundError) as err:
        # Input and configuration errors: one clear line, not a traceback.
        print(f"tfdist {args.command}: error: {err}", file=sys.stderr)
        return 2


def console_main() -> None:
    """Entry point of the ``tfdist`` console script."""
    sys.exit(main())
