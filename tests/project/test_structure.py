"""The package's shape: imports flow one way, functions stay short, private names stay put.

These are the rules a newcomer can rely on (README, "Architecture"); each failure names the
module or function that broke one.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tfdist"
# The MNIST job `tfdist train mnist` runs: apart from the layers, held to the same rules.
EXAMPLES = PACKAGE.parent / "tfdist_examples"
MAX_FUNCTION_LINES = 60

# Layers, lowest first: a module may import only from its own layer's leaves or below.
LAYERS = [
    {"core"},  # the floor: validation, knobs, process state, upstream names, atomic writes
    {"config", "launch", "batchnorm"},  # config: the public face of core.config
    {"backends"},
    {"distribute"},
    {"saving", "data"},
    {"compat", "checkpoint"},  # compat: the Fix records (chief-only writes use saving)
    {"callbacks", "loops", "unscoped"},
    {"startup", "bootstrap", "info", "check"},
    {"cli", "__main__", "__init__"},
]
# The floor's own layers: within tfdist.core, imports flow down these too.
CORE_LAYERS = [
    {"validate", "position", "quiet", "upstream", "engines", "startup_watch"},
    {"config", "storage", "process", "cross_replica"},
    {"cluster", "roles", "versions", "full_epochs", "shard_policy", "watchdog"},
    {"atomic", "fix_registry", "exit_hold", "batch_order"},
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """tfdist modules ``name`` imports (anywhere in the file, functions included), lazy
    imports too: ``importlib.import_module("tfdist.x")``, the module names a lazy export
    table maps to, and ``tfdist.x`` read as an attribute of the package."""
    source = path.read_text()
    tree = ast.parse(source)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imports_by_name = "import_module(" in source  # a module named in a string is imported
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
        elif imports_by_name and isinstance(node, ast.Constant) and isinstance(node.value, str):
            targets.add(node.value)
        elif isinstance(node, ast.Attribute):
            targets.add(_dotted(node))  # tfdist.saving, after `import tfdist`
    return {t for t in targets if t in known and t != name and not name.startswith(t + ".")}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) - {"tfdist"} for name, path in modules.items()}


def _layer(module: str) -> tuple[int, int]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for index, layer in enumerate(LAYERS):
        if top in layer:
            if top != "core" or len(parts) < 3:
                return index, 0
            for sub, core_layer in enumerate(CORE_LAYERS):
                if parts[2] in core_layer:
                    return index, sub
            raise AssertionError(f"{module} is in no layer of CORE_LAYERS: add it")
    raise AssertionError(f"{module} is in no layer of tests/project/test_structure.py: add it")


def test_no_import_cycle():
    graph = _graph()
    cycles = []

    def visit(node, stack):
        for target in sorted(graph[node]):
            if target in stack:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif len(stack) < 12:
                visit(target, [*stack, target])

    for module in sorted(graph):
        visit(module, [module])
    assert not cycles, cycles[:3]


def test_imports_flow_down_the_layers():
    upward = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if (target.split(".")[:2] != module.split(".")[:2] or module.startswith("tfdist.core."))
        and _layer(target) > _layer(module)  # within a package is free, but for the floor
    ]
    assert not upward, upward


def _sources() -> list[Path]:
    """Every module of the package and of the MNIST job beside it."""
    return sorted([*PACKAGE.rglob("*.py"), *EXAMPLES.rglob("*.py")])


def _where(path: Path) -> str:
    """``path`` inside the package (``core/config.py``), or from the repository root."""
    root = PACKAGE if path.is_relative_to(PACKAGE) else PACKAGE.parent
    return path.relative_to(root).as_posix()


def test_the_mnist_job_lives_apart_and_only_tfdist_train_imports_it():
    importers = sorted(
        _where(path)
        for path in PACKAGE.rglob("*.py")
        if re.search(r"^\s*(from|import) tfdist_examples\b", path.read_text(), re.M)
    )
    assert importers == ["cli/train.py"], importers
    assert not (PACKAGE / "examples").exists()


def _long_functions():
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if ast.get_docstring(node) is not None:
                    body = body[1:]
                if body:
                    lines = body[-1].end_lineno - body[0].lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        yield f"{path.relative_to(PACKAGE.parent)}:{node.name} ({lines})"


def test_no_function_over_the_line_limit():
    assert not list(_long_functions())


# A private upstream name: `tensorflow.python`/`keras.src` imports, or a `._x` attribute
# read on something other than self/cls/a tfdist object.
_PRIVATE_IMPORT = re.compile(r"\b(tensorflow\.python|tensorflow\.compiler|keras\.src)\b")


def test_private_upstream_names_only_in_their_one_module():
    offenders = []
    for path in _sources():
        if _where(path).rpartition("/")[0] == "core/upstream":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                if any(_PRIVATE_IMPORT.search(n) for n in names):
                    offenders.append(f"{path.name}:{node.lineno} imports {names}")
    assert not offenders, offenders


def _table_layers(heading: str) -> list[set[str]]:
    """The names in the second column of the docs/architecture.md table under ``heading``."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = text[text.index(heading) :].split("\n\n", 1)[0].splitlines()[2:]
    return [set(re.findall(r"`([^`]+)`", row.split("|")[2])) for row in rows]


