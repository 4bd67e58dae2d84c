"""tfdist under Ray Train, on a one-node Ray cluster of this machine.

The module starts one Ray cluster (tests/scripts/ray_cluster.py) inside a private network
namespace whose only interface is loopback, so no port Ray or TensorFlow opens exists
outside it; Ray's token and the runs' storage live under pytest's tmp_path, its temporary
files (sockets: short paths) in a /tmp folder removed at the end. Every test runs what docs/ray.md tells users to
run (the code block is read from the page) and compares the model with one process
running the same loop without Ray (tests/scripts/ray_reference.py):

* ``TensorflowTrainer`` with 2 workers equals one device, and each worker says it was one
  of 2 workers, 2 replicas in sync;
* a worker killed with ``kill -9`` mid-training: Ray restarts the workers
  (``FailureConfig(max_failures=1)``), ``make_or_restore`` resumes from the last step
  saved, and the run ends with the uninterrupted run's weights;
* a NaN injected into the trainer's last checkpoint (tests/scripts/ray_faults.py) fails
  the first test's check;
* JAX: ``JaxTrainer`` with 2 CPU workers, tfdist's coordinator read from the
  ``KERAS_DISTRIBUTION_*`` variables the loop sets, equals one process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import h5py
import pytest

from conftest import REPO, SCRIPTS, child_env, equivalence

# Ray is not in the test extra (docs/testing.md, "What runs where"): without it these tests skip,
# except in .ci/run's Ray stage (TFDIST_RAY_STAGE=1), which installs .[ray] and needs them.
if importlib.util.find_spec("ray") is None:
    if os.environ.get("TFDIST_RAY_STAGE"):
        pytest.fail("TFDIST_RAY_STAGE is set but ray is not installed: pip install -e '.[ray]'")
    pytest.skip(
        "needs Ray: pip install -e '.[ray]' (CI runs it in its Ray stage)", allow_module_level=True
    )

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]

DOCS = REPO / "docs" / "ray.md"
TOLERANCE = 1e-5
RUN_TIMEOUT_S = 420  # one trainer.fit, workers' TensorFlow import included, on 2 busy cores
START_TIMEOUT_S = 120  # the cluster's head node answering
WORKER_LINE = re.compile(
    r"\(RayTrainWorker pid=(\d+)[^)]*\)\S* worker (\d+) of (\d+), (\d+) replicas, from step (\d+)"
)


def docs_code(index: int = 0, language: str = "python") -> str:
    """The ``index``-th ``language`` code block of docs/ray.md."""
    blocks = re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), re.S)
    assert len(blocks) > index, f"docs/ray.md: no {language} block {index}"
    return blocks[index]


# ------------------------------------------------------------------ without a cluster


def test_ray_sets_legacy_keras_which_keras_3_alone_cannot_import():
    """Ray's TensorflowTrainer sets TF_USE_LEGACY_KERAS=1 in every worker. The worker
    imported TensorFlow before (Ray's own module imports it), so its ``tf.keras`` stays
    Keras 3; a process it starts inherits the variable, and there, without tf_keras,
    ``tf.keras`` fails to import."""
    code = """
import os, subprocess, sys, importlib.util
from ray.train.tensorflow import config
import tensorflow as tf
config._setup_tensorflow_environment(["127.0.0.1:1", "127.0.0.1:2"], 1)
print("legacy", os.environ["TF_USE_LEGACY_KERAS"], importlib.util.find_spec("tf_keras"))
print("worker", tf.keras.layers.Dense.__module__, flush=True)
child = "import tensorflow as tf; tf.keras.layers.Dense"
sys.exit(subprocess.run([sys.executable, "-c", child]).returncode)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=240
    )
    out = proc.stdout + proc.stderr[-3000:]
    assert "legacy 1 None" in proc.stdout, out
    assert "worker keras.src.layers" in proc.stdout, out
    assert proc.returncode != 0 and "ImportError: Keras cannot be imported" in proc.stderr, out


