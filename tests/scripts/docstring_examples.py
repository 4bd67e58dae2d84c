"""Runs the docstring examples of tfdist modules, each module in a process of its own.

    python docstring_examples.py MODE MODULE...

Each module is imported alone in a child forked from this process, which holds nothing
but the standard library (``fresh``), or also TensorFlow, Keras and JAX (``framework``:
the children then need not import them each):

- ``fresh``: importing TensorFlow, JAX or Keras is refused, in the import and in the
  examples. A module whose import asks for one needs a framework (``needs`` names it)
  and none of its examples runs; a docstring of another module whose examples ask for
  one is set aside whole (``set_aside``). Every other example runs.
- ``framework``: every example of every module runs.

Prints one JSON line per module: ``{"module", "needs", "lines", "skipped", "set_aside",
"failures"}``: ``lines`` counts the example source lines run (``# doctest: +SKIP`` ones
not run are in ``skipped`` instead), ``set_aside`` those of the docstrings set aside,
``failures`` doctest's report of each failing example.
"""

from __future__ import annotations

import doctest
import importlib
import json
import os
import sys

FRAMEWORKS = ("tensorflow", "jax", "keras")


class NeedsFramework(BaseException):
    """Raised at a framework's import: no ``except ImportError``/``Exception`` hides it."""


class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in FRAMEWORKS:
            raise NeedsFramework(name.partition(".")[0])
        return None


class _Runner(doctest.DocTestRunner):
    """A doctest runner that notes an example asking for a refused framework."""

    asked = False

    def report_unexpected_exception(self, out, test, example, exc_info):
        if issubclass(exc_info[0], NeedsFramework):
            self.asked = True
        super().report_unexpected_exception(out, test, example, exc_info)


def _examples(name: str, refuse: bool) -> dict:
    result = {"module": name, "needs": None, "lines": 0, "skipped": 0, "set_aside": 0}
    result["failures"] = []
    if refuse:
        sys.meta_path.insert(0, _Refuse())
    try:
        module = importlib.import_module(name)
    except NeedsFramework as err:
        result["needs"] = str(err)
        return result
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
        runner = _Runner(optionflags=doctest.ELLIPSIS)
        report: list[str] = []
        runner.run(test, out=report.append)
        lines = [example.source.count("\n") for example in test.examples]
        skipped = [
            n for n, ex in zip(lines, test.examples, strict=True) if ex.options.get(doctest.SKIP)
        ]
        if runner.asked:
            result["set_aside"] += sum(lines)
            continue
        result["lines"] += sum(lines) - sum(skipped)
        result["skipped"] += sum(skipped)
        result["failures"] += report
    loaded = [f for f in FRAMEWORKS if f in sys.modules]
    assert not refuse or not loaded, f"{name} loaded {loaded} past the refusal"
    return result


def _in_child(name: str, refuse: bool) -> dict:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one module, then out without running the parent's cleanup
        os.close(read)
        try:
            result = _examples(name, refuse)
        except BaseException as err:  # noqa: BLE001 - reported to the parent, not lost
            result = {"module": name, "failures": [f"{name}: {type(err).__name__}: {err}"]}
        with os.fdopen(write, "w") as out:
            out.write(json.dumps(result))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        text = answer.read()
    os.waitpid(pid, 0)
    return json.loads(text) if text else {"module": name, "failures": [f"{name}: no answer"]}


def main(mode: str, names: list[str]) -> None:
    if mode == "framework":
        import jax  # noqa: F401 - imported once here, inherited by every child
        import keras  # noqa: F401
        import tensorflow  # noqa: F401
    for name in names:
        print(json.dumps(_in_child(name, refuse=mode == "fresh")), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
