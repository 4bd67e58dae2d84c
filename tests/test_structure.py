"""The package's shape: imports flow one way, functions stay short, private names stay put.

These are the rules a newcomer can rely on (README, "Architecture"); each failure names the
module or function that broke one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tfdist"
MAX_FUNCTION_LINES = 60

# Layers, lowest first: a module may import only from its own layer's leaves or below.
LAYERS = [
    {"validate", "position", "quiet"},
    {"config", "storage"},  # storage: local paths and fsspec URLs, for saving and checkpoints
    {"cluster", "engines", "process", "_private", "launch", "versions", "watchdog"},
    {"compat", "batchnorm"},
    {"backends", "layouts"},  # layouts: the checked ModelParallel the JAX backend sets
    {"distribute", "saving"},
    {"data"},
    {"checkpoint"},
    {"callbacks", "loops"},
    {"examples"},
    {"startup", "bootstrap", "info"},
    {"cli", "__main__", "__init__"},
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
    """tfdist modules ``name`` imports (anywhere in the file, functions included)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
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
    return {t for t in targets if t in known and t != name and not name.startswith(t + ".")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) - {"tfdist"} for name, path in modules.items()}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index
    raise AssertionError(f"{module} is in no layer of tests/test_structure.py: add it")


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
        if target.split(".")[:2] != module.split(".")[:2]  # within a package is free
        and _layer(target) > _layer(module)
    ]
    assert not upward, upward


def _long_functions():
    for path in sorted(PACKAGE.rglob("*.py")):
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
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_private.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                if any(_PRIVATE_IMPORT.search(n) for n in names):
                    offenders.append(f"{path.name}:{node.lineno} imports {names}")
    assert not offenders, offenders
