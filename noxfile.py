"""Test sessions per release pair in tfdist's verified range (tfdist/core/versions.py).

CI runs the project's own test command on the newest releases its interpreter can install.
The others run on demand (pyenv provides the interpreters here):

    pip install nox
    nox -l                          # the sessions
    nox -s "compat(tf='2.20')"      # the oldest verified TensorFlow/Keras pair
    nox -s "jax(jax='0.10.2')"      # each verified jax release, on an interpreter it supports
    nox                             # every pair

Each compat session installs tfdist with the pinned pair and runs the tests that touch
what the fixes patch: the upstream failures each fix reproduces (test_compat), the private
names tfdist relies on (test_private), start-up in any statement order (test_startup),
tfdist's own callbacks (test_callbacks: learning-rate schedules, checkpoint file names),
the release range (test_versions), and the 1-device = N-device equivalence suites
(test_distribute, test_idioms, test_clipping, test_accumulation, test_keras_callbacks,
test_resume_world_size) with the test of their checks (test_checks_catch_faults).

Each jax session runs the JAX suites (JAX_TESTS). CI's newest-jax session runs them too
(CI_NEWEST_JAX_TESTS, with CI_NEWEST_JAX_OPTIONS: the mixed suites' JAX cells; .ci/run
reads both from here and docs/testing.md says which run where); the other test files with JAX
cells (JAX_CELLS_MAIN_STAGE_ONLY) run them in CI's main test command only, as every suite
does there, on the jax its interpreter installs.
"""

import os

import nox

# (tensorflow, keras): each TensorFlow minor with the Keras release current when it
# shipped. tfdist/core/versions.py's VERIFIED spans exactly these.
PAIRS = {
    "2.21": ("2.21.0", "3.15.1"),
    "2.20": ("2.20.0", "3.11.3"),
}
TESTS = [
    "tests/compat/test_compat.py",
    "tests/core/test_private.py",
    "tests/test_startup.py",
    "tests/test_distribute.py",
    "tests/test_callbacks.py",
    "tests/core/test_versions.py",
    "tests/e2e/test_idioms.py",
    "tests/compat/test_clipping.py",
    "tests/compat/test_accumulation.py",
    "tests/compat/test_keras_callbacks.py",
    "tests/e2e/test_resume_world_size.py",
    "tests/e2e/test_checks_catch_faults.py",
]

# jax release -> the interpreter it installs on (jax 0.11+ needs Python 3.12+).
JAX = {"0.10.2": "3.11", "0.11.2": "3.12", "0.12.0.1": "3.12"}
JAX_TESTS = [
    "tests/core/test_fix_guards.py",
    "tests/core/test_private.py",
    "tests/e2e/test_jax.py",
    "tests/data/test_data_jax.py",
    "tests/checkpoint/test_jax_checkpoint.py",
    "tests/checkpoint/test_sharded.py",
    "tests/compat/test_jax_inputs.py",
    "tests/e2e/test_jax_faults.py",
    "tests/backends/test_layouts.py",
    "tests/test_custom_loops.py",
    "tests/e2e/test_idioms.py",
]
# What CI's newest-jax session runs: the JAX suites (JAX_TESTS), with CI_NEWEST_JAX_OPTIONS.
CI_NEWEST_JAX_TESTS = [
    "tests/e2e/test_jax.py",
    "tests/core/test_fix_guards.py",
    "tests/core/test_private.py",
    "tests/compat/test_jax_inputs.py",
    "tests/data/test_data_jax.py",
    "tests/checkpoint/test_sharded.py",
    "tests/backends/test_layouts.py",
    "tests/checkpoint/test_jax_checkpoint.py",
    "tests/e2e/test_jax_faults.py",
    "tests/test_custom_loops.py",
    "tests/e2e/test_idioms.py",
]
# Test files with JAX cells (tests/project/test_docs.py's scan finds them: an import of jax,
# the backend name "jax" or a "jax ..." cell in the code) that CI runs on the jax of its main
# test command only, not in the newest-jax session.
JAX_CELLS_MAIN_STAGE_ONLY = [
    "tests/backends/test_backends.py",
    "tests/check/test_check.py",
    "tests/checkpoint/test_damage.py",
    "tests/checkpoint/test_object_store.py",
    "tests/compat/test_empty_replicas.py",
    "tests/compat/test_fix_names.py",
    "tests/compat/test_keras_callbacks.py",
    "tests/compat/test_no_harm.py",
    "tests/compat/test_partial_batches.py",
    "tests/compat/test_steps_per_execution.py",
    "tests/compat/test_upstream_keras.py",
    "tests/compat/test_user_saves.py",
    "tests/core/test_config.py",
    "tests/core/test_storage.py",
    "tests/data/test_global_batch.py",
    "tests/e2e/test_checks_catch_faults.py",
    "tests/e2e/test_corpus.py",
    "tests/e2e/test_elastic.py",
    "tests/e2e/test_kubernetes.py",
    "tests/e2e/test_ray_elastic.py",
    "tests/e2e/test_slurm.py",
    "tests/e2e/test_unchanged_scripts.py",
    "tests/examples/test_train_mnist.py",
    "tests/launch/test_launch_habits.py",
    "tests/project/test_benchmark.py",
    "tests/project/test_docs.py",
    "tests/project/test_lean_imports.py",
    "tests/project/test_notebooks.py",
    "tests/project/test_warm_start.py",
    "tests/test_barrier.py",
    "tests/test_batchnorm.py",
    "tests/test_info.py",
]
# The idiom suite's (and fix guards') TensorFlow cells, and the tests marked `tensorflow`,
# run in CI's main stage, not twice (tests/conftest.py: --backend deselects them).
CI_NEWEST_JAX_OPTIONS = ["--backend=jax"]

nox.options.reuse_existing_virtualenvs = True


def _env() -> dict[str, str]:
    return {k: os.environ[k] for k in ("TFDS_DATA_DIR",) if os.environ.get(k)}


@nox.session(python="3.11")
@nox.parametrize("tf", list(PAIRS))
def compat(session: nox.Session, tf: str) -> None:
    tensorflow, keras = PAIRS[tf]
    session.install("-e", ".[test]", f"tensorflow=={tensorflow}", f"keras=={keras}")
    # What the fixes were verified against on this pair (fingerprints.json).
    session.run("python", "tools/fix_fingerprints.py", env=_env())
    session.run("python", "-m", "pytest", *TESTS, *session.posargs, env=_env())


@nox.session
@nox.parametrize(("python", "jax"), [(python, jax) for jax, python in JAX.items()])
def jax(session: nox.Session, jax: str) -> None:
    session.install("-e", ".[test]", f"jax[cpu]=={jax}")
    # Arguments after `--` replace the default test list (CI runs a shorter one).
    session.run("python", "-m", "pytest", *(session.posargs or JAX_TESTS), env=_env())
