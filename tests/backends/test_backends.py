"""The backend seam: both backend modules implement ``tfdist.backends.Backend``, and no
feature module outside ``tfdist/backends/`` branches on the backend's name.

The modules import their framework (TensorFlow, jax) at import time, so they are
inspected in one fresh subprocess; the pytest process never imports jax.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from tfdist import backends

from conftest import last_json_line, run_python

PACKAGE = Path(__file__).resolve().parents[2] / "tfdist"

# ----------------------------------------------------------------- the modules implement it

# In the child: every Protocol member of both modules (a signature, or an attribute's
# value), plus the behaviour of the code the backends took over from the features.
_INSPECT = """
import importlib, inspect, json
import tensorflow as tf
from tfdist import backends
from tfdist.core import upstream

def describe(member):
    if not callable(member):
        return {"value": member}
    return {"params": [[p.name, p.kind.name, p.default is not p.empty]
                       for p in inspect.signature(member).parameters.values()]}

def raising(error):
    def call(*args):
        raise error
    return call

def store(module, set_name, get_name, exists, deadline, gone):
    seen = {}
    for label, name, error, call in (
        ("set_exists", set_name, exists, lambda: module.key_value_set("k", "v")),
        ("set_gone", set_name, gone, lambda: module.key_value_set("k", "v")),
        ("get_deadline", get_name, deadline, lambda: module.key_value_get("k", 0.5)),
        ("get_gone", get_name, gone, lambda: module.key_value_get("k", 0.5)),
    ):
        original = getattr(upstream, name)
        setattr(upstream, name, raising(error))
        try:
            seen[label] = repr(call())
        except backends.StoreGone as err:
            seen[label] = "StoreGone: " + str(err)
        finally:
            setattr(upstream, name, original)
    original = getattr(upstream, get_name)
    waited = []
    setattr(upstream, get_name, lambda key, ms: waited.append(ms) or "7")
    seen["get_value"] = [module.key_value_get("k", 0.5), waited]
    setattr(upstream, get_name, original)
    return seen

out = {}
for key in backends.SUPPORTED:
    module = importlib.import_module(f"tfdist.backends.{key}")
    out[key] = {
        "members": {n: describe(getattr(module, n)) for n in backends.INTERFACE
                    if hasattr(module, n)},
        "is_backend": isinstance(module, backends.Backend),
        "splits_uneven_batches": module.splits_uneven_batches(),
    }
out["tensorflow"]["store"] = store(
    importlib.import_module("tfdist.backends.tensorflow"),
    "tf_key_value_set", "tf_key_value_get",
    tf.errors.AlreadyExistsError(None, None, "exists"),
    tf.errors.DeadlineExceededError(None, None, "late"),
    tf.errors.UnavailableError(None, None, "gone"),
)
jax_backend = importlib.import_module("tfdist.backends.jax")
out["jax"]["store"] = store(
    jax_backend, "jax_key_value_set", "jax_key_value_get",
    RuntimeError("ALREADY_EXISTS: k"), RuntimeError("DEADLINE_EXCEEDED: k"),
    RuntimeError("UNAVAILABLE: gone"),
)
out["jax"]["one_process"] = [jax_backend.chief_value("shuffle seed", 5, 1.0),
                             jax_backend.gather_rows((1, 2, 3))]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def modules() -> dict:
    """What the child found in ``tfdist.backends.tensorflow`` and ``tfdist.backends.jax``."""
    proc = run_python(_INSPECT, KERAS_BACKEND="jax", timeout=300)
    return last_json_line(proc.stdout)


def _protocol_signature(member: str) -> inspect.Signature:
    signature = inspect.signature(getattr(backends.Backend, member))
    return signature.replace(parameters=list(signature.parameters.values())[1:])  # no self


def _signature(params: list) -> inspect.Signature:
    kind = inspect.Parameter
    return inspect.Signature(
        [kind(n, getattr(kind, k), default=None if d else kind.empty) for n, k, d in params]
    )


