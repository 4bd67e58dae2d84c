"""The manual keeps its promises: every code block is checked or says why not, every test
the prose cites names the test function that checks the sentence, generated figures are
current, the site builds strictly, and no page speaks of how it was made.

The marker convention (docs/architecture.md, "Writing docs"): the line before each fenced
block is ``<!-- run by tests/x.py::test_function -->``, ``<!-- same as
tests/scripts/x.py -->``, ``<!-- run here -->`` (this file runs it) or ``<!-- not run: why
-->``. A claim in prose names the test that checks it with ``<!-- checked by
tests/x.py::test_function -->``, on a line of its own. Every marker that names a test
names ``tests/x.py::test_function`` (or ``tests/x.py::TestClass::test_method``; a
``[param]`` id is allowed and ignored) of a file that exists and defines that function.
A "run by" test must read the page itself: a string of its own code (its body or its
decorators, docstrings and assertion messages left out), or of the fixtures, helpers and
constants of its file that it reaches by name, names the page's file. A test file the
prose cites (``tests/x.py`` or ``tests/x.py::test_f``, outside code blocks and markers)
has, in the same paragraph or directly after it, a marker that names a test of that file
(that very test where the citation names one), or a ``checked by`` marker that names a
test that reads the page and checks the sentence itself (what CI runs, for instance).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, child_env, last_json_line

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
MARKER = re.compile(r"<!-- (run by (\S+)|same as (\S+)|run here|not run: .+?) -->")
NAMES_A_TEST = re.compile(r"<!-- (run|checked) by (\S+?) -->")
CITATION = re.compile(r"(tests/(?:\w+/)*test_\w+\.py)((?:::\w+)*)(?:\[[^\]\s]*\])?")
COMMENT = re.compile(r"<!--.*?-->")
INLINE_CODE = re.compile(r"`[^`]*`")
PARAGRAPH_START = re.compile(r"\s*(?:#|[-*+] |\d+\. |\|)")  # a heading, list item, table row


def blocks(page):
    """(line number, info string, marker or None, code) of each fenced block of ``page``."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            indent = len(lines[i]) - len(lines[i].lstrip())
            j = i + 1
            while not lines[j].lstrip().startswith("```"):
                j += 1
            before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
            code = textwrap.dedent("\n".join(x[indent:] for x in lines[i + 1 : j]))
            found.append((i + 1, lines[i].strip()[3:], MARKER.fullmatch(before), code))
            i = j
        i += 1
    return found


def prose(page) -> list[tuple[int, str | None]]:
    """(line number, line) of each line of ``page``; None for the lines of fenced blocks."""
    lines: list[tuple[int, str | None]] = []
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = line.lstrip().startswith("```")
        lines.append((number, None if fenced or fence else line))
        fenced ^= fence
    return lines


def _name(page) -> str:
    return page.relative_to(REPO).as_posix() if page.is_relative_to(REPO) else page.name


def named_tests(page) -> list[tuple[int, str, str]]:
    """(line number, "run" or "checked", test) of each marker of ``page`` that names a
    test: a comment on a line of its own, outside fenced blocks (one shown as an example
    inside `code` is no marker)."""
    return [
        (number, marker.group(1), marker.group(2))
        for number, line in prose(page)
        if line is not None and (marker := NAMES_A_TEST.fullmatch(line.strip()))
    ]


def find_test(name: str, where: str) -> tuple[dict, ast.FunctionDef]:
    """The module-level definitions of the file of test ``name`` (``tests/x.py::test_f``,
    ``tests/x.py::TestC::test_m``, a ``[param]`` id ignored) and the test's node; fails
    (naming ``where``) when the file or the function does not exist."""
    path, _, qualified = name.partition("::")
    file = REPO / path
    assert path.startswith("tests/") and file.is_file(), f"{where}: no test file {path}"
    parts = re.sub(r"\[[^\]]*\]$", "", qualified).split("::")
    assert len(parts) <= 2 and parts[-1].startswith("test_"), (
        f"{where}: {name!r} names no test (tests/x.py::test_f or tests/x.py::TestC::test_m)"
    )
    tree = ast.parse(file.read_text())
    top: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            top[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            top.update({t.id: node for t in targets if isinstance(t, ast.Name)})
    scope = top
    if len(parts) == 2:
        cls = top.get(parts[0])
        assert isinstance(cls, ast.ClassDef), f"{where}: {path} defines no class {parts[0]}"
        scope = {node.name: node for node in cls.body if hasattr(node, "name")}
    node = scope.get(parts[-1])
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef), (
        f"{where}: {path} defines no test function {'::'.join(parts)}"
    )
    return top, node


