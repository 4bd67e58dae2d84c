"""The test children's lean imports (tests/lean_imports/sitecustomize.py, docs/architecture.md):
only upstream's optional imports of jax and matplotlib are skipped, never a script's own."""

from __future__ import annotations

from conftest import last_json_line, run_python

PROBE = """
import json, sys
import tensorflow, keras
skipped = {name: name not in sys.modules for name in ("jax", "matplotlib")}
import jax, matplotlib.pyplot  # a script's own imports
print(json.dumps({"skipped": skipped, "own": [jax.numpy.ones(2).tolist(), matplotlib.__name__]}))
"""


def test_children_skip_upstreams_optional_imports_but_not_their_own():
    lean = last_json_line(run_python(PROBE, warm=False, KERAS_BACKEND="tensorflow").stdout)
    assert lean == {"skipped": {"jax": True, "matplotlib": True}, "own": [[1.0, 1.0], "matplotlib"]}
    full = last_json_line(
        run_python(
            PROBE, warm=False, KERAS_BACKEND="tensorflow", TFDIST_TEST_FULL_IMPORTS="1"
        ).stdout
    )
    assert full["skipped"] == {"jax": False, "matplotlib": False}, full


def test_ci_runs_the_ray_stage_and_the_newest_jax_session_with_full_imports():
    """Two CI stages run their children as users' processes are: every import upstream
    makes (docs/testing.md). The probe above shows what the variable turns off."""
    from conftest import REPO

    lines = (REPO / ".ci" / "run").read_text().splitlines()
    ray = [line for line in lines if "TFDIST_RAY_STAGE=1 python -m pytest" in line]
    newest_jax = [line for line in lines if '-s \\"$JAX_SESSION\\"' in line]
    assert len(ray) == 1 and len(newest_jax) == 1, (ray, newest_jax)
    for line in (*ray, *newest_jax):
        assert "TFDIST_TEST_FULL_IMPORTS=1 " in line, line
