"""tfdist.quiet: the known-harmless noise is hidden, anything else is shown."""

from __future__ import annotations

import logging
import warnings

import pytest

from tfdist import quiet

NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795372796.12 15301 cudart_stub.cc:31] Could not find cuda drivers on your "
    "machine, GPU will not be used.",
    "E0000 00:00:1795372797.39 15301 cuda_platform.cc:52] failed call to cuInit: INTERNAL: "
    "CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    "I0000 00:00:1795372792.70 15298 cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.",
    "UserWarning: `shuffle=True` was passed, but will be ignored since the data `x` was "
    "provided as a tf.data.Dataset. The Dataset is expected to already be shuffled",
]
SIGNAL = [
    "E0000 00:00:1.0 1 coordination_service.cc:1] The following tasks are unhealthy "
    "(stopped sending heartbeats): /job:worker/replica:0/task:1",
    "ValueError: Input 0 of layer dense is incompatible with the layer",
    "failed call to cuInit: CUDA_ERROR_OUT_OF_MEMORY",
]


@pytest.mark.parametrize("line", NOISE)
def test_known_noise_is_harmless(line):
    assert quiet.is_harmless(line)


@pytest.mark.parametrize("line", SIGNAL)
def test_real_problems_are_never_hidden(line):
    assert not quiet.is_harmless(line)


def test_every_entry_says_why():
    assert all(len(why.split()) >= 5 for _, why in quiet.HARMLESS)


def test_install_filters_warnings_and_framework_loggers(monkeypatch, caplog):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.install()
        warnings.warn(NOISE[-1][len("UserWarning: ") :], UserWarning, stacklevel=1)
        warnings.warn("something new", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something new"]
    logger = logging.getLogger("tensorflow")
    with caplog.at_level(logging.INFO, logger="tensorflow"):
        logger.info("Using CollectiveAllReduceStrategy eagerly has significant overhead")
        logger.info("a real message")
    assert [r.getMessage() for r in caplog.records] == ["a real message"]
    import os

    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"