def _code_strings(node: ast.AST) -> list[str]:
    """The string constants of ``node``'s code: not its docstrings, not assertion messages."""
    left_out = set()
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                left_out.add(id(first.value))
        if isinstance(n, ast.Assert) and n.msg is not None:
            left_out.update(id(m) for m in ast.walk(n.msg))
    return [
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in left_out
    ]


def reads_page(name: str, page, where: str) -> bool:
    """Whether test ``name`` reads ``page``: a string of its code (decorators included),
    or of a fixture, helper or constant of its file that it reaches by name, names the
    page's file. Docstrings, comments, assertion messages, other tests and the rest of the
    file do not count."""
    top, test = find_test(name, where)
    mention = re.compile(rf"(?:^|[^\w.-]){re.escape(page.name)}(?![\w.-])")
    seen, todo, strings = set(), [test], []
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        strings += _code_strings(node)
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # fixtures of the file
            used |= {a.arg for a in node.args.args + node.args.kwonlyargs}
        todo += [top[u] for u in used if u in top and not u.startswith("test_")]
    return any(mention.search(s) for s in strings)


def test_every_code_block_says_how_it_is_checked():
    unmarked = [
        f"{_name(page)}:{line} ```{info}"
        for page in PAGES
        for line, info, marker, _ in blocks(page)
        if marker is None
    ]
    assert not unmarked, "blocks without a marker (docs/architecture.md):\n" + "\n".join(unmarked)


def test_run_by_and_same_as_markers_name_what_really_checks_the_block():
    for page in PAGES:
        for line, _, marker, code in blocks(page):
            if marker is None:
                continue
            where = f"{_name(page)}:{line}"
            if marker.group(2):  # run by a test function: it must read this page itself
                assert reads_page(marker.group(2), page, where), (
                    f"{where}: {marker.group(2)} never reads {page.name} (its own code, "
                    "or the fixtures, helpers and constants of its file it reaches)"
                )
            elif marker.group(3):  # an excerpt: every line, in order, in the script
                source = (REPO / marker.group(3)).read_text().splitlines()
                k = 0
                for text in filter(str.strip, code.splitlines()):
                    stripped = [s.rstrip() for s in source[k:]]
                    assert text.rstrip() in stripped, f"{where}: {text!r} not in {marker.group(3)}"
                    k += stripped.index(text.rstrip()) + 1


def test_every_run_by_and_checked_by_marker_names_a_test_function_that_exists():
    found = 0
    for page in PAGES:
        for number, kind, name in named_tests(page):
            where = f"{_name(page)}:{number}"
            find_test(name, where)  # fails where the file or the function is missing
            if kind == "run":
                assert reads_page(name, page, where), f"{where}: {name} never reads {page.name}"
            found += 1
    assert found


def test_markers_that_name_a_test_stand_on_lines_of_their_own():
    """A marker inside a line of prose would escape every check above."""
    inline = [
        f"{_name(page)}:{number}: {line.strip()}"
        for page in PAGES
        for number, line in prose(page)
        if line is not None
        and re.search(r"<!-- (run|checked) by", INLINE_CODE.sub("", line))
        and not NAMES_A_TEST.fullmatch(line.strip())
    ]
    assert not inline, "markers not on a line of their own:\n" + "\n".join(inline)


