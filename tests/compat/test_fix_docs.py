"""Every fix says where it acts and which no-harm checks cover it (docs/fixes.md's table).

``Fix.acts_where`` is one line: the calls and topologies on which the fix changes anything,
and what stays upstream's (where its patch returns to upstream's code path).
``Fix.no_harm`` names the checks that run the fix where it acts, with it on, and compare
with one device or with the fixes off: pytest node ids of tests that exist (not of a test
that runs with the fixes off), and the names of cases of the no-harm matrix
(``CASES`` of tests/scripts/no_harm_job.py) next to the test of tests/compat/test_no_harm.py
that runs them. A fix no such check reaches says so with an empty tuple.

Whether docs/fixes.md holds the table ``tools/fix_table.py`` renders from these records is
tests/core/test_fix_guards.py::test_the_docs_fix_table_is_generated_from_the_records; here,
what the table says of each fix. Nothing here starts TensorFlow in a subprocess.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re

import pytest

from tfdist import compat

from conftest import REPO, tool_module

NO_HARM_JOB = "tests/scripts/no_harm_job.py"
NO_HARM_TEST = "tests/compat/test_no_harm.py"
# tests/x.py::test_f, tests/x.py::TestClass::test_m, either with a [param] id.
NODE_ID = re.compile(r"(tests/(?:\w+/)*test_\w+\.py)::((?:\w+::)?test_\w+)(?:\[([^\]]+)\])?")
MAX_LENGTH = 200  # one short line in the table


@functools.cache
def _tree(path: str) -> ast.Module:
    return ast.parse((REPO / path).read_text())


@functools.cache
def _test_functions(path: str) -> dict[str, ast.FunctionDef]:
    """``{"test_f": node, "TestClass::test_m": node}`` of a test file, parsed, not imported."""
    found = {}
    for node in _tree(path).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test_"):
                    found[f"{node.name}::{item.name}"] = item
    return found


@functools.cache
def _strings(path: str) -> set[str]:
    """Every string constant of a file (where a ``[param]`` id must come from)."""
    return {
        node.value
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def _runs_with_the_fixes_off(function: ast.FunctionDef) -> bool:
    """Marked ``upstream_failure`` (it shows the upstream failure without the fix), or
    named for the fixes-off cells: no check of what the fix does."""
    marked = any(
        isinstance(node, ast.Attribute) and node.attr == "upstream_failure"
        for decorator in function.decorator_list
        for node in ast.walk(decorator)
    )
    return marked or "fixes_off" in function.name


@functools.cache
def _cases() -> tuple[str, ...]:
    """The case names of the no-harm matrix: the keys of no_harm_job.py's ``CASES``."""
    for node in _tree(NO_HARM_JOB).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "CASES" for target in node.targets
        ):
            assert isinstance(node.value, ast.Dict), "CASES is no longer a dict literal"
            keys = [key.value for key in node.value.keys if isinstance(key, ast.Constant)]
            return tuple(keys)
    raise AssertionError(f"{NO_HARM_JOB} defines no CASES")


def _problem(check: str, fix) -> str | None:
    """What is wrong with one ``no_harm`` entry of ``fix``, or None."""
    if "::" not in check and not check.startswith("tests/"):
        if check not in _cases():
            return f"{check!r} is no case of {NO_HARM_JOB} (cases: {list(_cases())})"
        if not any(c.startswith(f"{NO_HARM_TEST}::") for c in fix.no_harm):
            return f"case {check!r} without the test of {NO_HARM_TEST} that runs it"
        return None
    match = NODE_ID.fullmatch(check)
    if match is None:
        return f"{check!r} is not tests/...py::test_name[param]"
    path, name, param = match.groups()
    if not (REPO / path).is_file():
        return f"{path} does not exist"
    function = _test_functions(path).get(name)
    if function is None:
        return f"{path} defines no test {name}"
    if param is not None and param not in _strings(path):
        return f"{path} has no parameter {param!r}"
    if _runs_with_the_fixes_off(function):
        return f"{check} runs with the fixes off: it checks no fix where it acts"
    return None


FIXES = {fix.name: fix for fix in compat.FIXES}


@pytest.mark.parametrize("name", FIXES)
def test_every_fix_says_in_one_line_where_it_acts(name):
    acts_where = FIXES[name].acts_where
    assert isinstance(acts_where, str) and acts_where.strip(), f"{name}: no acts_where"
    assert "\n" not in acts_where and len(acts_where) <= MAX_LENGTH, (name, len(acts_where))
    assert "|" not in acts_where, f"{name}: '|' would split the table's cell"
    # Where it acts, and what it leaves to upstream's code path.
    assert re.search(r"upstream|untouched", acts_where), f"{name}: says not what stays upstream's"


@pytest.mark.parametrize("name", FIXES)
def test_every_named_no_harm_check_exists_and_runs_with_the_fixes(name):
    checks = FIXES[name].no_harm
    assert isinstance(checks, tuple), f"{name}: no_harm is a tuple of names"
    assert len(set(checks)) == len(checks), f"{name}: a check named twice"
    problems = [problem for check in checks if (problem := _problem(check, FIXES[name]))]
    assert not problems, f"{name}: " + "; ".join(problems)


def test_the_rules_refuse_what_they_should():
    fix = FIXES["keras_tf_partial_batch_loss_weights"]
    bad = {
        "tests/compat/test_no_harm.py::test_no_such_test": "defines no test",
        "tests/compat/test_no_such_file.py::test_x": "does not exist",
        "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes"
        "[8 devices]": "has no parameter",
        "tests/compat/test_no_harm.py::test_fixes_off_upstream_differs_from_one_device": (
            "runs with the fixes off"
        ),
        "tests/compat/test_no_harm.py::test_fixes_off_right_where_plain_keras_is_right": (
            "runs with the fixes off"
        ),
        "tests/compat/test_user_saves.py::test_upstream_tears_the_file_saved_by_every_worker": (
            "runs with the fixes off"
        ),
        "tests/compat/test_no_harm.py": "is not tests/",
        "masked LSTM": "is no case",
    }
    for check, why in bad.items():
        problem = _problem(check, fix)
        assert problem is not None and why in problem, (check, problem)
    alone = dataclasses.replace(fix, no_harm=("masked GRU",))  # no test that runs the case
    assert "without the test" in (_problem("masked GRU", alone) or "")
    assert _problem("masked GRU", fix) is None


def test_the_table_says_where_each_fix_acts_and_what_checks_it():
    fix_table = tool_module("fix_table")
    table = fix_table.markdown()
    header = table.splitlines()[1]
    assert "| Acts only where | No-harm checks |" in header
    rows = {line.split("|")[1].strip(" `"): line for line in table.splitlines()[3:-1]}
    assert sorted(rows) == sorted(FIXES)
    for name, fix in FIXES.items():
        *_, acts_where, checks = rows[name].removesuffix(" |").split(" | ")
        assert acts_where == " ".join(fix.acts_where.split()), name
        if not fix.no_harm:
            assert checks == "none yet", name
        for check in fix.no_harm:
            path, _, test = check.partition("::")
            shown = f"`{path.rsplit('/', 1)[-1]}::{test}`" if test else f"case `{check}`"
            assert shown in checks, (name, shown)
            # No tests/ path in a cell: docs prose that names one needs its marker.
            assert "tests/" not in checks, name
