"""Shared test helpers.

TensorFlow fixes its devices at first use, so tests that need logical CPU devices or
several workers run Python in a fresh subprocess (``run_python``) instead of in the
pytest process, which stays on TensorFlow's defaults.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from retire_plugin import (  # noqa: F401 - hooks: fixes whose upstream failure is gone
    pytest_configure,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"

# The one comparison of every equivalence (tests/scripts/equivalence.py), shared with the
# scripts the tests run as subprocesses.
sys.path.append(str(SCRIPTS))
import equivalence  # noqa: E402, F401 - re-exported: `from conftest import equivalence`
import warm_start  # noqa: E402 - tests/warm_start.py: jobs forked after the imports
from netns_lab import lab  # noqa: E402, F401 - the fixture of the multi-node tests

# Environment every child starts from: quiet TensorFlow, no cluster inherited from the shell.
_CLEAR = ("TF_CONFIG", "TFDIST_CPU_DEVICES", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID")

# Children skip two optional upstream imports tfdist never uses (tests/lean_imports says
# which and why): on os.environ, so that every child inherits it, however it is started.
LEAN_IMPORTS = str(Path(__file__).resolve().parent / "lean_imports")


def _with_lean_imports(pythonpath: str | None) -> str:
    parts = [p for p in (pythonpath or "").split(os.pathsep) if p]
    return os.pathsep.join(parts if LEAN_IMPORTS in parts else [*parts, LEAN_IMPORTS])


os.environ["PYTHONPATH"] = _with_lean_imports(os.environ.get("PYTHONPATH"))
# The suite's job scripts (tests/scripts/) build their one-device references outside any
# scope in the same process as the distributed run they compare: under the default
# TFDIST_UNSCOPED_MODELS=job those references would train on the job too. They run with
# upstream's one replica per process; tests/e2e/test_unchanged_scripts.py and the check's
# unscoped cases set job, as a user's process has it.
os.environ["TFDIST_UNSCOPED_MODELS"] = "local"
# `tfdist launch`'s workers fork from this process's warm process too (tests/warm_python).
os.environ.update(warm_start.LAUNCH_ENV)


def child_env(**overrides: str) -> dict[str, str]:
    """os.environ without cluster settings, plus ``overrides`` (None values remove a key)."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEAR}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    if "PYTHONPATH" in overrides:
        env["PYTHONPATH"] = _with_lean_imports(env.get("PYTHONPATH"))
    return env


def cold_env(backend: str, *, path: tuple = (), **extra: str) -> dict[str, str]:
    """A user's environment for ``backend``: no warm launcher python, no lean-import finder,
    models built outside any scope on the job (a user's default), and the repository as the
    installed tfdist (on PYTHONPATH, so that the process may start in any directory), then
    the folders of ``path``."""
    env = child_env(
        TFDIST_LAUNCH_PYTHON=None, KERAS_BACKEND=backend, TFDIST_UNSCOPED_MODELS="job", **extra
    )
    env["PYTHONPATH"] = os.pathsep.join(map(str, (REPO, *path)))
    return env