def _incompatible(wanted: inspect.Signature, have: inspect.Signature) -> list[str]:
    """How ``have`` fails to accept every call ``wanted`` allows (empty when it does)."""
    P = inspect.Parameter
    has = {p.kind for p in have.parameters.values()}
    positional = [
        p
        for p in have.parameters.values()
        if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    ]
    problems, used = [], set()
    for index, p in enumerate(wanted.parameters.values()):
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            if p.kind not in has:
                problems.append(f"takes no {p}")
            continue
        if p.kind == P.KEYWORD_ONLY:
            match = have.parameters.get(p.name)
            ok = (
                match is not None and match.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
            ) or P.VAR_KEYWORD in has
        else:
            match = positional[index] if index < len(positional) else None
            ok = (match is not None and match.name == p.name) or P.VAR_POSITIONAL in has
        if not ok:
            problems.append(f"has no parameter {p.name!r} where the Protocol has {p}")
        elif match is not None:
            used.add(match.name)
            if p.default is not P.empty and match.default is P.empty:
                problems.append(f"{match.name!r} has no default")
    for p in have.parameters.values():
        if (
            p.name not in used
            and p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
            and p.default is P.empty
        ):
            problems.append(f"needs {p.name!r}, which the Protocol does not pass")
    return problems


def test_interface_is_the_protocol_s_members():
    assert backends.INTERFACE[0] == "NAME"
    assert {"scope", "barrier", "chief_value", "key_value_get", "gather_rows"} <= set(
        backends.INTERFACE
    )
    for member in backends.INTERFACE[1:]:
        assert callable(getattr(backends.Backend, member)), member


@pytest.mark.jax
@pytest.mark.parametrize("key", backends.SUPPORTED)
def test_each_backend_module_implements_the_protocol(modules, key):
    found = modules[key]
    missing = [m for m in backends.INTERFACE if m not in found["members"]]
    assert not missing, f"tfdist.backends.{key} lacks {missing}"
    assert found["members"]["NAME"] == {"value": key}
    assert found["is_backend"]
    problems = {
        member: _incompatible(
            _protocol_signature(member), _signature(found["members"][member]["params"])
        )
        for member in backends.INTERFACE[1:]
    }
    assert not {m: p for m, p in problems.items() if p}, f"tfdist.backends.{key}: {problems}"


def test_the_signature_check_catches_a_mismatch():
    def wanted(name, timeout, explicit=None): ...

    def renamed(name, seconds, explicit=None): ...

    def no_default(name, timeout, explicit): ...

    def extra(name, timeout, explicit=None, *, more): ...

    def fine(name, timeout, explicit=None, *, more=1, **rest): ...

    sig = inspect.signature
    assert _incompatible(sig(wanted), sig(fine)) == []
    for bad in (renamed, no_default, extra):
        assert _incompatible(sig(wanted), sig(bad)), bad.__name__


@pytest.mark.jax
def test_key_value_errors_mean_the_same_on_both_backends(modules):
    """Set twice -> False; nothing within the timeout -> None; the store gone -> StoreGone."""
    for key, gone in (("tensorflow", "gone"), ("jax", "UNAVAILABLE: gone")):
        store = modules[key]["store"]
        assert store["set_exists"] == "False", key
        assert store["get_deadline"] == "None", key
        assert store["set_gone"] == store["get_gone"] == f"StoreGone: {gone}", key
        assert store["get_value"] == ["7", [500]], key  # seconds in, milliseconds to the store


@pytest.mark.jax
def test_capabilities_and_one_process_answers(modules):
    assert modules["tensorflow"]["splits_uneven_batches"] is True
    assert modules["jax"]["splits_uneven_batches"] is False  # Keras on JAX splits evenly
    assert modules["jax"]["one_process"] == [5, None]  # the chief's own value; nothing to gather


# ----------------------------------------------------------------- nothing branches on the name

# Calls that answer "which backend is this process on?"; comparing their answer (or a name
# bound to it anywhere in the file, or ``backends.get().NAME``) with a string literal is a
# branch on it.
_NAME_CALLS = ("backends.name", "config.keras_backend", "keras.backend.backend")

