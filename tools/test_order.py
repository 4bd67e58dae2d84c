"""Records each test file's seconds from a pytest junit XML, for the order CI runs them in.

pytest-xdist (``--dist loadfile``) hands whole test files to its two processes in
collection order. ``tests/conftest.py`` sorts the files by the seconds recorded here, the
longest first, so that the run does not end with one process busy on a long file while the
other waits. The figures come from a CI run's junit file (``.ci/run`` keeps one per run)::

    python -m tools.test_order /tmp/junit.xml          # writes tests/file_seconds.json

A file missing from the record (a new one) goes first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.test_processes import junit_seconds

RECORD = Path(__file__).resolve().parents[1] / "tests" / "file_seconds.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path, help="pytest's --junitxml file of a full run")
    parser.add_argument("--out", type=Path, default=RECORD, help=f"default: {RECORD}")
    args = parser.parse_args(argv)
    if not args.junit.is_file():
        parser.error(f"junit: no file at {args.junit}; pass pytest's --junitxml file")
    seconds = {f: round(s, 1) for f, s in sorted(junit_seconds(args.junit).items())}
    if not seconds:
        parser.error(f"junit: {args.junit} holds no test case")
    args.out.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"test_order: {len(seconds)} files, {sum(seconds.values()):.0f} s, into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
