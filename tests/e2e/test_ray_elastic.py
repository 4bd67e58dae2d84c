"""An elastic Ray Train job loses a node for good, then gets it back, and ends exact.

The cluster (tests/scripts/ray_elastic_cluster.py) is a head and two worker nodes of one
CPU each, so each node hosts one Train worker; it runs in a private network namespace
with loopback only, as tests/e2e/test_ray.py's. The job is docs/elastic.md's script
(``ScalingConfig(num_workers=(2, 3))``, ``FailureConfig(max_failures=3)``), run through
tests/scripts/ray_elastic_driver.py, whose chief logs each worker group's size, resumed
step and first step. Its model (Dense and synchronized BatchNormalization, a cosine
schedule by step) trains 250 examples in global batches of 24: the last batch of each
epoch is partial (10 examples). The uninterrupted run is the same loop in one process
(tests/scripts/ray_reference.py). The test runs the page's TensorFlow script
(``TensorflowTrainer``), then its JAX one (``JaxTrainer``, each group naming its own JAX
coordinator), on the same cluster.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_ray import (
    TOLERANCE,
    RayCluster,
    _namespace_pids,
    archive_weights,
    collect,
    finish,
    reference,
    worker_lines,
)

from conftest import REPO, SCRIPTS, equivalence

# Three worker groups start (TensorFlow imported in each worker each time) and a node
# joins: over pyproject's 600 s per test on 2 busy cores.
pytestmark = [pytest.mark.multiworker, pytest.mark.slow, pytest.mark.timeout(2400)]

DOCS = REPO / "docs" / "elastic.md"
EPOCHS = 4
PACE_BELOW_S = 2.0  # each step of a group below 3 workers: still training when the node is back
STAGE_TIMEOUT_S = 600  # a cluster and 3 workers importing TensorFlow, on 2 busy cores


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = RayCluster(
        tmp_path_factory.mktemp("ray_elastic"), "ray_elastic_cluster.py", ("2", "1")
    )
    yield cluster
    cluster.stop()
    assert not _namespace_pids(cluster.inode), "Ray processes outlived the cluster"


# The code blocks of docs/elastic.md's "Ray Train" section, in order.
BLOCKS = {"tensorflow": 1, "jax": 2}


@pytest.fixture(params=list(BLOCKS))
def script(request, tmp_path_factory) -> Path:
    """The ``request.param`` backend's code block of docs/elastic.md's "Ray Train" section."""
    text = DOCS.read_text()
    start = text.index("\n## Ray Train\n")
    end = text.find("\n## ", start + 1)
    blocks = text[start : end if end > 0 else None].split("```python\n")
    path = tmp_path_factory.mktemp("script") / f"ray_elastic_{request.param}.py"
    path.write_text(blocks[BLOCKS[request.param]].split("```")[0])
    return path


def attempts(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def controller_log(ray_dir: str, tail: int = 25) -> str:
    """The last lines of Ray Train's controller log: its decisions (restart, resize)."""
    found = sorted(Path(ray_dir).glob("session_*/logs/train/ray-train-app-controller-*.log"))
    lines = found[-1].read_text(errors="replace").splitlines()[-tail:] if found else []
    return "\n\nRay Train's controller:\n" + "\n".join(lines)


def wait_until(condition, what: str, cluster, proc, lines, timeout=STAGE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            log = controller_log(cluster.ray_dir)
            pytest.fail(f"{what}, not seen:\n{''.join(lines)[-6000:]}{log}")
        time.sleep(0.2)


def test_a_node_lost_for_good_then_back_ends_equal(cluster, script, tmp_path):
    """3 workers; once a step checkpoint of epoch 2 is written, one worker node dies for
    good (raylet and processes killed at once): Ray restarts the group on the 2 nodes
    left, which resume from the newest checkpoint; a node then joins again and the group
    grows back to 3 at Ray's next resize, resuming the same way. The run ends with the
    weights of one process that lost nothing, at the same global batch."""
    log = tmp_path / "attempts.jsonl"
    storage = tmp_path / "storage"
    driver = SCRIPTS / "ray_elastic_driver.py"
    proc = cluster.driver(driver, str(script), str(log), "3", str(PACE_BELOW_S), str(storage))
    lines = collect(proc)
    checkpoints = storage / "ray_elastic" / "tfdist"
    wait_until(
        lambda: list(checkpoints.glob("ckpt-2-*.keras")),
        "a checkpoint of epoch 2",
        cluster,
        proc,
        lines,
    )
    removed = cluster.command("remove")
    wait_until(lambda: len(attempts(log)) >= 2, "a group on the 2 nodes left", cluster, proc, lines)
    added = cluster.command("add")
    result = finish(proc, lines, cluster.ray_dir, timeout=2 * STAGE_TIMEOUT_S)

    seen = attempts(log)
    print("attempts:", json.dumps(seen, indent=1))
    assert [(a["workers"], a["replicas"]) for a in seen] == [(3, 3), (2, 2), (3, 3)], seen
    first, shrunk, grown = seen
    assert first["from_step"] == 0, seen
    assert 11 < shrunk["from_step"] < grown["from_step"], seen  # steps 12-22: epoch 2
    assert grown["first_step_at"] > added["at"], (added, seen)
    grow = grown["first_step_at"] - added["at"]
    print(f"from the node's return to the first step on 3 workers: {grow:.1f} s")
    recovery = shrunk["first_step_at"] - removed["at"]
    print(f"from the node's loss to the first step on 2 workers: {recovery:.1f} s")
    assert result["metrics"]["epoch"] == EPOCHS
    workers = worker_lines(lines)
    assert {(w["workers"], w["step"]) for w in workers} == {
        (3, 0),
        (2, shrunk["from_step"]),
        (3, grown["from_step"]),
    }, workers
    one_process = reference(script, tmp_path / "one_process", EPOCHS)
    equivalence.assert_close(
        one_process, archive_weights(Path(result["checkpoint"]) / f"ckpt-{EPOCHS}.keras"), TOLERANCE
    )
