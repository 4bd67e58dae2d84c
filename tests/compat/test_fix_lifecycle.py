"""A fix's way in and out: the upstream issue it names, the releases it was verified on, the
release that fixes the defect upstream (``fixed_in``: from there the fix does not apply, and
``tfdist info`` says so). Nothing here starts TensorFlow."""

from __future__ import annotations

import inspect
import re

import pytest

from tfdist import compat, info
from tfdist.core import fix_registry, versions

from conftest import REPO, tool_module

RELEASE = re.compile(r"(tensorflow|keras|jax) \d+\.\d+")


@pytest.mark.parametrize("fix", compat.FIXES, ids=lambda fix: fix.name)
def test_every_fix_names_its_upstream_issue_and_the_releases_it_was_verified_on(fix):
    issue = fix.upstream_issue
    assert issue.startswith("https://github.com/") or issue.startswith("none filed: "), issue
    assert fix.verified_against, fix.name  # fingerprints.json holds its targets
    assert all(RELEASE.fullmatch(release) for release in fix.verified_against)
    packages = {release.split()[0] for release in fix.verified_against}
    assert packages <= {target.package for target in fix.targets}
    assert fix.fixed_in is None or RELEASE.match(fix.fixed_in)


@pytest.fixture
def fixed_in_keras_3_16(monkeypatch):
    """One fix whose defect keras 3.16 fixes, alone in the registry; its calls counted."""
    calls = []
    fix = compat.Fix(
        "keras_fake_defect",
        "a fake defect",
        lambda: True,
        lambda: calls.append("applied"),
        fixed_in="keras 3.16",
    )
    monkeypatch.setattr(compat, "FIXES", [fix])
    monkeypatch.setattr(compat, "HOOKS", ())
    return fix, calls


def test_a_fix_does_not_apply_from_the_release_that_fixes_its_defect(
    monkeypatch, fixed_in_keras_3_16
):
    fix, calls = fixed_in_keras_3_16
    monkeypatch.setattr(versions, "installed", lambda package: "3.16.0")
    assert (
        fix_registry.fixed_upstream(fix)
        == "fixed upstream in keras 3.16 (keras 3.16.0 is installed)"
    )
    assert compat.apply_all(exclude=[]) == [] and calls == []
    (row,) = compat.status()
    assert row["state"] == "fixed upstream"
    lines = info._fix_lines(compat.status())
    expected = (
        "  not applied  keras_fake_defect: fixed upstream in keras 3.16 (keras 3.16.0 is installed)"
    )
    assert [line for line in lines if "keras_fake_defect" in line] == [expected]


def test_a_fix_applies_before_the_release_that_fixes_its_defect(monkeypatch, fixed_in_keras_3_16):
    fix, _ = fixed_in_keras_3_16
    monkeypatch.setattr(versions, "installed", lambda package: "3.15.2")
    assert fix_registry.fixed_upstream(fix) is None
    (row,) = compat.status()
    assert row["state"] != "fixed upstream"


# ------------------------------------------------------------------ REQUIRED, derived


def test_required_is_the_targets_and_the_other_uses_and_each_is_used():
    from tfdist.core import upstream

    tool = tool_module("fix_fingerprints")
    targets = tool.target_entries()
    required = [entry for entries in upstream.REQUIRED.values() for entry in entries]
    assert len(required) == len(set(required))
    assert set(required) == targets | set(upstream.OTHER_USES)
    assert set(fix_registry.verified_fingerprints()) == targets  # pruned: nothing else
    assert not targets & set(upstream.OTHER_USES)  # not restated
    helpers = "".join(inspect.getsource(module) for module in upstream.HELPER_MODULES)
    for entry in upstream.OTHER_USES:  # each spelt by a helper of tfdist.core.upstream
        module, _, attribute = entry.partition(":")
        spelt = (attribute.rsplit(".", 1)[-1], module.rsplit(".", 1)[-1])
        assert any(f"{name}" in helpers for name in spelt), entry


def test_the_fingerprint_tool_drops_what_no_target_names():
    tool = tool_module("fix_fingerprints")
    record = {"keras 3.15": {"signature": "()", "code": "0"}}
    existing = {"keras.src.gone:Retired.method": record, "keras.src.kept:f": record}
    new = {"keras.src.kept:f": {"keras 3.16": record["keras 3.15"]}}
    assert tool.merged(existing, new, {"keras.src.kept:f"}) == {
        "keras.src.kept:f": {"keras 3.15": record["keras 3.15"], "keras 3.16": record["keras 3.15"]}
    }


# ------------------------------------------------------------------ retiring a fix

