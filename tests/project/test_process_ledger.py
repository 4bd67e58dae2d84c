"""The process ledger counts every test child and its CPU (tools/test_processes.py)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, child_env

sys.path.insert(0, str(REPO / "tools"))
import test_processes  # noqa: E402


def _child(code: str, ledger, test_id: str) -> int:
    env = child_env(TFDIST_TEST_LEDGER=str(ledger), PYTEST_CURRENT_TEST=f"{test_id} (call)")
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode


def test_children_are_counted_with_their_cpu_even_when_they_end_by_os_exit(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    assert _child(busy, ledger, "tests/a_test.py::test_one") == 0
    assert _child(busy + "import os; os._exit(3)", ledger, "tests/a_test.py::test_two") == 3
    assert (
        _child(
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", ledger, "tests/b_test.py::t"
        )
        == -9
    )

    table = test_processes.per_file(test_processes.read_ledger(ledger))
    rows = {row["file"]: row for row in table}
    assert set(rows) == {"tests/a_test.py", "tests/b_test.py"}
    assert rows["tests/a_test.py"]["processes"] == 2
    assert rows["tests/a_test.py"]["no_exit"] == 0  # os._exit is noted too
    assert rows["tests/a_test.py"]["cpu_s"] >= 0.6
    assert rows["tests/b_test.py"]["processes"] == 1
    assert rows["tests/b_test.py"]["no_exit"] == 1  # killed: a start line only
    assert rows["tests/b_test.py"]["cpu_s"] == 0
    assert "| **all** | 3 | 0 | 0 | 1 |" in test_processes.markdown(table)


def test_junit_times_add_up_per_file_with_tests_in_classes(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.e2e.test_x" name="test_a" time="1.5"/>'
        '<testcase classname="tests.e2e.test_x.TestGroup" name="test_b" time="2.0"/>'
        '<testcase classname="tests.test_y" name="test_c" time="0.25"/>'
        "</testsuite></testsuites>"
    )
    assert test_processes.junit_seconds(junit) == {
        "tests/e2e/test_x.py": 3.5,
        "tests/test_y.py": 0.25,
    }