def test_the_architecture_page_draws_the_layers_this_test_checks():
    assert _table_layers("| layer | rooms |") == LAYERS
    assert _table_layers("| core layer | modules |") == CORE_LAYERS


# Module-level values that hold state: per-thread or per-context values, latches, counters,
# weak maps, and any name a function rebinds with `global`.
_STATEFUL_CALLS = {
    "local",
    "Event",
    "ContextVar",
    "count",
    "WeakKeyDictionary",
    "WeakSet",
    "WeakValueDictionary",
    "defaultdict",
}


def _mutable_dataclasses(tree: ast.Module) -> set[str]:
    """Names of the module's ``@dataclass`` classes that are not frozen."""
    found = set()
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for deco in node.decorator_list:
            func = deco.func if isinstance(deco, ast.Call) else deco
            frozen = isinstance(deco, ast.Call) and any(
                k.arg == "frozen" and getattr(k.value, "value", False) for k in deco.keywords
            )
            if _dotted(func).rpartition(".")[2] == "dataclass" and not frozen:
                found.add(node.name)
    return found


def _module_state() -> set[str]:
    found = set()
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        rebound = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
        mutable = _mutable_dataclasses(tree)  # a module-level instance of one is state too
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                value = node.value
                if not isinstance(target, ast.Name):
                    continue
                call = _dotted(value.func).rpartition(".")[2] if isinstance(value, ast.Call) else ""
                if call in _STATEFUL_CALLS or call in mutable or target.id in rebound:
                    found.add(f"{name}.{target.id}")
    return found


def test_process_state_has_one_owner_and_the_rest_is_named():
    from tfdist.core import process

    assert _module_state() - {"tfdist.core.process._STATE"} == set(process.OUTSIDE_STATE)
    assert all(len(why) > 30 for why in process.OUTSIDE_STATE.values())


@pytest.mark.slow  # about 30 s from a cold cache on 2 cores
def test_mypy_is_clean():
    """mypy over tfdist/ with pyproject.toml's [tool.mypy] settings: no error."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy"],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"mypy failed:\n{result.stdout}{result.stderr}"


def test_compat_holds_fix_records_only():
    # Each compat module exports its FIXES, non-empty, and the package applies every one.
    from tfdist import compat

    listed = {fix.name for fix in compat.FIXES}
    for path in sorted((PACKAGE / "compat").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        dotted = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        module = importlib.import_module(f"tfdist.{dotted}")
        fixes = getattr(module, "FIXES", None)
        if fixes is None and getattr(module, "HOOK", None) in compat.HOOKS:
            continue  # a hook compat applies with the fixes (a Patch, not a fix)
        assert fixes, f"tfdist/compat/{path.name} exports no FIXES: move it out of compat/"
        assert {fix.name for fix in fixes} <= listed, path.name


# The quick tier (`python -m pytest -m "not slow"`, docs/architecture.md): every test file
# has a test in it, except the files below, whose every test is a multi-process training
# run or a run of another suite (each over ~20 s on 2 cores).
SLOW_ONLY = {
    "tests/compat/test_accumulation.py": "1 device and 2 devices train, side by side, per module",
    "tests/compat/test_epoch_start.py": "each test trains 2 epochs in a fresh process",
    "tests/compat/test_no_harm.py": "the fixes-off / fixes-on matrix, 6 cells",
    "tests/compat/test_upstream_keras.py": "Keras's own test modules, with and without the fixes",
    "tests/checkpoint/test_jax_checkpoint.py": "every test kills and resumes JAX jobs",
    "tests/e2e/test_commands_quiet.py": "every command of the CLI, into a pipe",
    "tests/e2e/test_kubernetes.py": "pods in network namespaces",
    "tests/e2e/test_ray.py": "a Ray cluster; CI runs it in a stage of its own",
    "tests/e2e/test_ray_elastic.py": "a 3-node Ray cluster losing a node; CI's Ray stage",
    "tests/e2e/test_resume_world_size.py": "one job resumed on 1, 2 and 3 replicas",
    "tests/launch/test_network.py": "hosts in network namespaces",
    "tests/project/test_readme.py": "README's Usage block trained on 1, 2 devices and 2 workers",
}


def _marks_slow(decorators: list[ast.expr]) -> bool:
    return any("mark.slow" in ast.unparse(d) for d in decorators)


def _has_a_quick_test(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        is_mark = isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == "pytestmark" for t in node.targets
        )
        if is_mark and "mark.slow" in ast.unparse(node.value):
            return False
    tests = [
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
    ]
    return any(not _marks_slow(t.decorator_list) for t in tests)


def test_the_quick_tier_runs_a_test_of_every_test_file():
    files = sorted(PACKAGE.parent.glob("tests/**/test_*.py"))
    names = {f.relative_to(PACKAGE.parent).as_posix(): f for f in files}
    assert set(SLOW_ONLY) <= set(names), set(SLOW_ONLY) - set(names)
    missing = [n for n, f in names.items() if n not in SLOW_ONLY and not _has_a_quick_test(f)]
    assert not missing, f"test files with no test outside -m slow: {missing}"
    # An exemption that is no longer needed goes away.
    stale = [n for n in SLOW_ONLY if _has_a_quick_test(names[n])]
    assert not stale, f"these files have a quick test now; remove them from SLOW_ONLY: {stale}"


# Who is chief, this process's rank and the number of processes: tfdist.core.roles answers,
# from the cluster environment or from jax's numbering; no other module asks either source.
_ROLE_HOMES = {"core/roles.py", "core/cluster.py"}
_CLUSTER_READS = {"cluster_from_env", "parse_tf_config", "ClusterInfo"}


def _reads_the_cluster(node: ast.AST | None) -> bool:
    """Whether ``node`` is a call that parses the cluster environment, or its type."""
    if isinstance(node, ast.Call):
        node = node.func
    return _dotted(node).rpartition(".")[2] in _CLUSTER_READS


def _cluster_names(scope: ast.AST) -> set[str]:
    """Names bound in ``scope`` to a parsed cluster (assigned, or a parameter's type)."""
    names = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and _reads_the_cluster(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.arg) and node.annotation is not None:
            if _reads_the_cluster(node.annotation):
                names.add(node.arg)
    return names


def _role_decisions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    where = _where(path)
    found = []
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]:
        names = _cluster_names(scope)
        for node in ast.walk(scope):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and node.func.attr in ("process_index", "process_count"):
                found.append(f"{where}:{node.lineno} calls {node.func.attr}()")
            if isinstance(node, ast.Attribute) and node.attr in ("is_chief", "rank"):
                value = node.value
                if _reads_the_cluster(value) or getattr(value, "id", None) in names:
                    found.append(f"{where}:{node.lineno} reads the cluster's {node.attr}")
    return found


