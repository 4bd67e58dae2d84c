"""The docstrings' examples run (doctest), so what a reader copies works.

Which modules need a framework is found, not listed: tests/scripts/docstring_examples.py
imports each tfdist module alone in a fresh child that refuses TensorFlow, JAX and Keras.
The quick test runs the examples of every module that imports without them (a docstring
whose examples import a framework is set aside); the logical-device tier runs every
example with the frameworks loaded. An example that cannot run in either (a cluster, a
GPU, a training script, files it names) is marked ``# doctest: +SKIP``, and SKIPPED below
says why, per module.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, SCRIPTS, child_env

PACKAGE = REPO / "tfdist"
EXAMPLES = REPO / "tfdist_examples"
RUNNER = SCRIPTS / "docstring_examples.py"

# Modules with `# doctest: +SKIP` examples, and why those cannot run in a test process.
_JOB = "needs a running multi-worker or multi-process job"
_FILES = "reads or writes checkpoints, models or files the example only names"
SKIPPED = {
    "tfdist": "trains under a strategy built for the example's model and data",
    "tfdist.backends": "answers with the backend of the process (KERAS_BACKEND)",
    "tfdist.backends.jax": "builds meshes over 2 x 2 devices and gathers from processes",
    "tfdist.backends.layouts": "models and layouts the example only names",
    "tfdist.backends.tensorflow": "answers from the devices and cluster; gathers from workers",
    "tfdist.backends.tf_plan": "devices fix at first use; SLURM's resolver needs srun",
    "tfdist.batchnorm": "patches Keras for good (install) and needs a model and a strategy",
    "tfdist.bootstrap": "runs a training script (train.py)",
    "tfdist.callbacks": "fits models on data the example only names",
    "tfdist.check": "runs a script (train.py) on 1 device, 2 devices and 2 workers",
    "tfdist.check.causes": "needs the verdicts and runs of a whole check",
    "tfdist.check.causes.data": "needs the verdicts and runs of a whole check",
    "tfdist.check.causes.model": "needs the verdicts and runs of a whole check",
    "tfdist.check.causes.outcome": "needs the verdicts and runs of a whole check",
    "tfdist.check.first_batch": "needs a model after fit and fit's first batch",
    "tfdist.check.model": "needs a trained model's weights",
    "tfdist.check.runner": "starts a script's runs in fresh processes",
    "tfdist.check.verdict": "needs two finished runs of a check",
    "tfdist.checkpoint": _FILES,
    "tfdist.checkpoint.agreement": _JOB,
    "tfdist.checkpoint.archive": _FILES,
    "tfdist.checkpoint.callback": _FILES,
    "tfdist.checkpoint.names": _FILES,
    "tfdist.checkpoint.preemption": "needs the coordination service of a multi-worker job",
    "tfdist.checkpoint.remote_orbax": "needs an s3:// bucket",
    "tfdist.checkpoint.restore": _FILES,
    "tfdist.checkpoint.rng": "needs a built model with an optimizer",
    "tfdist.checkpoint.sharded": "writes Orbax checkpoints of a model the example names",
    "tfdist.checkpoint.writer": _FILES,
    "tfdist.cli": "prints the machine's report (tfdist info)",
    "tfdist.compat": "patches Keras and TensorFlow for the rest of the process",
    "tfdist.compat.chief_checkpoints": "a path's position needs a checkpoint on disk",
    "tfdist.compat.clipping": "the answer depends on the installed Keras",
    "tfdist.compat.epoch_start": "the answer depends on the installed TensorFlow",
    "tfdist.compat.inputs.jax": _JOB,
    "tfdist.compat.partial_batches.jax": "iterating a dataset prints device placement noise",
    "tfdist.compat.partial_batches.tensorflow": "iterating a dataset prints device placement noise",
    "tfdist.compat.inputs.tensorflow": _JOB,
    "tfdist.core.atomic": _FILES,
    "tfdist.core.batch_order": "reads a dataset's batching from TensorFlow's graph",
    "tfdist.core.cross_replica": "needs an optimizer under a strategy or distribution",
    "tfdist.core.fix_registry": "patches for the rest of the process",
    "tfdist.core.full_epochs": "needs a dataset the example only names",
    "tfdist.core.quiet": "redirects the process's stderr",
    "tfdist.core.roles": "asks jax which process it is in a running job",
    "tfdist.core.shard_policy": "reads TFRecord files the example only names",
    "tfdist.core.startup_watch": "watches the ports of workers that are not started",
    "tfdist.core.storage": "needs a gs:// bucket",
    "tfdist.core.upstream": "resolves a private Keras name (its value is a function)",
    "tfdist.core.watchdog": "watches a collective of a running job",
    "tfdist.data": "reads MNIST (tensorflow_datasets) and fits a model",
    "tfdist.data.checks": "the answer depends on the installed TensorFlow and numpy",
    "tfdist.data.datasets": "reads MNIST (tensorflow_datasets)",
    "tfdist.data.epochs": "needs a source and a position holder the example only names",
    "tfdist.data.host": "places variables on the host of a strategy",
    "tfdist.data.memory": "reads a dataset into variables under a strategy",
    "tfdist.data.pipeline": "reads MNIST (tensorflow_datasets)",
    "tfdist.data.positions": "needs a pipeline in the middle of a fit",
    "tfdist.data.seeds": _JOB,
    "tfdist.data.sharding": "reads TFRecord files the example only names",
    "tfdist.distribute": "answers from the devices and cluster of the process",
    "tfdist_examples.job": _FILES,
    "tfdist_examples.mnist": "trains MNIST",
    "tfdist_examples.recipes": "builds models and reads MNIST",
    "tfdist.info": "reports the machine",
    "tfdist.launch": "starts worker processes",
    "tfdist.launch.elastic": "runs a node of an elastic job (its launcher and workers)",
    "tfdist.launch.namespace": "creates a network namespace",
    "tfdist.launch.rendezvous.etcd": "needs an etcd server (tests/etcd_server.py starts one)",
    "tfdist.launch.supervise": "starts worker processes",
    "tfdist.loops": _FILES,
    "tfdist.loops.checkpointer": _FILES,
    "tfdist.loops.jax": "shards over a mesh of 2 processes x 2 devices",
    "tfdist.loops.tensorflow": "runs steps under a strategy on data the example only names",
    "tfdist.saving": _FILES,
}


def _modules() -> list[str]:
    """Every tfdist module but ``tfdist.__main__`` (importing it runs the command), then
    those of the MNIST job beside the package (``tfdist_examples``)."""
    names = []
    for path in [*sorted(PACKAGE.rglob("*.py")), *sorted(EXAMPLES.rglob("*.py"))]:
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return [n for n in names if n != "tfdist.__main__"]


def _run(mode: str, timeout: float, **env: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(RUNNER), mode, *_modules()],
        env=child_env(**env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _failures(rows: list[dict]) -> str:
    return "\n".join(text for row in rows for text in row["failures"])


def test_the_examples_of_modules_without_a_framework_run():
    rows = _run("fresh", timeout=600)
    assert [row["module"] for row in rows] == _modules()
    assert not _failures(rows), _failures(rows)
    free = [row for row in rows if row["needs"] is None]
    # The probe finds both kinds; the framework-free examples are most of the lines run.
    assert "tfdist.core.cluster" in {r["module"] for r in free}
    assert "tfdist.data" not in {r["module"] for r in free}
    assert sum(row["lines"] for row in free) >= 120


def test_every_skipped_example_has_its_reason():
    marked = {
        name
        for name, path in zip(_modules(), _paths(), strict=True)
        if "doctest: +SKIP" in path.read_text()
    }
    assert marked == set(SKIPPED), (marked - set(SKIPPED), set(SKIPPED) - marked)


def _paths():
    for name in _modules():
        path = REPO.joinpath(*name.split("."))
        yield path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


@pytest.mark.devices
@pytest.mark.slow  # imports TensorFlow, Keras and JAX once, then every module
def test_every_example_runs_with_the_frameworks_loaded():
    rows = _run("framework", timeout=900, KERAS_BACKEND="tensorflow", TFDIST_CPU_DEVICES="2")
    assert [row["module"] for row in rows] == _modules()
    assert not _failures(rows), _failures(rows)
