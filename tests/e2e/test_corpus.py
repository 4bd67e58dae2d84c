"""The Keras examples' shapes (tests/corpus/), run unchanged, distributed, against one device.

Each corpus script is what a user writes from a Keras example (no tfdist, no strategy).
One process per topology runs them all (tests/corpus/run_all.py), started as a user starts
it, cold: ``python run_all.py`` (the reference, one device), ``TFDIST_CPU_DEVICES=2 python
-m tfdist.bootstrap run_all.py`` and ``python -m tfdist launch -n 2 run_all.py``, on
TensorFlow and on JAX (the scripts written with ``tf.GradientTape`` on TensorFlow only).
For every script x topology x backend: the model trained on every replica (2 in each
process), and its weights, logged history and outputs equal one device's within 1e-5, or
the script has a property that explains the difference (tools/docs/corpus_table.py's
``EXPECTED``) and they differ, or fail with the message given there. Under the bootstrap
and the launcher, the chief alone says once that unscoped models train on the job's.

``TFDIST_CORPUS_JSON=tools/results/corpus.json`` writes each backend's cells there (for
``python -m tools.docs.corpus_table --write``). One script run alone, cold, gives what it
gives inside the shared runner: the runner's shortcut changes nothing the test checks.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, cold_env, equivalence, tool_module

CORPUS = REPO / "tests" / "corpus"
RUNNER = str(CORPUS / "run_all.py")
TOPOLOGIES = {
    "1 device": ([], {}),
    "2 devices": (["-m", "tfdist.bootstrap"], {"TFDIST_CPU_DEVICES": "2"}),
    "2 workers": (["-m", "tfdist", "launch", "-n", "2"], {}),
}
PARTS = ("weights", "history", "outputs")
# What the chief alone says, once, when a script's first unscoped model takes the job's
# strategy or distribution (tfdist/unscoped.py).
ANNOUNCED = "tfdist: models this script builds outside any scope train on the job's"

sys.path.insert(0, str(CORPUS))
import record  # noqa: E402 - tests/corpus/record.py: reads what the scripts leave
import run_all  # noqa: E402 - tests/corpus/run_all.py: the scripts and which need TensorFlow

table = tool_module("docs.corpus_table")
checks = tool_module("docs.corpus_checks")


def _run(argv: list[str], script: str, where: Path, backend: str, **extra: str):
    """Runs ``python *argv script`` cold in ``where``; its records and errors by script,
    and its stderr."""
    out = where / "out"
    where.mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, *argv, script],
        cwd=where,
        env=cold_env(backend, CORPUS_OUT=str(out), **extra),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    found: dict[str, list] = {}
    for path in sorted(out.glob("*")):
        name, _ = path.stem.rsplit("-", 1)
        found.setdefault(name, []).append(
            record.load(path) if path.suffix == ".npz" else {"error": path.read_text()}
        )
    return found, proc.stderr


def _worst(reference: dict, runs: list) -> dict[str, float]:
    """The largest difference of the ``runs`` from ``reference`` in each part one holds."""
    return {
        part: max(equivalence.max_difference(reference[part], run[part]) for run in runs)
        for part in PARTS
        if reference[part] or runs[0][part]
    }


def _check(script: str, backend: str, topology: str, reference: dict, runs: list) -> dict:
    """One cell: asserts it as expected; what the JSON records of it."""
    expectation = table.expected(script, backend, topology)
    assert len(runs) == (2 if topology == "2 workers" else 1), f"one record per process: {runs}"
    if expectation is not None and expectation[0] == "error":
        for run in runs:
            assert re.search(expectation[2], run.get("error", "")), run
        return {"verdict": table.verdict({}, expectation), "worst": {}, "replicas": []}
    for run in runs:
        assert "error" not in run, run["error"]
        assert set(run["replicas"]) == {2}, f"trained on {run['replicas']} replicas"
    worst = _worst(reference, runs)
    for run in runs:
        for part in PARTS:
            if expectation is None and (reference[part] or run[part]):
                equivalence.assert_close(reference[part], run[part], table.TOLERANCE, part)
        if expectation is not None:
            together = {p: reference[p] for p in PARTS}
            equivalence.assert_differs(together, {p: run[p] for p in PARTS}, table.TOLERANCE)
    replicas = runs[0]["replicas"]
    return {"verdict": table.verdict(worst, expectation), "worst": worst, "replicas": replicas}


def _write(backend: str, cells: list[dict]) -> None:
    path = os.environ.get("TFDIST_CORPUS_JSON")
    if not path:
        return
    import keras
    import tensorflow as tf

    target = Path(path)
    results = json.loads(target.read_text()) if target.exists() else {"cells": []}
    versions = {"tensorflow": tf.__version__, "keras": keras.__version__}
    if backend == "jax":
        import jax

        versions["jax"] = jax.__version__
    kept = [c for c in results["cells"] if c["backend"] != backend]
    order = {name: i for i, name in enumerate(run_all.SCRIPTS)}
    results.update(
        scripts=run_all.SCRIPTS,
        tensorflow_only=sorted(run_all.TENSORFLOW_ONLY),
        cells=sorted(kept + cells, key=lambda c: (order[c["script"]], c["backend"], c["topology"])),
    )
    results.setdefault("versions_by_backend", {})[backend] = versions
    # Where and when each backend's cells were measured (the docs show figures from here).
    results.setdefault("measured_by_backend", {})[backend] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    merged = {**results["versions_by_backend"].get("tensorflow", {})}
    merged.update(results["versions_by_backend"].get("jax", {}))
    results["versions"] = ", ".join(f"{k} {v}" for k, v in merged.items())
    target.write_text(json.dumps(results, indent=1) + "\n")


@pytest.fixture(scope="module")
def corpus_runs(tmp_path_factory):
    """Each backend's runs, made once for the module's tests: ``corpus_runs(backend)`` is
    ``{topology: {script: [a record per process]}}``; ``corpus_runs.stderr[backend]`` holds
    each topology's stderr."""
    made: dict[str, dict] = {}
    stderr: dict[str, dict] = {}

    def runs(backend: str) -> dict:
        if backend not in made:
            base = tmp_path_factory.mktemp(f"corpus-{backend}")
            made[backend], stderr[backend] = {}, {}
            for topology, (argv, env) in TOPOLOGIES.items():
                where = base / topology.replace(" ", "-")
                made[backend][topology], stderr[backend][topology] = _run(
                    argv, RUNNER, where, backend, **env
                )
        return made[backend]

    runs.stderr = stderr  # type: ignore[attr-defined]
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_every_example_trains_on_every_replica_and_equals_one_device_or_says_why(
    backend, corpus_runs
):
    runs = corpus_runs(backend)
    scripts = run_all.wanted([], backend)
    assert sorted(runs["1 device"]) == sorted(scripts), "each script ran on one device"
    said = corpus_runs.stderr[backend]
    assert ANNOUNCED not in said["1 device"]  # plain python: no tfdist
    assert said["2 devices"].count(ANNOUNCED) == 1, said["2 devices"][-3000:]
    announced = [line for line in said["2 workers"].splitlines() if ANNOUNCED in line]
    assert len(announced) == 1 and announced[0].startswith("[w0] "), announced  # the chief
    cells, failures = [], []
    for script in scripts:
        (reference,) = runs["1 device"][script]
        assert "error" not in reference, f"{script} fails on one device: {reference['error']}"
        assert reference["replicas"] and set(reference["replicas"]) == {1}
        for topology in ("2 devices", "2 workers"):
            try:
                cell = _check(script, backend, topology, reference, runs[topology].get(script, []))
            except AssertionError as error:
                failures.append(f"{script} / {topology}: {str(error)[:600]}")
                continue
            cells.append({"script": script, "backend": backend, "topology": topology, **cell})
    if not failures:
        _write(backend, cells)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_a_script_alone_gives_what_it_gives_in_the_shared_runner(corpus_runs, tmp_path):
    """seq2seq.py, eleventh in the runner (after clear_session and ten other scripts), run
    alone in a cold process of its own on 2 devices: the same replicas, weights, history
    and outputs as inside the runner."""
    argv, env = TOPOLOGIES["2 devices"]
    alone, _ = _run(argv, str(CORPUS / "seq2seq.py"), tmp_path / "alone", "tensorflow", **env)
    (shared,) = corpus_runs("tensorflow")["2 devices"]["seq2seq"]
    (single,) = alone["seq2seq"]
    assert single["replicas"] == shared["replicas"] == [2]
    for part in PARTS:
        equivalence.assert_close(shared[part], single[part], table.TOLERANCE, part)


