"""The verified version range: in or out, one warning per package, tfdist still runs."""

import subprocess
import sys
import warnings

import pytest

from tfdist.core import process, versions


@pytest.fixture(autouse=True)
def _fresh_state():
    process.reset()
    yield
    process.reset()


def test_range_ends_are_inclusive_and_outside_is_outside():
    for package, (oldest, newest) in versions.VERIFIED.items():
        assert versions.in_range(package, f"{oldest}.0")
        assert versions.in_range(package, f"{newest}.9")
        major, minor = (int(p) for p in newest.split("."))
        assert not versions.in_range(package, f"{major}.{minor + 1}.0")


def test_installed_versions_are_the_verified_ones():
    # CI installs the newest verified pair; a newer release on the registry must show up
    # here (and in a nox session) before the range is widened.
    for package in versions.VERIFIED:
        installed = versions.installed(package)
        assert installed is None or versions.in_range(package, installed), (package, installed)


def test_outside_the_range_warns_once_and_names_what_to_install():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert versions.check("tensorflow", "2.99.0") is False
        assert versions.check("tensorflow", "2.99.0") is False
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "tensorflow 2.99.0" in text and "2.20-2.21" in text
    assert "pip install 'tensorflow>=2.20,<2.22'" in text


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"package must be one of .*Received: package='torch'"):
        versions.in_range("torch", "2.0")
    with pytest.raises(ValueError, match=r"version must start with MAJOR.MINOR.*'latest'"):
        versions.in_range("keras", "latest")


def test_a_process_outside_the_range_still_trains():
    # Pretend the installed Keras is newer than verified: the import-time check warns
    # once on stderr, and tfdist still builds and fits a model.
    script = (
        "import importlib.metadata as md\n"
        "real = md.version\n"
        "md.version = lambda name: '3.99.0' if name == 'keras' else real(name)\n"
        "import tfdist, keras, numpy as np\n"
        "with tfdist.scope():\n"
        "    m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
        "    m.compile('sgd', 'mse')\n"
        "m.fit(np.ones((8, 2)), np.ones((8, 1)), verbose=0)\n"
        "print('trained')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained" in done.stdout
    assert done.stderr.count("keras 3.99.0 is outside the range") == 1
