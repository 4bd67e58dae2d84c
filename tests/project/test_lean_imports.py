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
