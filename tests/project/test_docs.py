"""The manual keeps its promises: every code block is checked or says why not, generated
figures are current, the site builds strictly, and no page speaks of how it was made.

The marker convention (docs/architecture.md, "Writing docs"): the line before each fenced
block is ``<!-- run by tests/test_x.py::test_function -->``, ``<!-- same as
tests/scripts/x.py -->``, ``<!-- run here -->`` (this file runs it) or ``<!-- not run: why
-->``. A claim in prose names the test that checks it with ``<!-- checked by
tests/test_x.py::test_function -->``; every such name must be a test function that exists.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, child_env, last_json_line

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- (run by (\S+)|same as (\S+)|run here|not run: .+?) -->")
CHECKED_BY = re.compile(r"<!-- (?:run|checked) by (\S+?) -->")


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


def _name(page) -> str:
    return page.relative_to(REPO).as_posix()


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
            if marker.group(2):  # run by a test function: it must read this page
                source = source_of_test_function(marker.group(2), where)
                assert page.name in source, (
                    f"{where}: {marker.group(2)} never reads {page.name} (nor what it calls)"
                )
            elif marker.group(3):  # an excerpt: every line, in order, in the script
                source = (REPO / marker.group(3)).read_text().splitlines()
                k = 0
                for text in filter(str.strip, code.splitlines()):
                    stripped = [s.rstrip() for s in source[k:]]
                    assert text.rstrip() in stripped, f"{where}: {text!r} not in {marker.group(3)}"
                    k += stripped.index(text.rstrip()) + 1


def source_of_test_function(name: str, where: str) -> str:
    """The source of test function ``tests/test_x.py::test_f`` and of every module-level
    function, class and constant of its file it uses, transitively; fails (naming
    ``where``) when the file or the function does not exist."""
    path, _, function = name.partition("::")
    test = REPO / path
    assert test.is_file() and path.startswith("tests/"), f"{where}: no test file {path}"
    assert function.startswith("test_"), f"{where}: {name!r} names no test (file::test_f)"
    text = test.read_text()
    tree = ast.parse(text)
    top = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            top[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            top.update({t.id: node for t in targets if isinstance(t, ast.Name)})
    assert function in top and isinstance(top[function], ast.FunctionDef), (
        f"{where}: {path} defines no function {function}"
    )
    seen, todo = set(), [function]
    while todo:
        node = top[todo.pop()]
        if id(node) in seen:
            continue
        seen.add(id(node))
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        used |= {
            a.arg for n in ast.walk(node) if isinstance(n, ast.FunctionDef) for a in n.args.args
        }  # fixtures: module-level functions named like them
        todo += [name for name in used if name in top]
    return "\n".join(
        ast.get_source_segment(text, node) or "" for node in tree.body if id(node) in seen
    )


def test_every_run_by_and_checked_by_names_a_test_function_that_exists():
    found = 0
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            marker = CHECKED_BY.fullmatch(line.strip())  # a line of its own, not prose
            if marker:
                source_of_test_function(marker.group(1), f"{_name(page)}:{number}")
                found += 1
    assert found


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
    "docs/multi_worker.md": """
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
    "docs/multi_worker.md": "result = {'steps': int(keras.ops.convert_to_numpy(model.optimizer.iterations)), 'batch': batch}",
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
        ["docs/checkpoints.md", "docs/multi_worker.md", "docs/custom_loops.md"],
        "jax",
        TFDIST_CPU_DEVICES="2",
    )
    assert count == 3
    ckpts = results["docs/checkpoints.md"]
    assert ckpts["epoch"] == 0 and ckpts["steps"] == 12 * 4  # 64 examples / global batch 16
    assert "ckpt-12.keras" in ckpts["saved"]
    assert results["docs/multi_worker.md"] == {"steps": 3 * 2, "batch": 128}
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
    sys.path.insert(0, str(REPO / "tools"))
    import docs_figures

    for name, (page, block) in docs_figures.blocks().items():
        assert block in page.read_text(), f"{name}: run python tools/docs_figures.py --write"


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
    assert len(text.splitlines()) <= 300
    for page in (REPO / "docs").glob("*.md"):
        if page.name != "index.md":
            assert f"(docs/{page.name})" in text, f"README does not link docs/{page.name}"
    for notebook in (REPO / "notebooks").glob("*.ipynb"):
        assert f"(notebooks/{notebook.name})" in text, f"README does not list {notebook.name}"


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
    assert {"data", "checkpoints", "multi_worker", "jax", "scaling"} <= built


def test_readme_says_exactly_which_suites_run_on_the_newest_jax_in_ci():
    """README's "What runs where" names exactly the suites .ci/run's newest-jax session
    runs (noxfile.py's CI_NEWEST_JAX_TESTS) and that session's jax."""
    nox_tree = ast.parse((REPO / "noxfile.py").read_text())
    listed = next(
        ast.literal_eval(node.value)
        for node in nox_tree.body
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", "") == "CI_NEWEST_JAX_TESTS"
    )
    ci = (REPO / ".ci" / "run").read_text()
    assert "CI_NEWEST_JAX_TESTS" in ci and "$NEWEST_JAX_TESTS" in ci
    session = re.search(r"JAX_SESSION=\"jax\(python='[\d.]+', jax='([\d.]+)'\)\"", ci)
    readme = " ".join((REPO / "README.md").read_text().split())
    sentence = re.search(
        rf"On jax {re.escape(session.group(1))} \(Python [\d.]+\) CI runs only (.+?)\. ", readme
    )
    assert sentence, "README.md: no 'On jax X (Python Y) CI runs only ...' for .ci/run's jax"
    assert re.findall(r"tests/(?:\w+/)?test_\w+\.py", sentence.group(1)) == listed
