"""Faults the test jobs can inject, to show that the tests' checks catch them.

``TFDIST_TEST_FAULT`` (read here only, never by tfdist itself) names one fault:

- ``nan``: the job reports a NaN in a model's weights;
- ``one_device``: the job drops ``TFDIST_CPU_DEVICES`` and runs on one device while the
  test asked for more;
- ``inert_callback``: Keras callbacks under test are replaced by ones that do nothing;
- ``outside_distribution``: the job builds a model outside ``tfdist.scope()``, so that
  model trains on one device in a process that runs on several;
- ``late_resume``: a resumed run starts one optimizer step (and one batch) after the
  checkpoint it restored.

The jobs that honour them: the idiom matrix (tests/scripts/idioms_job.py: all but
``late_resume``), the world-size resume job (``late_resume``), the partial-batch and
steps_per_execution jobs and the JAX custom loop (``nan``, ``one_device``,
``outside_distribution``), the TensorFlow custom loop (``nan``, ``one_device``: TensorFlow
itself refuses a model built outside the strategy's scope there), the jax-inputs job
(``nan``, ``outside_distribution``) and the user-save job (``nan``, as a load that read one
bad value, and ``outside_distribution``: its workers launch with one device each, so
``one_device`` would change nothing), and the SLURM and Kubernetes job
(tests/scripts/slurm_train.py: ``nan`` and ``outside_distribution``; its tasks run on one
device each too), and the Ray Train job (``nan``, injected by tests/scripts/ray_faults.py
into the docs' script). tests/e2e/test_checks_catch_faults.py runs the jobs with each fault
and shows the matching check fails; tests/e2e/test_slurm.py, test_kubernetes.py and
test_ray.py do so for their engines' jobs, on their own clusters.

The equivalence jobs honour ``nan`` and the one topology fault their test's checks can
see: ``outside_distribution`` where the test asserts what each model trained on (the
no-harm job, tests/scripts/no_harm_job.py: each case's own strategy; fit_equivalence.py:
its model's variable type), ``one_device`` where it asserts the process's replicas (the
optimizer-build loop, the accumulation, clipping, BatchNormalization (``nan`` in every
variant but the one-device reference), epoch-start and jit_compile jobs; the jit_compile
job reports no trained weights, fit being refused under a strategy: its ``nan`` is one in
its predictions).
"""

from __future__ import annotations

import os

KNOWN = ("nan", "one_device", "inert_callback", "late_resume", "outside_distribution")
VARIABLE = "TFDIST_TEST_FAULT"


def active(name: str) -> bool:
    """Whether fault ``name`` is injected in this process."""
    if name not in KNOWN:
        raise ValueError(f"unknown fault {name!r}; known: {KNOWN}")
    chosen = os.environ.get(VARIABLE, "")
    if chosen and chosen not in KNOWN:
        raise ValueError(f"{VARIABLE}={chosen!r} is not one of {KNOWN}")
    return chosen == name