def paragraphs(page) -> list[tuple[list[tuple[int, str]], list[tuple[str, str]]]]:
    """Each paragraph of ``page``'s prose (split at blank lines, fenced blocks, headings,
    list items and table rows): its (line number, line) pairs and the (kind, test) of the
    markers inside it or directly after it (lines of nothing but a comment)."""
    lines = prose(page)
    groups: list[list[int]] = []
    for i, (_, line) in enumerate(lines):
        if line is None or not line.strip():
            continue
        if groups and groups[-1][-1] == i - 1 and not PARAGRAPH_START.match(line):
            groups[-1].append(i)
        else:
            groups.append([i])
    found = []
    for group in groups:
        texts = [lines[i][1] for i in group]
        for _, later in lines[group[-1] + 1 :]:
            if later is None or (later.strip() and not COMMENT.fullmatch(later.strip())):
                break
            texts.append(later)
        named = [m.groups() for text in texts if (m := NAMES_A_TEST.fullmatch(text.strip()))]
        found.append(([lines[i] for i in group], named))
    return found


def _names_a_test_of(name: str, path: str, function: str) -> bool:
    """Whether marker test ``name`` is a test of file ``path`` (and is ``function``, if any)."""
    marked_path, _, qualified = name.partition("::")
    return marked_path == path and function in ("", re.sub(r"\[[^\]]*\]$", "", qualified))


def uncited(page) -> tuple[int, list[str]]:
    """How many test files ``page``'s prose cites, and "page:line: citation" for each one
    with no marker naming a test of that file (the one cited, where it names one) in its
    paragraph or directly after it, nor a ``checked by`` test that reads the page."""
    cited, missing = 0, []
    for lines, named in paragraphs(page):
        for number, line in lines:
            for citation in CITATION.finditer(COMMENT.sub("", line)):
                cited += 1
                where = f"{_name(page)}:{number}"
                path, function = citation.group(1), citation.group(2).removeprefix("::")
                if not any(
                    _names_a_test_of(name, path, function)
                    or (kind == "checked" and not function and reads_page(name, page, where))
                    for kind, name in named
                ):
                    missing.append(f"{where}: {citation.group()}")
    return cited, missing


def test_every_test_the_prose_cites_has_a_marker_naming_the_test_that_checks_it():
    """ "tests/x.py checks ..." in prose is a claim: a marker in its paragraph, or directly
    after it, names a test function of that file (the one cited, where it names one), or
    a test that reads the page and checks the sentence itself."""
    found = [uncited(page) for page in PAGES]
    missing = [line for _, lines in found for line in lines]
    assert sum(cited for cited, _ in found) > 50
    assert not missing, (
        "cited tests with no marker naming the test that checks the sentence "
        "(docs/architecture.md, Writing docs):\n" + "\n".join(missing)
    )


def test_the_marker_rules_refuse_what_they_should(tmp_path):
    """The rules above, on cases they must refuse: a name that is no test function, a
    page named only in a docstring or elsewhere in the test's file, a citation whose
    marker names a test of another file or another test than the one cited."""
    page = REPO / "docs" / "slurm.md"
    for bad in (
        "tests/e2e/test_slurm.py",  # no function
        "tests/e2e/test_slurm.py::docs_block",  # a helper, not a test
        "tests/e2e/test_slurm.py::test_no_such_test",
        "tests/e2e/test_no_such_file.py::test_x",
        "tests/e2e/test_slurm.py::TestNoSuchClass::test_x",
    ):
        with pytest.raises(AssertionError):
            find_test(bad, "here")
    find_test("tests/e2e/test_idioms.py::test_idiom_matches_one_device[numpy-jax-2 devices]", "")
    # reads the page through its own code: docs_block("...") reaches DOCS
    slurm = (
        "tests/e2e/test_slurm.py::test_per_node_launcher_recipe_for_a_script_with_its_own_strategy"
    )
    assert reads_page(slurm, page, "here")
    # its file's docstring and DOCS name the page, but this test reaches neither
    assert not reads_page(
        "tests/e2e/test_slurm.py::test_hostlists_expand_as_slurm_writes_them", page, ""
    )
    # named in the test's docstring only
    banner = (
        "tests/project/test_docs.py::test_tensorflow_prints_its_onednn_banner_twice_in_one_process"
    )
    assert not reads_page(banner, page, "here")
    draft = tmp_path / "draft.md"
    cases = {
        "tests/e2e/test_slurm.py checks it.\n": 1,
        "tests/e2e/test_slurm.py checks it.\n<!-- checked by tests/e2e/test_ray.py::"
        "test_tensorflow_trainer_equals_one_device -->\n": 1,
        "tests/e2e/test_slurm.py::test_srun_2_tasks_end_with_the_weights_of_one_process does.\n\n"
        f"<!-- checked by {slurm} -->\n": 1,
        f"tests/e2e/test_slurm.py checks it.\n\n- next item\n<!-- checked by {slurm} -->\n": 1,
        "tests/e2e/test_slurm.py checks it.\n\n<!-- not run: x -->\n"
        f"<!-- checked by {slurm} -->\n": 0,
        "`<!-- checked by tests/test_x.py::test_f -->` is how a marker looks.\n": 0,
        "```\ntests/e2e/test_slurm.py in a block\n```\n": 0,
    }
    for text, count in cases.items():
        draft.write_text(text)
        assert len(uncited(draft)[1]) == count, text


