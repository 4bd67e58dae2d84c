"""One public route to each name: ``tfdist.<name>`` for the one-liners and a few public
namespaces (``tfdist.data``, ``tfdist.callbacks``, ...); the implementation modules stay
out of the API, and the docs, README and notebooks use only the public routes."""

from __future__ import annotations

import importlib
import json
import re

import tfdist

from conftest import REPO

PUBLIC_MODULES = ("callbacks", "compat", "config", "data", "launch", "loops")
INTERNAL = ("checkpoint", "core", "distribute", "saving")


def _public_routes() -> dict[int, list[str]]:
    routes: dict[int, list[str]] = {}
    for name in tfdist.__all__:
        if name == "__version__" or name in PUBLIC_MODULES:
            continue
        routes.setdefault(id(getattr(tfdist, name)), []).append(f"tfdist.{name}")
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(f"tfdist.{module_name}")
        for name in module.__all__:
            value = getattr(module, name)
            if not isinstance(value, (bool, int, float, str, tuple)):  # constants may repeat
                routes.setdefault(id(value), []).append(f"tfdist.{module_name}.{name}")
    return routes


def test_every_public_object_has_exactly_one_route():
    repeated = [names for names in _public_routes().values() if len(names) > 1]
    assert not repeated, repeated


def test_implementation_modules_are_not_listed():
    assert not set(INTERNAL) & set(tfdist.__all__)
    assert not set(INTERNAL) & set(dir(tfdist))
    assert set(PUBLIC_MODULES) <= set(tfdist.__all__)


def _source(path) -> str:
    """A page's text, or a notebook's code and markdown (not its outputs: log lines name
    the modules their loggers live in)."""
    if path.suffix != ".ipynb":
        return path.read_text()
    return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"])


def test_docs_readme_and_notebooks_use_only_public_routes():
    internal = re.compile(rf"\btfdist\.(?:{'|'.join(INTERNAL)})\.\w+")
    files = [
        REPO / "README.md",
        *(REPO / "docs").glob("*.md"),
        *(REPO / "notebooks").glob("*.ipynb"),
    ]
    found = [f"{p.name}: {m}" for p in files for m in internal.findall(_source(p))]
    assert not found, found


def test_the_counting_one_liners_take_strategy_the_same_way():
    import inspect

    for name in ("num_replicas", "num_workers", "worker_index", "global_batch_size"):
        parameter = inspect.signature(getattr(tfdist, name)).parameters["strategy"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert parameter.default is None, name
