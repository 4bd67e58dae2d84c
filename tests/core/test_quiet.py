"""tfdist.core.quiet: the known-harmless noise is hidden, anything else is shown."""

from __future__ import annotations

import logging
import warnings

import pytest

from tfdist.core import quiet

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
    "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
    "W0000 00:00:1.0 1 dataset.cc:997] Input of GeneratorDatasetOp::Dataset will not be "
    "optimized because the dataset does not implement the AsGraphDefInternal() method",
    # On CPUs with AVX-512 (TF 2.20-2.21), as the absl line and as the older stamped form.
    "I0000 00:00:1795482133.9 1 port.cc:153] oneDNN custom operations are on. You may see "
    "slightly different numerical results due to floating-point round-off errors from "
    "different computation orders. To turn them off, set the environment variable "
    "`TF_ENABLE_ONEDNN_OPTS=0`.",
    "2026-11-24 01:50:00.123456: I tensorflow/core/util/port.cc:113] oneDNN custom operations "
    "are on. You may see slightly different numerical results due to floating-point round-off",
    "An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not installed. "
    "Falling back to cpu.",
    "Unable to initialize backend 'cuda': module 'jaxlib.cuda' has no attribute",
    "WARNING:tensorflow:Using CollectiveAllReduceStrategy eagerly has significant overhead",
]
SIGNAL = [
    "E0000 00:00:1.0 1 coordination_service.cc:1] The following tasks are unhealthy "
    "(stopped sending heartbeats): /job:worker/replica:0/task:1",
    "ValueError: Input 0 of layer dense is incompatible with the layer",
    "failed call to cuInit: CUDA_ERROR_OUT_OF_MEMORY",
    "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 3",
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


def test_filtered_stderr_drops_harmless_lines_written_to_fd_2(capfd):
    import os

    with quiet.filtered_stderr():
        os.write(2, (NOISE[2] + "\n").encode())  # as TensorFlow's C++ code writes it
        os.write(2, (SIGNAL[0] + "\n").encode())
    assert capfd.readouterr().err == SIGNAL[0] + "\n"
    os.write(2, b"after\n")  # stderr is restored
    assert capfd.readouterr().err == "after\n"


def test_import_tfdist_hides_only_the_warning_about_fits_default_shuffle():
    import warnings

    from tfdist.core import quiet

    message = (
        "`shuffle=True` was passed, but will be ignored since the data `x` was provided as "
        "a tf.data.Dataset. The Dataset is expected to already be shuffled."
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.install_defaults()
        warnings.warn(message, UserWarning, stacklevel=1)
        warnings.warn("a real problem", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a real problem"]