def test_onednn_banner_twice_is_tensorflows_own():
    """The oneDNN banner a Ray worker shows twice: ``import tensorflow`` alone prints it
    (if at all) from one process, whatever TF_CPP_MIN_LOG_LEVEL says: not Ray, not tfdist."""
    proc = subprocess.run(
        [sys.executable, "-c", "import tensorflow"],
        env=child_env(TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    banners = [line for line in proc.stderr.splitlines() if "oneDNN custom operations" in line]
    pids = {line.split()[2] for line in banners}  # glog's "I0000 00:00:TIME PID file:line]"
    assert proc.returncode == 0 and len(pids) <= 1, proc.stderr[-3000:]
    print(f"{len(banners)} banner line(s) from {len(pids)} process(es)")


# ------------------------------------------------------------------ the cluster


def _namespace_pids(inode: int) -> list[int]:
    """Processes whose network namespace is the cluster's (all of them started by it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                    found.append(int(entry))
            except OSError:
                pass
    return found


class RayCluster:
    """The module's Ray cluster: its address, and an environment to run drivers in it.
    ``holder`` and ``args``: the script that holds the cluster (tests/scripts) and its
    arguments after the temporary folder."""

    def __init__(self, root: Path, holder: str = "ray_cluster.py", args: tuple = ("4",)):
        from tfdist.launch.namespace import NamespaceUnavailable, PrivateNetwork

        try:
            self.net = PrivateNetwork.create()
        except NamespaceUnavailable as err:
            pytest.fail(f"Ray's tests run in a private network namespace: {err}", pytrace=False)
        self.root = root
        # Ray's sockets live in its temporary folder, and a Unix socket's path must stay
        # under 108 bytes: pytest's tmp_path (longer under xdist) is too deep for it.
        self.ray_dir = tempfile.mkdtemp(prefix="tfdist-ray-", dir="/tmp")
        self.env = child_env(
            HOME=root,  # Ray writes its token to ~/.ray/auth_token
            RAY_TMPDIR=self.ray_dir,
            RAY_AUTH_MODE="token",
            RAY_DEDUP_LOGS="0",  # every worker's lines reach the driver
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # the node's address is loopback
            PYTHONPATH=os.pathsep.join([str(SCRIPTS), str(REPO)]),
        )
        self.head = subprocess.Popen(
            [sys.executable, str(SCRIPTS / holder), self.ray_dir, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(root / "head.log", "w"),  # noqa: SIM115 - closed with the process
            text=True,
            env=self.env,
            preexec_fn=self.net.enter,
        )
        self.inode = os.stat(f"/proc/{self.head.pid}/ns/net").st_ino
        line = self._first_line(START_TIMEOUT_S)
        self.env["RAY_ADDRESS"] = json.loads(line)["address"]

    def _first_line(self, timeout: float) -> str:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.head.stdout.readline()))
        reader.start()
        reader.join(timeout)
        if not lines or not lines[0].startswith("{"):
            self.stop()
            log = (self.root / "head.log").read_text()[-3000:]
            pytest.fail(f"Ray's head node gave no address within {timeout:.0f} s:\n{log}")
        return lines[0]

    def command(self, text: str, timeout: float = START_TIMEOUT_S) -> dict:
        """Sends one command line to the holder; its JSON answer."""
        self.head.stdin.write(text + "\n")
        self.head.stdin.flush()
        return json.loads(self._first_line(timeout))

    def driver(self, script: Path, *args: str) -> subprocess.Popen:
        """Starts ``python script ARGS`` as a Ray driver of this cluster."""
        return subprocess.Popen(
            [sys.executable, str(script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=self.root,
            preexec_fn=self.net.enter,
        )

    def stop(self) -> None:
        """Shuts Ray down, then kills (by pid) whatever is left in its namespace."""
        if self.head.stdin and not self.head.stdin.closed:
            self.head.stdin.close()
        try:
            self.head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.head.kill()
            self.head.wait(timeout=30)
        # 90 s: under load, the agents of a node removed mid-test were still there after 30.
        deadline = time.monotonic() + 90
        while (left := _namespace_pids(self.inode)) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        self.net.close()
        shutil.rmtree(self.ray_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    cluster = RayCluster(tmp_path_factory.mktemp("ray"))
    yield cluster
    cluster.stop()
    assert not _namespace_pids(cluster.inode), "Ray processes outlived the cluster"


@pytest.fixture(scope="module")
def ray_train(tmp_path_factory) -> Path:
    """The documented TensorflowTrainer script."""
    path = tmp_path_factory.mktemp("script") / "ray_train.py"
    path.write_text(docs_code(0))
    return path


@pytest.fixture(scope="module")
def ray_train_jax(tmp_path_factory) -> Path:
    """The documented JaxTrainer script."""
    path = tmp_path_factory.mktemp("script") / "ray_train_jax.py"
    path.write_text(docs_code(1))
    return path


@pytest.fixture(scope="module")
def one_device(ray_train, tmp_path_factory) -> dict:
    """The documented TensorFlow loop in one process without Ray: its final weights."""
    return reference(ray_train, tmp_path_factory.mktemp("one_device"))


def reference(script: Path, directory: Path, epochs: int = 3) -> dict:
    """``script``'s loop of ``epochs`` epochs in one process without Ray
    (tests/scripts/ray_reference.py): its last checkpoint's weights."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "ray_reference.py"), str(script), str(directory)],
        env=child_env(PYTHONPATH=str(SCRIPTS)),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "worker 0 of 1, 1 replicas, from step 0" in proc.stdout
    return archive_weights(directory / f"ckpt-{epochs}.keras")


def archive_weights(path: Path) -> dict:
    """Every variable in a ``.keras`` archive, by its path in the archive (h5py, no Keras)."""
    out = {}
    with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as raw:
        with h5py.File(raw, "r") as weights:
            weights["layers"].visititems(
                lambda name, item: (
                    out.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None
                )
            )
    assert out, f"{path}: no weights"
    return out


def finish(
    proc: subprocess.Popen, lines: list[str], ray_dir: str, timeout: float = RUN_TIMEOUT_S
) -> dict:
    """Waits for a driver (its output collected into ``lines``); its result line. A
    failure shows the ends of the Ray workers' own logs too (gone after the module)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        pytest.fail(
            f"the Ray driver ran past {timeout} s:\n{''.join(lines)[-6000:]}{worker_logs(ray_dir)}"
        )
    text = "".join(lines)
    assert proc.returncode == 0, (
        f"the Ray driver exited {proc.returncode}:\n{text[-6000:]}{worker_logs(ray_dir)}"
    )
    results = [line for line in text.splitlines() if line.startswith('{"metrics"')]
    assert results, f"no result line:\n{text[-6000:]}"
    return json.loads(results[-1])


def worker_logs(ray_dir: str, tail: int = 15) -> str:
    """The last lines of each Ray worker's stderr log that says more than nothing: why an
    actor died ("Check failed", a signal, a traceback) is there, not in the driver's."""
    parts = []
    for path in sorted(Path(ray_dir).glob("session_*/logs/worker-*.err")):
        text = path.read_text(errors="replace").strip().splitlines()
        if text:
            parts.append(f"--- {path.name}:\n" + "\n".join(text[-tail:]))
    return "\n\nRay workers' logs:\n" + "\n".join(parts) if parts else ""


def collect(proc: subprocess.Popen) -> list[str]:
    """The driver's output, read in a thread into the returned (growing) list."""
    lines: list[str] = []
    threading.Thread(
        target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True
    ).start()
    return lines


def worker_lines(lines: list[str]) -> list[dict]:
    """The documented loop's "worker I of N, R replicas, from step S" lines, once each
    (Ray Train's print goes to the root logger and, where Ray wrapped ``sys.stdout``,
    to the stream too: each line reaches the driver twice)."""
    found = {tuple(map(int, m.groups())) for m in WORKER_LINE.finditer("".join(lines))}
    keys = ("pid", "worker", "workers", "replicas", "step")
    return [dict(zip(keys, values, strict=True)) for values in sorted(found)]


def assert_two_workers_equal(reference: dict, result: dict, lines: list[str]) -> None:
    """Both workers started from step 0 as 1 of 2 workers, 2 replicas, and the run's last
    checkpoint equals ``reference``."""
    workers = worker_lines(lines)
    assert sorted((w["worker"], w["workers"], w["replicas"], w["step"]) for w in workers) == [
        (0, 2, 2, 0),
        (1, 2, 2, 0),
    ], "".join(lines)[-4000:]
    assert result["metrics"]["epoch"] == 3
    equivalence.assert_close(
        reference, archive_weights(Path(result["checkpoint"]) / "ckpt-3.keras"), TOLERANCE
    )


def test_tensorflow_trainer_equals_one_device(ray_cluster, ray_train, one_device, tmp_path):
    proc = ray_cluster.driver(ray_train, str(tmp_path))
    lines = collect(proc)
    assert_two_workers_equal(one_device, finish(proc, lines, ray_cluster.ray_dir), lines)


def test_a_nan_in_the_last_checkpoint_fails_that_tests_check(
    ray_cluster, ray_train, one_device, tmp_path
):
    """The tests of the tests (tests/e2e/test_checks_catch_faults.py) for Ray: the
    documented trainer with a NaN put in each worker's model before its last checkpoint
    (tests/scripts/ray_faults.py) fails test_tensorflow_trainer_equals_one_device's check;
    the workers' lines pass first (the check compares the weights after them)."""
    driver = ray_cluster.driver(SCRIPTS / "ray_faults.py", str(ray_train), "nan", str(tmp_path))
    lines = collect(driver)
    result = finish(driver, lines, ray_cluster.ray_dir)
    with pytest.raises(equivalence.NotEquivalent, match=r"1 non-finite value\(s\) in the result"):
        assert_two_workers_equal(one_device, result, lines)


def wait_for_file(
    folder: Path, pattern: str, proc: subprocess.Popen, lines: list[str], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while not list(folder.glob(pattern)):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {pattern} in {folder}:\n{''.join(lines)[-6000:]}")
        time.sleep(0.1)


def test_worker_killed_mid_training_resumes_exactly(ray_cluster, ray_train, one_device, tmp_path):
    """kill -9 of the chief once a step checkpoint of epoch 2 is written (7 steps an
    epoch, 21 in all): Ray starts both workers again, the loop's make_or_restore resumes
    from the last step saved, and the run ends where the uninterrupted one does."""
    proc = ray_cluster.driver(ray_train, str(tmp_path))
    lines = collect(proc)
    wait_for_file(tmp_path / "ray_train" / "tfdist", "ckpt-2-*.keras", proc, lines, 300)
    first = worker_lines(lines)
    chief = [w["pid"] for w in first if w["worker"] == 0 and w["step"] == 0]
    assert len(chief) == 1, first
    os.kill(chief[0], signal.SIGKILL)
    result = finish(proc, lines, ray_cluster.ray_dir)

    workers = worker_lines(lines)
    started = sorted((w["worker"], w["workers"], w["replicas"]) for w in workers if w["step"] == 0)
    resumed = [w for w in workers if w["step"] > 0]
    assert started == [(0, 2, 2), (1, 2, 2)], workers
    assert sorted((w["worker"], w["workers"], w["replicas"]) for w in resumed) == started, workers
    assert len({w["step"] for w in resumed}) == 1, f"the workers resumed apart: {resumed}"
    assert 7 < resumed[0]["step"] < 21, resumed  # a step checkpoint of epoch 2 or 3
    assert chief[0] not in {w["pid"] for w in resumed}, "the killed worker did not restart"
    assert result["metrics"]["epoch"] == 3
    equivalence.assert_close(
        one_device, archive_weights(Path(result["checkpoint"]) / "ckpt-3.keras"), TOLERANCE
    )


@pytest.mark.jax
def test_jax_trainer_equals_one_process(ray_cluster, ray_train_jax, tmp_path):
    """JaxTrainer, 2 CPU workers joined by tfdist from KERAS_DISTRIBUTION_*: one process's
    model (the reference runs the same loop on JAX alone)."""
    proc = ray_cluster.driver(ray_train_jax, str(tmp_path / "ray"))
    lines = collect(proc)
    one_process = reference(ray_train_jax, tmp_path / "one_process")
    assert_two_workers_equal(one_process, finish(proc, lines, ray_cluster.ray_dir), lines)
