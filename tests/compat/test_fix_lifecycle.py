"""A fix's way in and out: the upstream issue it names, the releases it was verified on, the
release that fixes the defect upstream (``fixed_in``: from there the fix does not apply, and
``tfdist info`` says so). Nothing here starts TensorFlow."""

from __future__ import annotations

import inspect
import re

import pytest

from tfdist import compat, info
from tfdist.core import fix_registry, versions

from conftest import tool_module

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
