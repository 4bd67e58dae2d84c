"""Tells which fixes may retire: a failing test that reproduces an upstream failure.

A test marked ``@pytest.mark.upstream_failure("fix_name", ...)`` shows the upstream defect
those fixes repair (with the fix excluded, upstream must still fail). When such a test
fails, the end of the run lists the fixes to check: if the failure is that upstream no
longer fails, upstream fixed the defect, and the fix should retire (or its guard narrow).
tests/conftest.py loads these hooks; tests/core/test_fix_guards.py checks every fix is named.
"""

from __future__ import annotations

import pytest

_FAILED: list[tuple[str, tuple[str, ...]]] = []
_PROPERTY = "upstream_failure_fixes"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "upstream_failure(*fixes): reproduces the upstream defect the named fixes repair",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # The fixes travel on the report: under pytest-xdist the report is made in a worker
    # process and logged in the controller, which prints the summary.
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("upstream_failure")
    if marker is not None:
        report.user_properties.append((_PROPERTY, tuple(marker.args)))


def pytest_runtest_logreport(report):
    if report.when != "call" or not report.failed:
        return
    for key, fixes in report.user_properties:
        if key == _PROPERTY:
            _FAILED.append((report.nodeid, tuple(fixes)))


def pytest_terminal_summary(terminalreporter):
    if not _FAILED:
        return
    terminalreporter.write_sep("=", "fixes to check for retirement")
    for nodeid, fixes in _FAILED:
        terminalreporter.write_line(
            f"{', '.join(fixes)}: {nodeid} failed. If upstream no longer shows the failure "
            "it reproduces, upstream fixed it: retire the fix or narrow its guard."
        )