def run_python(
    code: str, *, timeout: float = 180, check: bool = True, warm: bool = True, **env
) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh process; fails the test with its output on error.

    By default the process is forked from one that imported TensorFlow and Keras already
    (tests/warm_start.py; a job whose environment changes an import-time variable starts
    cold by itself). ``warm=False``: a fresh interpreter, for tests of how a process
    starts (what it imports, in which order, what it prints while importing).
    """
    if warm:
        proc = warm_start.run(
            ["-c", textwrap.dedent(code)],
            env=child_env(**env),
            base_env=child_env(),
            cwd=REPO,
            timeout=timeout,
        )
    else:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=child_env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )
    if check and proc.returncode != 0:
        pytest.fail(
            f"child exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def popen_python(*argv: str, warm: bool = True, **env):
    """``python *argv`` started in the background from the repository, output captured:
    a ``subprocess.Popen``, or its warm twin (tests/warm_start.py) with ``warm=True``."""
    if warm:
        return warm_start.popen(list(argv), env=child_env(**env), base_env=child_env(), cwd=REPO)
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=REPO,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def launch_cli(*argv: str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """``python -m tfdist launch *argv`` from the repository, output captured; its
    workers fork from the warm process (tests/warm_python)."""
    child = child_env(**env)
    warm_start.prepare(child, child_env())
    return subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", *argv],
        cwd=REPO,
        env=child,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tool_module(name: str):
    """A module of tools/: ``"bench.launcher"`` is tools.bench.launcher. fix_table and
    fix_fingerprints run as scripts and import their sibling generated_block, so for a name
    without a dot tools/ is on the path meanwhile."""
    import importlib

    if "." in name:
        return importlib.import_module(f"tools.{name}")
    tools = str(REPO / "tools")
    sys.path.insert(0, tools)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(tools)


def tagged_reports(stdout: str, tag: str, rank_key: str) -> dict[int, dict]:
    """Each worker's ``TAG {json}`` line of a job's ``stdout`` (the launcher prefixes
    ``[wN] ``), by the worker rank the report names under ``rank_key``."""
    import json

    found = {}
    for line in stdout.splitlines():
        if f"{tag} " in line:
            text = line[line.index(f"{tag} ") + len(tag) + 1 :]
            try:
                report = json.loads(text)
            except ValueError as err:
                pytest.fail(
                    f"a {tag} line that is not JSON ({err}): {text[:300]} ... {text[-300:]}"
                )
            found[report.get(rank_key, 0)] = report
    return found


def last_json_line(text: str):
    """The last line of ``text`` that parses as JSON (children print results that way)."""
    import json

    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") or line.startswith("["):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise AssertionError(f"no JSON line in output:\n{text[-3000:]}")


# MNIST (tensorflow_datasets' prepared copy): one rule for every test that reads it, marked
# ``@pytest.mark.mnist``. In CI (CI=true) a missing data set fails the test; elsewhere the
# test skips, always with the reason below.
MNIST_DIR = Path(os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets").expanduser()
MNIST_ON_DISK = (MNIST_DIR / "mnist").is_dir()
MNIST_MISSING = f"needs MNIST on disk: no {MNIST_DIR / 'mnist'} (set TFDS_DATA_DIR)"


def pytest_addoption(parser):
    parser.addoption(
        "--backend",
        choices=("tensorflow", "jax"),
        help="deselect the cells of tests parametrized by `backend` that run another "
        "backend (CI's newest-jax session runs the mixed suites' JAX cells: noxfile.py)",
    )


# Each test file's seconds in a full run (python -m tools.test_order writes it from a junit).
FILE_SECONDS = Path(__file__).resolve().parent / "file_seconds.json"


def _longest_files_first(items) -> None:
    """Sorts ``items`` by their file's recorded seconds, longest first, files not recorded
    before them; a file's tests keep their order. pytest-xdist then hands the long files out first (``--dist loadfile
    --no-loadscope-reorder``), so no long file starts when the other process is nearly
    done. Only the order changes: every test runs, in a fresh file scope, as before."""
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    if not seconds:
        return
    # A file not in the record yet (a new one, often a long end-to-end one) goes first.
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], float("inf")))


def pytest_collection_modifyitems(config, items):
    """The longest files first (``_longest_files_first``). ``--backend B``: a test
    parametrized with another ``backend``, and with ``--backend jax`` a test marked
    ``tensorflow``, is deselected (it runs in the session for that backend), never
    skipped."""
    _longest_files_first(items)
    wanted = config.getoption("--backend")
    if wanted is None:
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        other = params.get("backend", wanted) != wanted
        other = other or (wanted == "jax" and item.get_closest_marker("tensorflow") is not None)
        (drop if other else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_setup(item):
    if item.get_closest_marker("mnist") is not None and not MNIST_ON_DISK:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI: {MNIST_MISSING}", pytrace=False)
        pytest.skip(MNIST_MISSING)


@pytest.fixture(autouse=True)
def _no_inherited_cluster(monkeypatch):
    for key in _CLEAR:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on 127.0.0.1 (tests/object_store.py), one per test module; ended,
    its process killed if need be, after the module's last test."""
    import object_store

    with object_store.S3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server, request):
    """An empty bucket of its own on the module's S3 server: ``.url(path)`` gives
    ``s3://...`` URLs, ``.env`` what a job needs to reach them (credentials, region,
    ``AWS_ENDPOINT_URL``), ``.fs`` an s3fs filesystem for the test's own reads and writes."""
    import re

    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-")
    return s3_server.create_bucket(f"t{next(_BUCKETS)}-{name}")


_BUCKETS = itertools.count()