# What a "run here" block needs that its page defines in prose, and what it must have done.
SETUP = {
    "docs/checkpoints.md": """
        import keras, numpy as np, tfdist
        def build_and_compile():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
            return model
        def decay(epoch):
            return 1e-3 if epoch < 3 else 1e-4
        rng = np.random.default_rng(0)
        train = tfdist.data.pipeline(
            (rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 3, 64)),
            per_replica_batch=8, seed=0)
    """,
    "docs/launching.md": """
        import numpy as np
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(256, 784)).astype("float32"), rng.integers(0, 10, 256)
    """,
    "docs/custom_loops.md": """
        import numpy as np
        rng = np.random.default_rng(0)
        features, labels = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 4, 64)
    """,
    "docs/jax.md": """
        import keras, tfdist
        def build_and_compile():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="dense_a"),
                                      keras.layers.Dense(4, name="dense_b")])
            model.compile(optimizer="adam", loss="mse")
            return model
    """,
}
CHECK = {
    "docs/checkpoints.md": "result = {'epoch': initial_epoch, 'steps': int(keras.ops.convert_to_numpy(model.optimizer.iterations)),"
    " 'saved': sorted(os.listdir('ckpt'))}",
    "docs/launching.md": "result = {'steps': int(keras.ops.convert_to_numpy(model.optimizer.iterations)), 'batch': batch}",
    "docs/custom_loops.md": "result = {'step': step, 'epochs': step // ckpt.steps_per_epoch}",
    "docs/jax.md": "result = {'kernel': str(model.layers[0].kernel.value.sharding.spec)}",
}

RUNNER = """
import json, os, sys, tempfile, textwrap
results = {}
for name, setup, code, check in json.loads(sys.argv[1]):
    os.chdir(tempfile.mkdtemp())
    scope = {"__name__": "__main__"}
    exec(textwrap.dedent(setup) + "\\n" + code + "\\nimport os\\n" + check, scope)
    results[name] = scope["result"]
print(json.dumps(results))
"""


def _run_here(names, skip_importing, **env):
    """Runs the ``run here`` blocks of ``names`` in one interpreter, except those that
    import ``skip_importing`` (the other backend's block of a page that has both)."""
    cases = []
    for page in PAGES:
        for line, info, marker, code in blocks(page):
            if f"import {skip_importing}" in code:
                continue
            if marker and marker.group(1) == "run here" and _name(page) in names:
                assert info == "python", f"{_name(page)}:{line}: only python blocks run here"
                cases.append(
                    (f"{_name(page)}:{line}", SETUP[_name(page)], code, CHECK[_name(page)])
                )
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(cases)],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return {k.split(":")[0]: v for k, v in last_json_line(proc.stdout).items()}, len(cases)


