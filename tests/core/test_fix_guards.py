"""Fixes step aside instead of breaking: a missing or changed upstream target skips its fix
with one warning, and the process imports and trains on upstream's own code.

The simulations replace or delete each fix's targets in a fresh process *before* tfdist
applies anything (keras is imported first, then tfdist), as a newer upstream release
would present them.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from tfdist import compat
from tfdist.core import fix_registry, process, upstream, versions

from conftest import REPO, last_json_line, run_python, tool_module

# ------------------------------------------------------------------ unit: the guard


def test_every_target_is_recorded_and_every_private_name_goes_through_private():
    recorded = fix_registry.verified_fingerprints()
    required = {entry for entries in upstream.REQUIRED.values() for entry in entries}
    for fix in compat.FIXES:
        assert fix.targets, f"{fix.name} declares no targets"
        for target in fix.targets:
            if target.instance:
                assert target.entry in upstream.SOURCE_ATTRIBUTES, (fix.name, target.entry)
                continue
            assert target.entry in recorded, f"run tools/fix_fingerprints.py ({target.entry})"
            parts = target.entry.replace(":", ".").split(".")
            if any(part.startswith("_") for part in parts):
                assert target.entry in required, (fix.name, target.entry)


def test_the_installed_releases_pass_every_guard():
    # Nothing is skipped on the releases the suite runs on (CI installs the newest).
    assert {fix.name: fix_registry.guard(fix) for fix in compat.FIXES} == {
        fix.name: None for fix in compat.FIXES
    }


def test_fingerprints_file_has_this_environment(capsys):
    fix_fingerprints = tool_module("fix_fingerprints")
    assert fix_fingerprints.main(["--check"]) == 0, capsys.readouterr().out


def test_a_removed_method_is_named_and_nothing_is_raised(monkeypatch):
    # The scenario of a Keras release without BaseOptimizer._backend_apply_gradients.
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    fix = next(f for f in compat.FIXES if f.name == "keras_tf_gradient_accumulation")
    monkeypatch.delattr(BaseOptimizer, "_backend_apply_gradients")
    if "_backend_apply_gradients" in vars(TFOptimizer):  # the fix itself, if applied
        monkeypatch.delattr(TFOptimizer, "_backend_apply_gradients")
    assert fix_registry.guard(fix) == (
        "keras.src.backend.tensorflow.optimizer:TFOptimizer._backend_apply_gradients is gone"
    )


def test_a_changed_signature_and_a_missing_module_are_named(monkeypatch):
    from keras.src.callbacks import progbar_logger

    fix = next(f for f in compat.FIXES if f.name == "keras_tf_progbar_chief_only")
    monkeypatch.setattr(progbar_logger.ProgbarLogger, "set_params", lambda self, p, q=1: None)
    reason = fix_registry.guard(fix)
    assert reason.startswith(
        "keras.src.callbacks.progbar_logger:ProgbarLogger.set_params changed its signature "
        "to (self, p, q=1) (verified: (self, params))"
    )
    gone = fix_registry.Fix(
        "x", "s", lambda: True, lambda: None, targets=fix_registry.targets("no_such.mod:f")
    )
    assert fix_registry.guard(gone) == "no_such.mod:f is gone"


def _module(tmp_path, monkeypatch, name, source):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_instance_attributes_are_found_in_the_class_or_a_base(tmp_path, monkeypatch):
    _module(
        tmp_path,
        monkeypatch,
        "fake_upstream_a",
        """
        class Base:
            def __init__(self):
                self._counter: int = 0

        class Child(Base):
            def step(self):
                return self._counter == 1
        """,
    )
    found = fix_registry.targets("fake_upstream_a:Child._counter (instance)")
    renamed = fix_registry.targets("fake_upstream_a:Child._step_count (instance)")
    assert found[0].instance
    assert (
        fix_registry.guard(fix_registry.Fix("a", "s", lambda: True, lambda: None, targets=found))
        is None
    )
    assert fix_registry.guard(
        fix_registry.Fix("b", "s", lambda: True, lambda: None, targets=renamed)
    ) == ("fake_upstream_a:Child._step_count is no longer set by its class")


def test_outside_the_verified_range_the_code_must_be_the_code_verified(tmp_path, monkeypatch):
    module = _module(
        tmp_path,
        monkeypatch,
        "fake_upstream_b",
        '''
        def target(x):
            """Docstrings and comments do not count."""
            return x + 1  # a comment
        ''',
    )
    entry = "fake_upstream_b:target"
    record = fix_registry.record(fix_registry.Target(entry))
    monkeypatch.setattr(fix_registry, "_fingerprints_cache", {entry: {"keras 3.15": record}})
    monkeypatch.setattr(fix_registry.Target, "package", property(lambda self: "keras"))
    fix = fix_registry.Fix(
        "b", "s", lambda: True, lambda: None, targets=fix_registry.targets(entry)
    )
    monkeypatch.setattr(versions, "installed", lambda package: "3.99.0")
    assert fix_registry.guard(fix) is None  # the same code, newer release: still applies
    module.target = _module(
        tmp_path, monkeypatch, "fake_upstream_c", "def target(x):\n    return x + 2\n"
    ).target
    assert fix_registry.guard(fix) == (
        "fake_upstream_b:target in keras 3.99.0 is not the code verified on keras 3.11-3.15"
    )
    monkeypatch.setattr(versions, "installed", lambda package: "3.15.1")
    assert fix_registry.guard(fix) is None  # inside the range only the signature is checked


def test_a_fix_that_fails_half_way_is_rolled_back_and_warned_once(monkeypatch):
    class Owner:
        def first(self):
            return "upstream first"

        def second(self):
            return "upstream second"

    def apply():
        fix_registry.patch(Owner, "first", "broken", lambda original: lambda self: "patched")
        raise RuntimeError("half-way")

    fix = fix_registry.Fix("broken", "upstream misbehaves", lambda: True, apply)
    monkeypatch.setattr(compat, "FIXES", [fix])
    monkeypatch.setattr(process, "_STATE", process.ProcessState())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.apply_all(environ={}) == []
        assert compat.apply_all(environ={}) == []  # decided once per process
    assert Owner().first() == "upstream first"  # rolled back
    messages = [str(w.message) for w in caught if w.category is compat.FixSkippedWarning]
    assert len(messages) == 1
    assert messages[0].startswith(
        "tfdist: fix broken is skipped: applying it failed (RuntimeError: half-way). "
        "Without it: upstream misbehaves. The fix was verified on tensorflow"
    )
    assert compat.skipped() == {"broken": "applying it failed (RuntimeError: half-way)"}
    assert [row["state"] for row in compat.status()] == ["skipped"]


def test_a_guard_that_raises_is_a_skip_not_an_error(monkeypatch):
    def boom():
        raise ValueError("unreadable")

    monkeypatch.setattr(fix_registry, "_check_target", lambda target: boom())
    fix = fix_registry.Fix(
        "x", "s", lambda: True, lambda: None, targets=fix_registry.targets("a:b")
    )
    assert fix_registry.guard(fix) == "a:b could not be checked (ValueError: unreadable)"


# ------------------------------------------------------------------ simulations

# Replaces (or deletes) each fix's first target before tfdist is imported, then imports
# tfdist (which applies the fixes) and trains on two devices; prints the skip warnings
# and the training result.
_SIMULATION = """
import importlib, json, sys, warnings
import keras
{pre}

