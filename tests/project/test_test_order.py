"""The order CI runs the test files in: the longest recorded first, each file's tests kept
in their order (tests/conftest.py), from the seconds tools/test_order.py records."""

from __future__ import annotations

import json
from types import SimpleNamespace

import conftest
from conftest import REPO


def _items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_the_longest_files_go_first_and_a_files_tests_keep_their_order(monkeypatch, tmp_path):
    record = tmp_path / "file_seconds.json"
    record.write_text(json.dumps({"a.py": 5.0, "b.py": 50.0, "c.py": 1.0, "d.py": 9.0}))
    monkeypatch.setattr(conftest, "FILE_SECONDS", record)
    items = _items("a.py::one", "c.py::one", "new.py::one", "b.py::one", "a.py::two", "b.py::two")
    conftest._longest_files_first(items)
    # An unrecorded file first (new files are often long end-to-end ones), then b (50).
    assert [item.nodeid for item in items] == [
        "new.py::one",
        "b.py::one",
        "b.py::two",
        "a.py::one",
        "a.py::two",
        "c.py::one",
    ]
    monkeypatch.setattr(conftest, "FILE_SECONDS", tmp_path / "missing.json")
    unchanged = _items("z.py::one", "a.py::one")
    conftest._longest_files_first(unchanged)
    assert [item.nodeid for item in unchanged] == ["z.py::one", "a.py::one"]


def test_the_record_is_written_from_a_junit_file_and_names_real_test_files(tmp_path):
    import subprocess
    import sys

    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.compat.test_x" name="t1" time="2.5"/>'
        '<testcase classname="tests.compat.test_x.TestK" name="t2" time="1.0"/>'
        '<testcase classname="tests.test_y" name="t" time="4"/>'
        "</testsuite></testsuites>"
    )
    out = tmp_path / "seconds.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.test_order", str(junit), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == {"tests/compat/test_x.py": 3.5, "tests/test_y.py": 4.0}
    bad = subprocess.run(
        [sys.executable, "-m", "tools.test_order", str(tmp_path / "none.xml")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert bad.returncode == 2 and "junit: no file at" in bad.stderr
    # The record in the repository names test files that exist.
    recorded = json.loads(conftest.FILE_SECONDS.read_text())
    assert recorded and all((REPO / name).is_file() for name in recorded), [
        name for name in recorded if not (REPO / name).is_file()
    ]