# Where such a branch is allowed, and why. (config.py, cli/ and launch/ also take part in
# choosing the backend at set-up, but never compare its name: they need no exception.)
ALLOWED = {
    "backends/": "the backend modules: the one place that knows each backend",
    "compat/": "Fix records are guarded per backend (on_keras_backend(...)) by design",
    "core/fix_registry.py": "the guards those Fix records use (on_keras_backend(...))",
    "startup.py": "installs hooks on the framework's import, before any backend module loads",
    "check/hook.py": "tfdist check's hook, run from startup.py's Keras-import hook, installs the"
    " custom-loop watcher of the framework the script trains with (tf.distribute's datasets"
    " or jax.jit)",
    "unscoped.py": "makes each framework's own process default the job's (tf.distribute's"
    " default strategy, keras.distribution's global distribution), as startup.py hooks each"
    " framework's import (TODO: a Backend member for the process default)",
    "info.py": "`tfdist info` (the bug-report template) reports each framework's own build",
    "check/first_batch.py": "tfdist check measures a gradient with each framework's own "
    "autodiff (tf.GradientTape, jax.grad over stateless_call), as check/hook.py watches each"
    " framework's own loop",
    "distribute.py": "tfdist.strategy() is TensorFlow-only by name; its guard says so (TODO:"
    " ask the backend whether it has a strategy)",
    "tfdist_examples/mnist.py": "the MNIST job (beside the package) picks tf.distribute or"
    " keras.distribution for --devices (TODO: move it behind the backend)",
}


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` of a Name/Attribute chain ('' for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _asks_the_name(node: ast.AST, bound: set[str]) -> str | None:
    """The source text of ``node`` if it is the backend's name, else None."""
    if isinstance(node, ast.Call):
        called = _dotted(node.func)
        if any(called == c or called.endswith("." + c) for c in _NAME_CALLS):
            return f"{called}()"
    if isinstance(node, ast.Attribute) and node.attr == "NAME" and isinstance(node.value, ast.Call):
        called = _dotted(node.value.func)
        if called == "backends.get" or called.endswith(".backends.get"):
            return f"{called}().NAME"
    if isinstance(node, ast.Name) and node.id in bound:
        return node.id
    return None


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _literals(e)]
    return []


def backend_name_branches(source: str, where: str) -> list[str]:
    """``where:line`` of every comparison of the backend's name with a string literal."""
    tree = ast.parse(source)
    bound = {  # names bound to the backend's name: `backend = backends.name()`
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _asks_the_name(node.value, set())
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        asked = [a for a in (_asks_the_name(s, bound) for s in sides) if a]
        literals = [v for s in sides for v in _literals(s)]
        if asked and literals:
            found.append(f"{where}:{node.lineno} compares {asked[0]} with {literals[0]!r}")
    return found


def _allowed(relative: str) -> bool:
    return any(relative == a or (a.endswith("/") and relative.startswith(a)) for a in ALLOWED)


def _scan() -> dict[str, list[str]]:
    """The branches in the package (paths inside it) and in the MNIST job beside it
    (``tfdist_examples/...``)."""
    found = {}
    examples = PACKAGE.parent / "tfdist_examples"
    for path in [*sorted(PACKAGE.rglob("*.py")), *sorted(examples.rglob("*.py"))]:
        inside = path.is_relative_to(PACKAGE)
        relative = path.relative_to(PACKAGE if inside else PACKAGE.parent).as_posix()
        where = f"tfdist/{relative}" if inside else relative
        branches = backend_name_branches(path.read_text(), where)
        if branches:
            found[relative] = branches
    return found


def test_no_feature_branches_on_the_backend_name():
    offenders = [b for rel, branches in _scan().items() if not _allowed(rel) for b in branches]
    assert not offenders, (
        "call tfdist.backends.get().<member> (add one to backends.Backend if needed) "
        f"instead of comparing the backend's name: {offenders}"
    )


def test_every_allowed_file_still_needs_its_exception():
    found = _scan()
    stale = [a for a in ALLOWED if not a.endswith("/") and a not in found]
    assert not stale, f"remove from ALLOWED in tests/backends/test_backends.py: {stale}"


def test_the_scan_sees_every_form_of_the_branch():
    source = """
import keras
from tfdist import backends, config
a = backends.name() == "jax"
b = "tensorflow" != keras.backend.backend()
c = config.keras_backend() in ("jax", "torch")
d = tfdist.backends.get().NAME == "jax"
backend = backends.name()
e = backend == "tensorflow"
f = backends.name() == other      # not a literal: a lookup, not a branch
g = backends.get().splits_uneven_batches()
"""
    found = backend_name_branches(source, "x.py")
    assert [line.split(" ")[0] for line in found] == [f"x.py:{n}" for n in (4, 5, 6, 7, 9)]
