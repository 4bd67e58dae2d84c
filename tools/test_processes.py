"""The processes each test file starts and the CPU they spend, from a test run's ledger.

Every Python child of the tests appends start and exit lines to the file named by
``TFDIST_TEST_LEDGER`` (tests/lean_imports/sitecustomize.py); ``.ci/run`` sets it and prints
this table after the tests. By hand::

    TFDIST_TEST_LEDGER=/tmp/ledger.jsonl python -m pytest tests/compat
    python tools/test_processes.py /tmp/ledger.jsonl            # a Markdown table
    python tools/test_processes.py /tmp/ledger.jsonl --top 10   # the 10 costliest files
    python tools/test_processes.py /tmp/ledger.jsonl --junit /tmp/junit.xml  # + test time

With ``--junit`` (pytest's ``--junitxml`` of the same run) a column adds the seconds
pytest spent in each file's tests (setup, call and teardown), which is the file's time on
its test process.

A process killed (kill -9 in the fault tests) or ended by ``os._exit`` has no exit line:
it is counted under "no exit line" and its CPU is not in the sum.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import xml.etree.ElementTree as ET
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


def junit_seconds(path: Path) -> dict[str, float]:
    """Seconds per test file in a pytest junit XML (its ``classname`` is the dotted path,
    followed by a class name for tests in a class)."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(path).iter("testcase"):
        parts = case.get("classname", "").split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()  # a class name
        if parts:
            seconds["/".join(parts) + ".py"] += float(case.get("time") or 0.0)
    return seconds


def markdown(table: list[dict]) -> str:
    timed = any("test_s" in row for row in table)
    head = "| test file | processes | imported TF | imported jax | no exit line | CPU s |"
    lines = [
        head + (" test s |" if timed else ""),
        "|---|---:|---:|---:|---:|---:|" + ("---:|" if timed else ""),
    ]
    for row in table:
        lines.append(
            f"| {row['file']} | {row['processes']} | {row['tensorflow']} | {row['jax']} "
            f"| {row['no_exit']} | {row['cpu_s']:.0f} |"
            + (f" {row.get('test_s', 0.0):.0f} |" if timed else "")
        )
    total = {
        k: sum(row[k] for row in table)
        for k in ("processes", "tensorflow", "jax", "no_exit", "cpu_s")
    }
    lines.append(
        f"| **all** | {total['processes']} | {total['tensorflow']} | {total['jax']} "
        f"| {total['no_exit']} | {total['cpu_s']:.0f} |"
        + (f" {sum(row.get('test_s', 0.0) for row in table):.0f} |" if timed else "")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger", type=Path, help="the file TFDIST_TEST_LEDGER named")
    parser.add_argument("--top", type=int, default=0, help="only the N costliest files")
    parser.add_argument("--junit", type=Path, help="pytest's --junitxml of the same run")
    args = parser.parse_args(argv)
    if not args.ledger.is_file():
        parser.error(f"ledger: no file at {args.ledger}; set TFDIST_TEST_LEDGER to it for the run")
    if args.junit is not None and not args.junit.is_file():
        parser.error(f"--junit: no file at {args.junit}; pass pytest's --junitxml file")
    table = per_file(read_ledger(args.ledger))
    if args.junit is not None:
        seconds = junit_seconds(args.junit)
        known = {row["file"] for row in table}
        table += [
            {"file": f, "processes": 0, "tensorflow": 0, "jax": 0, "no_exit": 0, "cpu_s": 0.0}
            for f in seconds
            if f not in known
        ]
        for row in table:
            row["test_s"] = seconds.get(row["file"], 0.0)
        table.sort(key=lambda row: -row["test_s"])
    print(markdown(table[: args.top] if args.top > 0 else table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
