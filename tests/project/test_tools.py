"""tools/ is a suite: every module of tools.bench and tools.docs imports, they import each
other as packages (no sys.path edits, no private names of another module) and without
a circle."""

from __future__ import annotations

import ast
import subprocess
import sys

from conftest import REPO, child_env

TOOLS = REPO / "tools"
# Run as scripts by path (noxfile.py, .ci/run, the docs), so they stay plain files.
SCRIPTS = {"fix_fingerprints", "fix_table", "mutations", "test_processes"}


def _modules() -> dict[str, ast.Module]:
    """Every module of tools/ run as a package module, by dotted name, parsed."""
    found = {}
    for path in sorted(TOOLS.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] in SCRIPTS:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def _imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The tools modules ``tree`` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            names = {f"{node.module}.{a.name}" for a in node.names}
            out |= (names & modules) or {node.module}
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph`` (a path back to where it started), each found once."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    return found


def test_every_tools_module_imports_in_a_fresh_process():
    names = sorted(n for n in _modules() if not n.endswith("__main__"))
    code = (
        f"import importlib\nfor name in {names!r}:\n    importlib.import_module(name)\nprint('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    assert {"tools.bench.harness", "tools.bench.suite", "tools.docs.figures"} <= set(names)


def test_tools_import_each_other_without_a_circle():
    modules = _modules()
    graph = {name: _imports(tree, set(modules)) - {name} for name, tree in modules.items()}
    assert graph["tools.bench.suite"] >= {"tools.bench.harness", "tools.bench.launcher"}
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_tools_change_no_sys_path_and_use_no_private_name_of_another_module():
    for name, tree in _modules().items():
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tools"):
                assert not [a.name for a in node.names if a.name.startswith("_")], name
                aliases |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name.startswith("tools")}
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                path = f"{getattr(node.value.value, 'id', '')}.{node.value.attr}"
                assert path != "sys.path", f"{name} changes sys.path (line {node.lineno})"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
            ):
                raise AssertionError(
                    f"{name} uses {node.value.id}.{node.attr} (line {node.lineno})"
                )


def test_measured_results_live_in_one_folder():
    assert [p for p in TOOLS.rglob("*.json") if p.parent != TOOLS / "results"] == []
    assert len(list((TOOLS / "results").glob("*.json"))) >= 11


def test_one_command_finds_every_generated_block_current():
    # python -m tools.docs writes the figures, the idiom table and the fix table; --check
    # writes nothing and names what is stale (here nothing: the pages are generated).
    proc = subprocess.run(
        [sys.executable, "-m", "tools.docs", "--check"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr[-3000:]


def test_every_mutation_finds_the_text_it_breaks_once():
    """tools/mutations.py replaces one exact piece of source text per mutation; when the code
    it names is rewritten, the mutation would break nothing. Each text is still there, once,
    and each test it runs exists."""
    from conftest import tool_module

    mutations = tool_module("mutations")
    assert len(mutations.MUTATIONS) >= 13
    for mutation in mutations.MUTATIONS:
        text = (REPO / mutation.path).read_text()
        assert text.count(mutation.before) == 1, (mutation.name, mutation.path)
        assert mutation.after != mutation.before, mutation.name
        for test in mutation.tests:  # a test file, or one test in it
            path, _, name = test.partition("::")
            source = (REPO / path).read_text()
            assert not name or f"def {name.split('[')[0]}(" in source, (mutation.name, test)


def test_doc_stats_ends_sentences_before_lower_case_starts_and_not_after_abbreviations():
    from tools import doc_stats

    text = "Run it, e.g. `tfdist check` here. `tfdist launch` starts it. tfdist saves.\n"
    assert doc_stats.sentences(text) == [
        "Run it, e.g. `tfdist check` here.",
        "`tfdist launch` starts it.",
        "tfdist saves.",
    ]
