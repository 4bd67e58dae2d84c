"""Test children skip two optional upstream imports that tfdist never uses.

The suite starts hundreds of Python processes, and each pays for what ``import tensorflow``
pulls in. Two of those imports are optional upstream (each sits in ``try/except
ImportError``) and unused by tfdist and the tests:

- jax, imported by tf.lite (``tensorflow/lite/python/util.py``, for TFLite's jax
  conversion) and by Keras's ``OrbaxCheckpoint`` module (a compatibility patch);
- matplotlib.pyplot, imported by ``keras.src.visualization`` (``plot_image_gallery``).

Measured on a 2-core machine: ``import tensorflow, keras`` 8.5-10 s with them, 6.8-7.3 s
without. Only those importers are refused: a script, Keras's JAX backend, Orbax or a
notebook that imports jax or matplotlib itself gets it as usual. tests/conftest.py puts
this folder on the children's ``PYTHONPATH``; ``TFDIST_TEST_FULL_IMPORTS=1`` turns it off.
"""

import os
import sys

# Top-level package -> the modules whose import of it is refused.
_SKIPPED = {
    "jax": ("tensorflow.lite.", "keras.src.callbacks.orbax_checkpoint"),
    "matplotlib": ("keras.src.visualization.",),
}


class _SkipOptionalImports:
    """A meta-path finder that raises ImportError for ``_SKIPPED``'s importers only."""

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        importers = _SKIPPED.get(top)
        if importers is None or top in sys.modules:
            return None
        frame = sys._getframe(1)
        # The first frame outside importlib's machinery is the importing module's.
        while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if importer.startswith(importers):
            raise ImportError(f"{name}: optional import skipped in tfdist's tests ({importer})")
        return None


if os.environ.get("TFDIST_TEST_FULL_IMPORTS") != "1":
    sys.meta_path.insert(0, _SkipOptionalImports())


# The process ledger (tools/test_processes.py): with TFDIST_TEST_LEDGER set, every Python
# process that starts with this folder on its path appends one JSON line when it starts and
# one when it exits normally (CPU seconds of all its threads), tagged with the pytest test
# that started it (pytest sets PYTEST_CURRENT_TEST in the environment children inherit). A
# process killed (kill -9) has a start line only.
_AT_EXIT = None  # this process's exit note, once _ledger registered it


def _ledger(path: str) -> None:
    import atexit
    import json
    import resource
    import time

    start = time.time()
    base = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
        "argv": sys.argv[:3] if hasattr(sys, "argv") else [],
    }

    def write(record: dict) -> None:
        line = json.dumps({**base, **record}) + "\n"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())  # one write to an O_APPEND file: lines never mix
            finally:
                os.close(fd)
        except OSError:
            pass

    def at_exit() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        write(
            {
                "event": "exit",
                "argv": sys.argv[:3],  # complete only now (at start, "-m" lacks its module)
                "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
                "wall_s": round(time.time() - start, 2),
                "tensorflow": "tensorflow" in sys.modules,
                "jax": "jax" in sys.modules,
            }
        )

    write({"event": "start"})
    atexit.register(at_exit)
    global _AT_EXIT
    _AT_EXIT = at_exit  # a job forked from this process unregisters it (tests/warm_start.py)
    # os._exit skips atexit (workers end that way to skip TensorFlow's teardown): note first.
    real_exit = os._exit

    def exit_noted(code: int) -> None:
        at_exit()
        real_exit(code)

    os._exit = exit_noted


if os.environ.get("TFDIST_TEST_LEDGER"):
    _ledger(os.environ["TFDIST_TEST_LEDGER"])