@pytest.mark.slow
@pytest.mark.devices
def test_run_here_blocks_run_on_two_tensorflow_devices():
    results, count = _run_here(
        ["docs/checkpoints.md", "docs/launching.md", "docs/custom_loops.md"],
        "jax",
        TFDIST_CPU_DEVICES="2",
    )
    assert count == 3
    ckpts = results["docs/checkpoints.md"]
    assert ckpts["epoch"] == 0 and ckpts["steps"] == 12 * 4  # 64 examples / global batch 16
    assert "ckpt-12.keras" in ckpts["saved"]
    assert results["docs/launching.md"] == {"steps": 3 * 2, "batch": 128}
    assert results["docs/custom_loops.md"]["epochs"] == 3


@pytest.mark.slow
@pytest.mark.jax
def test_run_here_blocks_run_on_four_jax_devices():
    results, count = _run_here(
        ["docs/jax.md", "docs/custom_loops.md"],
        "tensorflow",
        KERAS_BACKEND="jax",
        TFDIST_CPU_DEVICES="4",
    )
    assert count == 2
    assert "model" in results["docs/jax.md"]["kernel"]  # the layout's key matched the kernel
    assert results["docs/custom_loops.md"]["epochs"] == 3


def test_generated_figures_are_current():
    from tools.docs import figures as docs_figures

    for name, (page, block) in docs_figures.blocks().items():
        assert block in page.read_text(), f"{name}: run python -m tools.docs.figures --write"


# What a user's manual never says: the history of its own making.
HISTORY = re.compile(
    r"this round|previous round|before this (round|change)|closing note|the issue'?s?\b|"
    r"how (the project|it) was built|we built|load average",
    re.I,
)


