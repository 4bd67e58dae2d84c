"""tfdist.data.pipeline on Keras 3's JAX backend, in one process and in several.

Every process builds the same GLOBAL batches; Keras's ``DataParallel.distribute_dataset``
(what ``fit`` calls) gives each process its share of each one. The checks run what fit
iterates, in real processes: one process with 4 logical devices and ``tfdist launch -n 2
--devices-per-worker 2``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, SCRIPTS, child_env, last_json_line

pytestmark = [pytest.mark.jax, pytest.mark.devices]

SCRIPT = str(SCRIPTS / "jax_data_worker.py")
EXAMPLES = list(range(64))


def _run(command, **env):
    proc = subprocess.run(
        command,
        cwd=REPO,
        env=child_env(KERAS_BACKEND="jax", **env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def one_process():
    return last_json_line(_run([sys.executable, SCRIPT], TFDIST_CPU_DEVICES="4").stdout)


@pytest.fixture(scope="module")
def two_processes():
    launch = [sys.executable, "-m", "tfdist", "launch", "-n", "2", "--devices-per-worker", "2"]
    proc = _run([*launch, SCRIPT])
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith(("[w0] {", "[w1] {")):
            result = json.loads(line[5:])
            results[result["process"]] = result
    assert sorted(results) == [0, 1], proc.stdout[-3000:]
    return results[0], results[1]


def global_batches(first, second, key):
    """The global batches of each epoch: process 0's share, then process 1's."""
    return [
        [a + b for a, b in zip(e0, e1, strict=True)]
        for e0, e1 in zip(first[key], second[key], strict=True)
    ]


def test_each_process_gets_its_share_of_the_global_batch(two_processes):
    first, second = two_processes
    assert first["processes"] == second["processes"] == 2
    assert first["global_batch"] == 8  # 2 per replica x 4 replicas, over both processes
    assert first["declared"] == second["declared"] == 8  # 64 examples / 8, full epochs
    for key in ("seeded", "unseeded", "streamed", "evaluation"):
        for process in two_processes:
            assert all(len(step) == 4 for e in process[key] for step in e), key
        for epoch in global_batches(first, second, key):
            assert sorted(sum(epoch, [])) == EXAMPLES, key  # every example once per epoch


@pytest.mark.parametrize("key", ["seeded", "evaluation", "resumed"])
def test_two_processes_see_the_batches_of_one_process(one_process, two_processes, key):
    """1 process x 4 devices = 2 processes x 2 devices, batch for batch."""
    assert global_batches(*two_processes, key) == one_process[key]


def test_unseeded_pipelines_agree_on_one_shuffle(one_process, two_processes):
    """Each process seeds TensorFlow differently; process 0's draw is used by both."""
    first, second = two_processes
    epochs = global_batches(first, second, "unseeded")
    assert epochs == one_process["unseeded"]  # process 0 drew the same seed alone
    assert epochs[0] != epochs[1]  # a new order every epoch
    assert first["unseeded"] != second["unseeded"]


def test_a_resumed_epoch_then_full_epochs(one_process):
    """set_position(1, 3): epoch 1 from its 4th batch, then epoch 2 in full."""
    resumed, full = one_process["resumed"]
    assert [len(resumed), len(full)] == [5, 8]
    assert resumed == one_process["seeded"][1][3:]
    assert sorted(sum(full, [])) == EXAMPLES
