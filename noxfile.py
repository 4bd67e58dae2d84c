"""Test sessions per TensorFlow/Keras pair in tfdist's verified range (tfdist/versions.py).

CI runs the newest pair (the project's own test command). The others run on demand:

    pip install nox
    nox -l                          # the sessions
    nox -s "compat(tf='2.20')"      # the oldest verified pair
    nox                             # every pair

Each session installs tfdist with the pinned pair and runs the tests that touch what the
fixes patch: the upstream failures each fix reproduces (test_compat), the private names
tfdist relies on (test_private), start-up in any statement order (test_startup) and the
1-device = N-device equivalence tests (test_distribute, test_callbacks).
"""

import os

import nox

# (tensorflow, keras): each TensorFlow minor with the Keras release current when it
# shipped. tfdist/versions.py's VERIFIED spans exactly these.
PAIRS = {
    "2.21": ("2.21.0", "3.15.1"),
    "2.20": ("2.20.0", "3.11.3"),
}
TESTS = [
    "tests/test_compat.py",
    "tests/test_private.py",
    "tests/test_startup.py",
    "tests/test_distribute.py",
    "tests/test_callbacks.py",
    "tests/test_versions.py",
]

nox.options.reuse_existing_virtualenvs = True


@nox.session(python="3.11")
@nox.parametrize("tf", list(PAIRS))
def compat(session: nox.Session, tf: str) -> None:
    tensorflow, keras = PAIRS[tf]
    session.install("-e", ".[test]", f"tensorflow=={tensorflow}", f"keras=={keras}")
    env = {}
    if os.environ.get("TFDS_DATA_DIR"):
        env["TFDS_DATA_DIR"] = os.environ["TFDS_DATA_DIR"]
    session.run("python", "-m", "pytest", *TESTS, *session.posargs, env=env)