def test_no_page_speaks_of_how_the_project_was_built():
    said = [
        f"{_name(page)}:{n}: {line.strip()}"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not said, "\n".join(said)


def test_readme_is_a_front_page_and_links_every_page_and_notebook():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for page in (REPO / "docs").glob("*.md"):
        if page.name != "index.md":
            assert f"(docs/{page.name})" in text, f"README does not link docs/{page.name}"
    for notebook in (REPO / "notebooks").glob("*.ipynb"):
        assert f"(notebooks/{notebook.name})" in text, f"README does not list {notebook.name}"


def _slug(heading: str) -> str:
    """The anchor mkdocs gives a heading (Python-Markdown's toc slugify)."""
    text = re.sub(r"[^\w\s-]", "", INLINE_CODE.sub(lambda m: m.group()[1:-1], heading))
    return re.sub(r"[-\s]+", "-", text.strip().lower())


def test_readme_links_resolve():
    """Every relative link of README.md names a file of the repository, and its #anchor,
    where it has one, a heading of that page."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"\w+://", link)]
    assert len(local) > 20
    for link in local:
        path, _, anchor = link.partition("#")
        target = REPO / path
        assert target.is_file(), f"README.md links {link}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", COMMENT.sub("", target.read_text()), re.M)
            assert anchor in {_slug(h) for h in headings}, f"README.md links {link}: no heading"


def test_get_started_shows_the_readme_usage_script():
    """docs/get_started.md's first script is README.md's Usage block, character for
    character, so the page shows what tests/project/test_readme.py runs."""
    readme = (REPO / "README.md").read_text().split("\n## Usage\n", 1)[1]
    usage = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    page = (REPO / "docs" / "get_started.md").read_text().split("\n## A first script\n", 1)[1]
    shown = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    assert shown == usage, "docs/get_started.md: copy README.md's Usage block"


def test_the_site_builds_strictly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    built = {p.parent.name for p in (tmp_path / "site").rglob("index.html")}
    assert {"data", "checkpoints", "launching", "jax", "scaling"} <= built


def test_testing_page_says_exactly_which_suites_run_on_the_newest_jax_in_ci():
    """docs/testing.md's "What runs where" names exactly the suites .ci/run's newest-jax session
    runs (noxfile.py's CI_NEWEST_JAX_TESTS) and that session's jax."""
    nox_tree = ast.parse((REPO / "noxfile.py").read_text())
    listed = next(
        ast.literal_eval(node.value)
        for node in nox_tree.body
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", "") == "CI_NEWEST_JAX_TESTS"
    )
    ci = (REPO / ".ci" / "run").read_text()
    assert "CI_NEWEST_JAX_TESTS" in ci and "$NEWEST_JAX_ARGS" in ci
    # Every JAX suite (noxfile.py's JAX_TESTS) runs on the newest jax in CI.
    jax_tests = next(
        ast.literal_eval(node.value)
        for node in nox_tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "JAX_TESTS"
    )
    assert sorted(listed) == sorted(jax_tests)
    session = re.search(r"JAX_SESSION=\"jax\(python='[\d.]+', jax='([\d.]+)'\)\"", ci)
    readme = " ".join((REPO / "docs" / "testing.md").read_text().split())
    sentence = re.search(
        rf"On jax {re.escape(session.group(1))} \(Python [\d.]+\) CI runs only (.+?)\. ", readme
    )
    assert sentence, "docs/testing.md: no 'On jax X (Python Y) CI runs only ...' for .ci/run's jax"
    assert re.findall(r"tests/(?:\w+/)?test_\w+\.py", sentence.group(1)) == listed


def test_the_newest_jax_session_leaves_out_tensorflow_cells_and_tests_marked_tensorflow():
    """``--backend=jax`` (noxfile.py's CI_NEWEST_JAX_OPTIONS) deselects the TensorFlow cells
    and the tests marked ``tensorflow`` of the session's files, and keeps every JAX cell."""
    files = ["tests/test_custom_loops.py", "tests/e2e/test_idioms.py"]

    def collected(*options: str) -> set[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *options, *files],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return {line for line in proc.stdout.splitlines() if "::" in line}

    every, kept = collected(), collected(*_nox_list("CI_NEWEST_JAX_OPTIONS"))
    left_out = every - kept
    assert (
        "tests/test_custom_loops.py::test_jax_loop_with_sharded_checkpoints_in_a_bucket_resumes_after_kill_9"
        in kept
    )
    assert not {test for test in left_out if "jax" in test.lower()}, left_out
    marked = {
        "tests/test_custom_loops.py::test_tensorflow_loop_in_a_bucket_resumes_after_kill_9_like_one_device",
        "tests/e2e/test_idioms.py::test_predict_on_batch_returns_one_row_per_example_under_two_replicas",
    }
    assert marked <= left_out
    assert any("-tensorflow-" in test for test in left_out)  # a TensorFlow cell


def _nox_list(name: str) -> list[str]:
    """A list assigned at noxfile.py's top level."""
    tree = ast.parse((REPO / "noxfile.py").read_text())
    return next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name
    )


def _has_jax_cells(path: Path) -> bool:
    """Whether a test file runs something on JAX: it imports jax, or its code (docstrings
    aside) holds the backend name ``"jax"`` or a cell named ``"jax ..."``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "jax" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jax":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value == "jax" or node.value.startswith("jax "):
                return True
    return False


def test_every_test_file_with_jax_cells_is_placed_for_the_newest_jax():
    """A scan of tests/ for files with JAX cells: each one found is either run on the newest
    jax in CI (noxfile.py's CI_NEWEST_JAX_TESTS) or listed as running its JAX cells in CI's
    main test command only (JAX_CELLS_MAIN_STAGE_ONLY, which docs/testing.md's "What runs
    where" names); the two lists are apart, name existing files, and the second holds only files
    the scan finds. A new test file with a JAX cell fails here until it is placed."""
    newest = _nox_list("CI_NEWEST_JAX_TESTS")
    main_only = _nox_list("JAX_CELLS_MAIN_STAGE_ONLY")
    found = {
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if _has_jax_cells(path)
    }
    assert not set(newest) & set(main_only)
    assert all((REPO / name).is_file() for name in newest + main_only)
    assert sorted(found - set(newest) - set(main_only)) == [], "place these in noxfile.py"
    assert sorted(set(main_only) - found) == [], "no JAX cell found in these"
    page = " ".join((REPO / "docs" / "testing.md").read_text().split())
    assert "`JAX_CELLS_MAIN_STAGE_ONLY`" in page and "every JAX suite" not in page


def _extra(name: str) -> list[str]:
    """setup.py's ``extras_require[name]``."""
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == name:
                    return ast.literal_eval(value)
    raise AssertionError(f"setup.py has no extra {name!r}")


def test_testing_page_says_how_ci_runs_the_ray_tests():
    """docs/testing.md's "What runs where": Ray's tests skip in the test command, which does not
    install Ray; .ci/run then installs .[ray] into the same environment and runs them in
    a stage of their own, where a missing Ray fails them."""
    readme = " ".join((REPO / "docs" / "testing.md").read_text().split())
    said = re.search(r"Ray's tests \(`(tests/e2e/test_\w+\.py)`\) skip in the test command", readme)
    assert said, 'docs/testing.md: no "Ray\'s tests (`tests/...`) skip in the test command"'
    suite = said.group(1)
    test_extra = _extra("test")
    nested = {n for r in test_extra if r.startswith("tfdist[") for n in r[7:-1].split(",")}
    assert not any(r.startswith("ray") for r in test_extra) and "ray" not in nested, test_extra
    assert any(r.startswith("ray[train]") for r in _extra("ray"))
    ci = (REPO / ".ci" / "run").read_text()
    stage = re.search(
        r"\. \.venv/bin/activate && pip install -q -e '\.\[ray\]' && "
        rf"TFDIST_TEST_FULL_IMPORTS=1 TFDIST_RAY_STAGE=1 python -m pytest {re.escape(suite)}\b",
        ci,
    )
    assert stage and ci.index('bash -c "$TEST_CMD"') < stage.start(), ".ci/run: no Ray stage"
    if importlib.util.find_spec("ray") is not None:
        return  # the suite would run Ray here; what it does without Ray is shown elsewhere
    outcomes = {}
    for stage_env in (None, "1"):
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", suite],
            cwd=REPO,
            env=child_env(
                TFDIST_RAY_STAGE=stage_env, PYTEST_XDIST_WORKER=None, PYTEST_ADDOPTS=None
            ),
            capture_output=True,
            text=True,
            timeout=180,
        )
        outcomes[stage_env] = (proc.returncode, proc.stdout + proc.stderr)
    code, out = outcomes[None]
    # 5: pytest's "no tests ran", as the one file of a run, every test of it skipped
    assert code in (0, 5) and re.search(r"\b\d+ skipped\b", out), out[-3000:]
    assert not re.search(r"\b\d+ (passed|failed|errors?)\b", out), out[-3000:]
    code, out = outcomes["1"]
    assert code != 0 and "TFDIST_RAY_STAGE is set but ray is not installed" in out, out[-3000:]


def test_tensorflow_prints_its_onednn_banner_twice_in_one_process():
    """docs/ray.md: "TensorFlow 2.21 prints its oneDNN banner twice in
    every process that imports it, Ray or not, before TF_CPP_MIN_LOG_LEVEL applies":
    ``import tensorflow`` alone, with TF_CPP_MIN_LOG_LEVEL=2 and oneDNN at its default,
    prints exactly two banner lines, both from that one process."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os, tensorflow as tf; print(tf.__version__, os.getpid())"],
        env=child_env(TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS=None),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, pid = proc.stdout.split()[-2:]
    if not version.startswith("2.21."):
        pytest.skip(f"the page speaks of TensorFlow 2.21; this is {version}")
    banners = [line for line in proc.stderr.splitlines() if "oneDNN custom operations" in line]
    assert len(banners) == 2, proc.stderr[-3000:]
    # glog's "I0000 00:00:TIME TID file:line] ...": printed while importing, on the main
    # thread, whose thread id is the process id
    assert {line.split()[2] for line in banners} == {pid}, proc.stderr[-3000:]