def test_roles_are_decided_in_one_module():
    offenders = sorted(
        {
            line
            for path in _sources()
            if _where(path) not in _ROLE_HOMES
            for line in _role_decisions(path)
        }
    )
    assert not offenders, f"ask tfdist.core.roles instead: {offenders}"


def test_the_backend_name_has_one_source():
    # Keras's answer is read in core.config.keras_backend only; the rest asks
    # tfdist.backends.name() (or, below the backends layer, config.keras_backend()).
    offenders = []
    for path in _sources():
        where = _where(path)
        tree = ast.parse(path.read_text())
        home = set()
        for node in ast.walk(tree):
            if where == "core/config.py" and getattr(node, "name", "") == "keras_backend":
                home = set(range(node.lineno, node.end_lineno + 1))
        for node in ast.walk(tree):
            is_call = isinstance(node, ast.Call)
            if is_call and _dotted(node.func).endswith("backend.backend"):
                if node.lineno not in home:
                    offenders.append(f"{where}:{node.lineno}")
    assert not offenders, f"call tfdist.backends.name() instead: {offenders}"


# Modules named for the fix prefix of the family they hold (docs/architecture.md, "Naming a
# fix"): each is the one home of its prefix's fixes, not a half of a feature.
FIX_FAMILIES = {"tfdist/compat/tf_fixes.py", "tfdist/compat/jax_fixes.py"}


def test_a_feature_with_two_backend_halves_is_a_package_of_tensorflow_and_jax():
    """``tf_x.py`` beside ``jax_x.py`` (or ``x.py`` beside ``jax_x.py``) is the old shape:
    such a pair is ``x/tensorflow.py`` and ``x/jax.py``, the shared part in ``x/__init__``."""
    pairs = []
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")}):
        stems = {p.stem for p in folder.glob("*.py")}
        for stem in sorted(stems):
            feature = re.sub(r"^(tf|tensorflow|jax)_", "", stem)
            if feature == stem:
                continue
            halves = {f"{prefix}{feature}" for prefix in ("tf_", "tensorflow_", "jax_")} | {feature}
            found = sorted(halves & stems)
            named = {str((folder / f"{s}.py").relative_to(PACKAGE.parent)) for s in found}
            if len(found) > 1 and not named <= FIX_FAMILIES:
                pairs.append(found)
    assert not pairs, f"backend halves as sibling modules: {pairs}; make each a package"
    for package in ("compat/inputs", "compat/partial_batches", "check/loops"):
        assert {p.name for p in (PACKAGE / package).glob("*.py")} >= {"tensorflow.py", "jax.py"}