def test_the_corpus_table_is_generated_from_the_results():
    """tools/results/corpus.json holds a cell for every script x backend x topology, each
    with the verdict ``EXPECTED`` gives it now, and docs/corpus.md holds the table made
    from it (``python -m tools.docs.corpus_table --write``)."""
    results = json.loads(table.RESULTS.read_text())
    assert results["scripts"] == run_all.SCRIPTS
    assert results["tensorflow_only"] == sorted(run_all.TENSORFLOW_ONLY)
    cells = {(c["script"], c["backend"], c["topology"]): c for c in results["cells"]}
    wanted = {
        (script, backend, topology)
        for backend in table.BACKENDS
        for script in run_all.wanted([], backend)
        for topology in table.TOPOLOGIES
    }
    assert set(cells) == wanted
    for key, cell in cells.items():
        expectation = table.expected(*key)
        assert cell["verdict"] == table.verdict(cell["worst"], expectation), (key, cell)
        if expectation is None:
            assert max(cell["worst"].values()) <= table.TOLERANCE, (key, cell)
    page = REPO / "docs" / "corpus.md"
    assert table.markdown(results) in page.read_text(), "run python -m tools.docs.corpus_table"


def test_the_checks_recorded_verdicts_on_the_corpus_agree_with_its_results():
    """tools/results/corpus_checks.json (``python -m tools.docs.corpus_checks --run``) holds
    what ``tfdist check`` said of every corpus script on each backend it runs on. Each
    verdict agrees with the corpus's own results: equal where the script equals one device,
    differs with the cause of the script's property where it does not (``AGREES``), refused
    where there is no fit to measure; every compared topology trained on 2 replicas. This
    test reads the recorded runs; it does not run the check (13 scripts take many minutes)."""
    results = json.loads(checks.RESULTS.read_text())
    found = {(c["script"], c["backend"]) for c in results["cells"]}
    assert found == {(s, b) for b in table.BACKENDS for s in run_all.wanted([], b)}
    assert set(checks.AGREES) == set(table.PROPERTIES)
    for cell in results["cells"]:
        assert not checks.disagreements(cell), (
            cell["script"],
            cell["backend"],
            checks.disagreements(cell),
        )
        for topology in cell["topologies"]:
            if topology["status"] in ("equal", "differs"):
                assert topology["replicas"] == (1 if topology["topology"] == "1 device" else 2), (
                    cell
                )
    page = REPO / "docs" / "corpus.md"
    assert checks.markdown(results) in page.read_text(), (
        "run python -m tools.docs.corpus_checks --write"
    )
