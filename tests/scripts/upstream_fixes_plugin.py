"""pytest plugin: upstream Keras's own tests with every tfdist fix applied, or without tfdist.

Loaded by tests/compat/test_upstream_keras.py as ``-p upstream_fixes_plugin``: applies every
fix before the first test and reports which, so a fix that changed what upstream gets
right shows up as a failing upstream test. With ``TFDIST_UPSTREAM_FIXES=off`` it only
registers Keras's markers and never imports tfdist: the same tests as upstream runs them.

With ``TFDIST_UPSTREAM_SCOPE=1`` every test (its set-up too) runs inside
``tfdist.scope()``, over the ``TFDIST_CPU_DEVICES`` logical devices, so the models a test
builds through Keras's strategy-agnostic path are mirrored; tfdist is then imported in
both runs, its fixes excluded (``TFDIST_COMPAT_EXCLUDE=all``) in the ``off`` one.
"""

import os

SCOPED = os.environ.get("TFDIST_UPSTREAM_SCOPE") == "1"


def pytest_configure(config):
    # Keras's own conftest (not in the wheel) defines this marker; on TensorFlow, a
    # trainable backend, it selects nothing out.
    config.addinivalue_line("markers", "requires_trainable_backend: needs a trainable backend")
    config.addinivalue_line("markers", "multi_device: needs several devices (Keras's marker)")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    off = os.environ.get("TFDIST_UPSTREAM_FIXES") == "off"
    if off and not SCOPED:
        config._tfdist_applied = ["none (tfdist not imported)"]
        return
    if off:
        os.environ["TFDIST_COMPAT_EXCLUDE"] = "all"
    import keras  # noqa: F401  - the fixes patch keras, so it is imported first

    import tfdist  # noqa: F401  - its start-up hooks (logical devices) before TensorFlow starts
    from tfdist import compat

    applied = compat.applied() if off else compat.apply_all(exclude=[])
    config._tfdist_applied = applied or ["none (excluded)"]
    if SCOPED:
        config._tfdist_applied.append(f"scope: {tfdist.num_replicas()} replicas")
        _scope_every_test()


def pytest_report_header(config):
    return f"tfdist fixes applied: {','.join(config._tfdist_applied)}"


def _scope_every_test() -> None:
    """Enters ``tfdist.scope()`` at the end of Keras's ``TestCase.setUp`` (which clears
    the session, and with it TensorFlow's graph and its strategy stack: a scope entered
    before it could not be left) and leaves it after the test's own tear-down."""
    from keras.src.testing import test_case

    import tfdist

    original = test_case.TestCase.setUp

    def setUp(self):  # noqa: N802 - unittest's name
        original(self)
        scope = tfdist.scope()
        scope.__enter__()
        self.addCleanup(scope.__exit__, None, None, None)

    test_case.TestCase.setUp = setUp