# A real fix, retired in a copy of the registry as upstream's repair would retire it.
RETIRED = "keras_tf_predict_on_batch_copies"
# Where it may be named: its module, its upstream_failure test, compat's MODULES and
# RENAMED lines, the generated fix table and this test.
NAMED_IN = {
    "tfdist/compat/on_batch.py",
    "tests/e2e/test_idioms.py",
    "tfdist/compat/__init__.py",
    "docs/fixes.md",
    "tests/compat/test_fix_lifecycle.py",
}


def _without_retired(monkeypatch):
    (retired,) = [fix for fix in compat.FIXES if fix.name == RETIRED]
    module = retired.apply.__module__
    assert compat.MODULES.count(module) == 1  # one line names its module
    rest = [fix for fix in compat.FIXES if fix.apply.__module__ != module]
    monkeypatch.setattr(compat, "FIXES", rest)
    return retired, module


def test_retiring_a_fix_leaves_the_rest_applied_and_the_generated_files_without_it(
    monkeypatch,
):
    retired, module = _without_retired(monkeypatch)
    applied = compat.apply_all(exclude=[])  # the rest applies, none steps aside
    assert RETIRED not in applied and not compat.skipped()
    needed = {row["name"] for row in compat.status() if row["state"] != "not needed"}
    assert needed <= set(applied)
    table = tool_module("fix_table").markdown()  # docs/fixes.md's table, regenerated
    page = (REPO / "docs" / "fixes.md").read_text()
    rows = {line for line in page.splitlines() if line.startswith("| `")}
    assert {line for line in table.splitlines() if line.startswith("| `")} == {
        row for row in rows if not row.startswith(f"| `{RETIRED}`")
    }
    tool = tool_module("fix_fingerprints")  # fingerprints.json, pruned; REQUIRED follows
    pruned = tool.merged(fix_registry.verified_fingerprints(), {}, tool.target_entries())
    only_its = {t.entry for t in retired.targets} - tool.target_entries()
    assert only_its and not only_its & set(pruned)


def test_nothing_but_its_module_its_test_and_generated_files_name_a_fix():
    constant = RETIRED.upper()
    module = "on_batch"
    spellings = (RETIRED, constant, f"compat.{module}", f"compat/{module}", f"{module}.py")
    found = set()
    for path in [*REPO.glob("*.*"), *REPO.glob("*/**/*.*")]:
        top = path.relative_to(REPO).parts[0]
        if top.startswith(".") or top in {"site", "build"} or not path.is_file():
            continue
        if path.suffix not in {".py", ".md", ".json", ".cfg", ".toml", ".yml", ".yaml", ".ipynb"}:
            continue
        text = path.read_text(errors="replace")
        if any(spelling in text for spelling in spellings):
            found.add(str(path.relative_to(REPO)))
    assert found <= NAMED_IN, found - NAMED_IN


# ------------------------------------------------------------------ hooks, not fixes


def test_hooks_use_the_mechanism_and_are_not_listed_as_fixes():
    from tfdist import startup, unscoped

    hooks = (*compat.HOOKS, startup.STARTUP, unscoped.HOOK)
    assert all(type(hook) is fix_registry.Patch for hook in hooks)
    names = {hook.name for hook in hooks}
    assert not names & set(compat.fix_names())
    assert not names & {row["name"] for row in compat.status()}  # tfdist info's rows
    table = tool_module("fix_table").markdown()
    assert not any(f"`{name}`" in table for name in names)
    assert all(fix_registry.guard(hook) is None for hook in hooks)  # still guarded
    # compat's hooks are still named in TFDIST_COMPAT_EXCLUDE, as before
    compat.apply_all(exclude=[hook.name for hook in compat.HOOKS], package="no package")


def test_apply_all_applies_the_hooks_through_the_same_record_and_applied_lists_fixes_only():
    from tfdist.core import process

    applied = compat.apply_all(exclude=[])
    recorded = process.state().applied_fixes
    needed = [hook.name for hook in compat.HOOKS if hook.applies()]
    assert needed and set(needed) <= set(recorded)  # applied, journaled, recorded
    assert not set(needed) & set(applied)  # not counted as fixes


def test_a_patch_written_as_one_function_of_the_original():
    class Owner:
        def f(self, x):
            return x + 1

    original = Owner.f
    fix_registry.wrap(Owner, "f", "test_double", lambda f, self, x: 2 * f(self, x))
    fix_registry.wrap(Owner, "f", "test_double", lambda f, self, x: 3 * f(self, x))  # once
    assert Owner().f(1) == 4 and Owner.f.__wrapped__ is original
