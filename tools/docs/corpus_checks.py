"""``tfdist check`` on each corpus script: its verdict per topology and the causes it names.

The corpus (tests/corpus/) is what users write from the Keras examples. ``--run`` runs
``python -m tfdist check --json SCRIPT`` on each script, on each backend it runs on, in a
fresh temporary directory, and writes what the check said to
``tools/results/corpus_checks.json`` (with the machine, the versions and the date).
``--write`` renders that file into docs/corpus.md. ``AGREES`` maps each property of
tools/docs/corpus_table.py's ``EXPECTED`` to the cause the check must name for it, so
tests/e2e/test_corpus.py can hold every recorded verdict to the corpus's own results.

    python -m tools.docs.corpus_checks --run                     # both backends (minutes)
    python -m tools.docs.corpus_checks --run --backend jax gan   # some of them
    python -m tools.docs.corpus_checks --write                   # the table in docs/corpus.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from tools import generated_block
from tools.docs import corpus_table

REPO = corpus_table.REPO
CORPUS = REPO / "tests" / "corpus"
RESULTS = REPO / "tools" / "results" / "corpus_checks.json"
BEGIN, END = "<!-- corpus checks: begin -->", "<!-- corpus checks: end -->"
TIMEOUT_S = 1800  # one script's check: 3 topologies and the re-runs a cause asks for

# A property of EXPECTED -> the causes, any one of which the check must name for it; None:
# the check must refuse to judge the script (exit 2), having found no fit to measure.
AGREES = {
    "dropout_per_replica": ("random_layers",),
    "unsynchronized_batchnorm": ("batchnorm",),
    "random_draws_per_replica": ("random_layers", "random_steps"),
    "augmentation_drawn_per_process": ("worker_data",),
    "batch_wide_sum": ("batch_sum",),
    "loop_outside_replica_context": None,
}


def _scripts(backend: str) -> list[str]:
    """The corpus scripts that run on ``backend`` (tests/corpus/run_all.py says which)."""
    spec = importlib.util.spec_from_file_location("corpus_run_all", CORPUS / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    return run_all.wanted([], backend)


def check_one(script: str, backend: str) -> dict:
    """What ``tfdist check --json`` says of one corpus script, run as a user runs it."""
    with tempfile.TemporaryDirectory(prefix="tfdist-corpus-check-") as where:
        env = {**os.environ, "CORPUS_OUT": os.path.join(where, "out")}
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "tfdist", "check", "--backend", backend, "--json",
             str(CORPUS / f"{script}.py")],
            cwd=where, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise RuntimeError(f"{script} ({backend}): no report\n{proc.stderr[-3000:]}") from None
    return cell(script, backend, report, proc.returncode, time.monotonic() - started)


def cell(script: str, backend: str, report: dict, exit_code: int, seconds: float) -> dict:
    """The part of a ``tfdist check --json`` report the results keep."""
    return {
        "script": script,
        "backend": backend,
        "exit_code": exit_code,
        "error": report.get("error"),
        "topologies": [
            {k: t.get(k) for k in ("topology", "status", "replicas", "processes")}
            | {"worst": t.get("worst_variable"), "difference": t.get("weight_difference")}
            for t in report.get("topologies", [])
        ],
        "causes": [c["cause"] for c in report.get("causes", [])],
        "seconds": round(seconds, 1),
    }


def run(backends: list[str], names: list[str]) -> dict:
    """Checks the scripts and merges them into ``RESULTS`` (other cells are kept)."""
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"cells": []}
    for backend in backends:
        chosen = [s for s in _scripts(backend) if not names or s in names]
        fresh = []
        for script in chosen:
            print(f"corpus_checks: {script} on {backend}", file=sys.stderr, flush=True)
            fresh.append(check_one(script, backend))
        done = {(c["script"], c["backend"]) for c in fresh}
        kept = [c for c in results["cells"] if (c["script"], c["backend"]) not in done]
        results["cells"] = kept + fresh
        results.setdefault("measured_by_backend", {})[backend] = _measured(backend)
    order = {name: i for i, name in enumerate(_scripts("tensorflow"))}
    backends = corpus_table.BACKENDS
    results["cells"].sort(key=lambda c: (order[c["script"]], backends.index(c["backend"])))
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    return results


def _measured(backend: str) -> dict:
    code = "import keras, tensorflow as tf; print(f'tensorflow {tf.__version__}, keras {keras.__version__}')"
    if backend == "jax":
        code += "; import jax; print(f'jax {jax.__version__}')"
    versions = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    ).stdout.split("\n")
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "python": platform.python_version(),
        "versions": ", ".join(v for v in versions if v),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _checked_as(backend: str, topology: str) -> str:
    """The check's name for a corpus topology: on JAX, 2 workers are "2 processes"."""
    return "2 processes" if backend == "jax" and topology == "2 workers" else topology


