"""Each fix has one name (docs/architecture.md, "Naming a fix"): its prefix says the library
it patches and the backend it acts on, the record, its module's constant and its entry point
agree, other modules import the constant, and a renamed fix's old name is still accepted.
Nothing here starts TensorFlow."""

from __future__ import annotations

import ast
import importlib
import warnings

import pytest

from tfdist import compat

from conftest import REPO, tool_module

# package patched, backends it acts on -> the prefix its name starts with
PREFIXES = {
    ("tensorflow", "tensorflow"): "tf_",
    ("keras", "tensorflow"): "keras_tf_",
    ("keras", "jax"): "keras_jax_",
    ("keras", "tensorflow, jax"): "keras_",
}
FIXES = compat.FIXES
# Where else a fix's name is spelt: a module below compat's layer, which may not import
# it, and the table of renamed fixes.
ALSO_NAMED = {
    "tfdist/data/pipeline.py": {"keras_jax_partial_batch_share"},
    "tfdist/compat/__init__.py": set(compat.RENAMED.values()),
}


@pytest.mark.parametrize("fix", FIXES, ids=lambda fix: fix.name)
def test_a_fix_name_says_the_library_it_patches_and_the_backend_it_acts_on(fix):
    backend = tool_module("fix_table")._backend(fix)
    prefix = PREFIXES[(fix.package, backend)]
    assert fix.name.startswith(prefix), (fix.name, fix.package, backend)
    if prefix == "keras_":  # both backends: no backend in the name
        assert not fix.name.startswith(("keras_tf_", "keras_jax_")), fix.name


@pytest.mark.parametrize("fix", FIXES, ids=lambda fix: fix.name)
def test_the_record_its_constant_and_its_entry_point_share_the_name(fix):
    module = importlib.import_module(fix.apply.__module__)
    assert fix.apply.__name__ == fix.name
    assert getattr(module, fix.name.upper()) == fix.name
    assert fix in module.FIXES


def test_no_module_spells_a_fix_name_but_its_own():
    # Other modules import the constant; a string equal to a fix's name appears once.
    names = set(compat.fix_names())
    for path in sorted((REPO / "tfdist").rglob("*.py")):
        relative = str(path.relative_to(REPO))
        found = {
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and node.value in names
        }
        own = {f.name for f in FIXES if f.apply.__module__.replace(".", "/") + ".py" == relative}
        assert found <= own | ALSO_NAMED.get(relative, set()), (relative, found - own)


@pytest.mark.parametrize(("old", "new"), sorted(compat.RENAMED.items()))
def test_a_renamed_fix_is_still_excluded_by_its_old_name_with_one_deprecation_line(old, new):
    assert new in compat.fix_names() and old not in compat.fix_names()
    for kwargs in ({"exclude": [old]}, {"environ": {"TFDIST_COMPAT_EXCLUDE": f"{old}, {new}"}}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # no package has that name: the names are checked, nothing is applied
            compat.apply_all(package="no package", **kwargs)
        lines = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        assert len(lines) == 1 and f"is now named {new}" in lines[0], lines
