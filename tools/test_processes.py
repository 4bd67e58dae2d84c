"""The processes each test file starts and the CPU they spend, from a test run's ledger.

Every Python child of the tests appends start and exit lines to the file named by
``TFDIST_TEST_LEDGER`` (tests/lean_imports/sitecustomize.py); ``.ci/run`` sets it and prints
this table after the tests. By hand::

    TFDIST_TEST_LEDGER=/tmp/ledger.jsonl python -m pytest tests/compat
    python tools/test_processes.py /tmp/ledger.jsonl            # a Markdown table
    python tools/test_processes.py /tmp/ledger.jsonl --top 10   # the 10 costliest files

A process killed (kill -9 in the fault tests) or ended by ``os._exit`` has no exit line:
it is counted under "no exit line" and its CPU is not in the sum.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def read_ledger(path: Path) -> list[dict]:
    """The ledger's records; a torn last line (a process killed mid-write) is skipped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def per_file(records: list[dict]) -> list[dict]:
    """One row per test file: processes started, with TensorFlow / jax, CPU seconds."""
    rows: dict[str, dict] = collections.defaultdict(
        lambda: {"processes": 0, "tensorflow": 0, "jax": 0, "no_exit": 0, "cpu_s": 0.0}
    )
    exited = {(r["pid"], r["test"]) for r in records if r.get("event") == "exit"}
    for record in records:
        test_file = record.get("test", "").split("::", 1)[0] or "(outside a test)"
        row = rows[test_file]
        if record.get("event") == "start":
            row["processes"] += 1
            row["no_exit"] += (record["pid"], record["test"]) not in exited
        elif record.get("event") == "exit":
            row["cpu_s"] += record.get("cpu_s", 0.0)
            row["tensorflow"] += bool(record.get("tensorflow"))
            row["jax"] += bool(record.get("jax"))
    table = [{"file": name, **row} for name, row in rows.items()]
    return sorted(table, key=lambda row: -row["cpu_s"])


def markdown(table: list[dict]) -> str:
    head = "| test file | processes | imported TF | imported jax | no exit line | CPU s |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for row in table:
        lines.append(
            f"| {row['file']} | {row['processes']} | {row['tensorflow']} | {row['jax']} "
            f"| {row['no_exit']} | {row['cpu_s']:.0f} |"
        )
    total = {
        k: sum(row[k] for row in table)
        for k in ("processes", "tensorflow", "jax", "no_exit", "cpu_s")
    }
    lines.append(
        f"| **all** | {total['processes']} | {total['tensorflow']} | {total['jax']} "
        f"| {total['no_exit']} | {total['cpu_s']:.0f} |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger", type=Path, help="the file TFDIST_TEST_LEDGER named")
    parser.add_argument("--top", type=int, default=0, help="only the N costliest files")
    args = parser.parse_args(argv)
    if not args.ledger.is_file():
        parser.error(f"ledger: no file at {args.ledger}; set TFDIST_TEST_LEDGER to it for the run")
    table = per_file(read_ledger(args.ledger))
    print(markdown(table[: args.top] if args.top > 0 else table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