def disagreements(cell: dict) -> list[str]:
    """How a recorded check of one script disagrees with the corpus's expectations: every
    topology expected equal is "equal" (exit 0 when all are); one expected to differ
    "differs" and a cause that ``AGREES`` with its property is named; a loop the check
    cannot measure is refused (exit 2)."""
    wrong = []
    script, backend = cell["script"], cell["backend"]
    statuses = {t["topology"]: t["status"] for t in cell["topologies"]}
    for topology in corpus_table.TOPOLOGIES:
        asked = _checked_as(backend, topology)
        expectation = corpus_table.expected(script, backend, topology)
        if expectation is None:
            if statuses.get(asked) != "equal":
                wrong.append(f"{asked}: {statuses.get(asked)}, expected equal")
        elif expectation[0] == "error":
            if AGREES[expectation[1]] is None and cell["exit_code"] != 2:
                wrong.append(f"exit {cell['exit_code']}, expected 2 (no fit to measure)")
        else:
            if statuses.get(asked) != "differs":
                wrong.append(f"{asked}: {statuses.get(asked)}, expected differs")
            wanted = {c for p in expectation[1] for c in AGREES[p]}
            if not wanted & set(cell["causes"]):
                wrong.append(f"causes {cell['causes']}, expected one of {sorted(wanted)}")
    return wrong


def _status_text(cell: dict, asked: str) -> str:
    found = {t["topology"]: t for t in cell["topologies"]}.get(asked)
    if found is None:
        return "-"
    if found["status"] in ("equal", "differs"):
        return f"{found['status']} ({found['difference']:.1e}); replicas {found['replicas']}"
    return found["status"]


def markdown(results: dict | None = None) -> str:
    results = json.loads(RESULTS.read_text()) if results is None else results
    names = {"tensorflow": "TensorFlow", "jax": "JAX"}
    rows = [
        BEGIN,
        "| script | backend | 2 devices | 2 workers / processes | exit | causes named |",
        "|---|---|---|---|---|---|",
    ]
    for cell in results["cells"]:
        second = _checked_as(cell["backend"], "2 workers")
        causes = ", ".join(f"`{c}`" for c in cell["causes"]) or "none"
        if cell["exit_code"] == 2:
            causes = "refused: no fit or distributed batch to measure"
        rows.append(
            f"| `{cell['script']}.py` | {names[cell['backend']]} | "
            f"{_status_text(cell, '2 devices')} | {_status_text(cell, second)} | "
            f"{cell['exit_code']} | {causes} |"
        )
    rows.append("")
    rows.append(
        "The difference is the worst weight's, after the check's 20 steps of the first `fit`. "
        "Measured by `python -m tools.docs.corpus_checks --run`"
        + "".join(
            f"; {names[b]} with {m['versions']} on {m['machine']}, Python {m['python']}, {m['date']}"
            for b, m in sorted(results.get("measured_by_backend", {}).items())
        )
        + "."
    )
    rows.append(END)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="check the scripts (minutes each)")
    parser.add_argument("--backend", action="append", choices=corpus_table.BACKENDS)
    parser.add_argument("--write", action="store_true", help="replace the table in docs/corpus.md")
    parser.add_argument("scripts", nargs="*", help="only these corpus scripts (with --run)")
    args = parser.parse_args(argv)
    if args.run:
        run(args.backend or list(corpus_table.BACKENDS), args.scripts)
    table = markdown()
    if not args.write:
        print(table)
        return 0
    return generated_block.replace(corpus_table.PAGE, BEGIN, END, table, "corpus_checks")


if __name__ == "__main__":
    sys.exit(main())
