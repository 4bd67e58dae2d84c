"""pytest plugin: upstream Keras's own tests with every tfdist fix applied, or without tfdist.

Loaded by tests/compat/test_upstream_keras.py as ``-p upstream_fixes_plugin``: applies every
fix before the first test and reports which, so a fix that changed what upstream gets
right shows up as a failing upstream test. With ``TFDIST_UPSTREAM_FIXES=off`` it only
registers Keras's markers and never imports tfdist: the same tests as upstream runs them.
"""

import os


def pytest_configure(config):
    # Keras's own conftest (not in the wheel) defines this marker; on TensorFlow, a
    # trainable backend, it selects nothing out.
    config.addinivalue_line("markers", "requires_trainable_backend: needs a trainable backend")
    config.addinivalue_line("markers", "multi_device: needs several devices (Keras's marker)")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if os.environ.get("TFDIST_UPSTREAM_FIXES") == "off":
        config._tfdist_applied = ["none (tfdist not imported)"]
        return
    import keras  # noqa: F401  - the fixes patch keras, so it is imported first

    from tfdist import compat

    applied = compat.apply_all(exclude=[])
    config._tfdist_applied = applied


def pytest_report_header(config):
    return f"tfdist fixes applied: {','.join(config._tfdist_applied)}"