mode, plan = sys.argv[1], json.loads(sys.argv[2])
for name, entry in plan.items():
    module_name, _, path = entry.partition(":")
    owner = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    original = getattr(owner, attr, None)
    if original is None:  # gone already: another fix's target in the same class chain
        continue
    if mode == "missing":  # gone from the class that defines it (or the module)
        for cls in getattr(owner, "__mro__", (owner,)):
            if cls is not object and attr in vars(cls):
                delattr(cls, attr)
    else:
        def changed(*args, __original=original, **kwargs):
            return __original(*args, **kwargs)
        setattr(owner, attr, changed)

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import tfdist
    from tfdist import compat
    compat.apply_all()
names = [f.name for f in compat.FIXES if f.applies()]
skipped = [str(w.message) for w in caught if w.category.__name__ == "FixSkippedWarning"]
trained = None
if mode == "changed":
    import numpy as np
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x @ np.ones((4, 1), "float32")
    with tfdist.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    trained = {{"replicas": tfdist.num_replicas(), "loss": history.history["loss"]}}
print(json.dumps({{"names": names, "skipped": skipped, "status": compat.status(),
                  "trained": trained}}))
"""


def _simulate(mode: str, backend: str) -> dict:
    plan = {fix.name: next(t.entry for t in fix.targets if not t.instance) for fix in compat.FIXES}
    code = _SIMULATION.format(pre="import jax" if backend == "jax" else "import tensorflow")
    proc = run_python(
        f"import sys; sys.argv = ['sim', {mode!r}, {json.dumps(plan)!r}]\n" + code,
        KERAS_BACKEND=backend,
        TFDIST_CPU_DEVICES="2",
        JAX_NUM_CPU_DEVICES="2",
        timeout=240,
    )
    return last_json_line(proc.stdout)


def _assert_each_fix_skipped_once(result):
    assert result["names"], "no fix applies to this backend"
    for name in result["names"]:
        lines = [s for s in result["skipped"] if s.startswith(f"tfdist: fix {name} is skipped:")]
        assert len(lines) == 1, (name, result["skipped"])
    states = {row["name"]: row["state"] for row in result["status"]}
    assert {states[name] for name in result["names"]} == {"skipped"}


@pytest.mark.devices
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_changed_targets_skip_every_fix_and_training_still_works(backend):
    result = _simulate("changed", backend)
    _assert_each_fix_skipped_once(result)
    assert all("changed its signature to (*args, __original=" in s for s in result["skipped"])
    trained = result["trained"]
    assert trained["replicas"] == 2
    loss = trained["loss"]
    assert loss[-1] < loss[0]  # it trained, on upstream's own code


@pytest.mark.devices
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_missing_targets_skip_every_fix_and_import_still_works(backend):
    result = _simulate("missing", backend)
    _assert_each_fix_skipped_once(result)
    # A deleted method that a base class also defines (Trainer.__init__ -> object's) reads
    # as a changed signature.
    assert all(
        " is gone. Without it: " in s or " changed its signature to " in s
        for s in result["skipped"]
    )


# ------------------------------------------------------------------ retirement


def _marked_fixes() -> set[str]:
    """Fix names in ``@pytest.mark.upstream_failure(...)`` markers across the tests."""
    import ast

    names = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "upstream_failure"
            ):
                names.update(arg.value for arg in node.args if isinstance(arg, ast.Constant))
    return names


def test_every_fix_has_a_test_that_shows_its_upstream_failure():
    assert sorted(set(compat.fix_names()) - _marked_fixes()) == []
    # no stale names (a hook's marker shows what runs without it; hooks are not fixes)
    hooks = {hook.name for hook in compat.HOOKS}
    assert sorted(_marked_fixes() - set(compat.fix_names()) - hooks) == []


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "pytest-xdist"])
def test_a_failing_upstream_failure_test_names_the_fix_to_retire(tmp_path, workers):
    (tmp_path / "test_retired.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.upstream_failure("keras_some_fix")
            def test_upstream_still_fails():
                upstream_fails = False  # as if upstream had fixed the defect
                assert upstream_fails

            @pytest.mark.upstream_failure("keras_other_fix")
            def test_upstream_fails():
                pass
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "retire_plugin", "-p", "no:cacheprovider"]
        + workers,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO / "tests")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "fixes to check for retirement" in proc.stdout
    assert (
        "keras_some_fix: test_retired.py::test_upstream_still_fails failed. If upstream no "
        "longer shows the failure it reproduces, upstream fixed it: retire the fix"
    ) in proc.stdout
    assert "keras_other_fix" not in proc.stdout


def test_the_docs_fix_table_is_generated_from_the_records():
    fix_table = tool_module("fix_table")
    table = fix_table.markdown()
    assert table in (REPO / "docs" / "fixes.md").read_text(), (
        "run: python tools/fix_table.py --write"
    )
    assert all(f"`{name}`" in table for name in compat.fix_names())
