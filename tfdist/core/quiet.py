"""The known-harmless start-up noise of TensorFlow, Keras and jax, listed once with why.

The ``tfdist`` command, the launcher and the notebooks hide these by default
(``--verbose`` shows everything); a script that only imports tfdist is left alone.
Anything not listed here is shown: an unknown warning is never assumed harmless.

Example:
    >>> is_harmless("I0000 00:00:1795372797.41 15301 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.")
    True
    >>> is_harmless("ValueError: shapes do not match")
    False
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings

__all__ = [
    "HARMLESS",
    "WRONG_DEFAULTS",
    "is_harmless",
    "quiet_environment",
    "install",
    "install_defaults",
    "filtered_stderr",
]

# (pattern searched in a line of output or a warning message, why it is harmless)
HARMLESS: tuple[tuple[str, str], ...] = (
    (
        r"All log messages before absl::InitializeLog\(\) is called are written to STDERR",
        "absl announces where its early log lines go; says nothing about the job",
    ),
    (
        r"Could not find cuda drivers on your machine, GPU will not be used",
        "a CPU-only machine: TensorFlow says it uses the CPU, as intended",
    ),
    (
        r"failed call to cuInit: .*(UNKNOWN ERROR \(303\)|CUDA_ERROR_NO_DEVICE)",
        "CUDA probed for a GPU on a machine without one (an E-level line, not an error)",
    ),
    (
        r"cpu_feature_guard\.cc.*This TensorFlow binary is optimized",
        "TensorFlow's build banner about CPU instructions",
    ),
    (
        r"To enable the following instructions: .* rebuild TensorFlow",
        "second line of the same banner",
    ),
    (
        r"oneDNN custom operations are on\. You may see slightly different numerical results",
        "TensorFlow uses oneDNN kernels on this CPU (AVX-512 and newer): results differ from "
        "other kernels by floating-point round-off only, as any change of summation order does",
    ),
    (
        r"An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not installed",
        "jax's CPU-only wheel on a machine with an NVIDIA driver: jax uses the CPU, as installed",
    ),
    (
        r"Unable to initialize backend '(cuda|rocm|tpu)'",
        "jax probing accelerators this machine does not have; it falls back to the CPU",
    ),
    (
        r"Unable to register cu(DNN|FFT|BLAS) factory",
        "TensorFlow and jax both registering CUDA plugins in one process",
    ),
    (
        r"Using CollectiveAllReduceStrategy eagerly has significant overhead",
        "printed once per eager collective outside fit; fit runs compiled functions",
    ),
    (
        r"GeneratorDatasetOp.*will not be optimized",
        "tf.data cannot optimise a Python generator; input cost is measured separately",
    ),
    (
        r"`shuffle=True` was passed, but will be ignored since the data `x` was provided as a "
        r"tf\.data\.Dataset",
        "fit's default shuffle=True does not apply to datasets; tfdist pipelines shuffle "
        "themselves (seeded)",
    ),
    (
        r"Reduce to /job:.* then broadcast to",
        "an INFO line per all-reduce of the multi-worker strategy",
    ),
    (
        r"\[Gloo\] Rank \d+ is connected to (?P<gloo>\d+) peer ranks\. "
        r"Expected number of connected peer ranks is : (?P=gloo)\s*$",
        "jax's CPU collectives all connected, as expected (a mismatch is still shown)",
    ),
)

_COMPILED = re.compile("|".join(f"(?:{pattern})" for pattern, _ in HARMLESS))


def is_harmless(text: str) -> bool:
    """Whether a line of output (or a warning message) is known-harmless noise."""
    return bool(_COMPILED.search(text))


def quiet_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a quiet child process: TensorFlow's C++ INFO/WARNING lines off
    (``TF_CPP_MIN_LOG_LEVEL=2``) unless the user chose a level.

    Example:
        >>> quiet_environment({})["TF_CPP_MIN_LOG_LEVEL"]
        '2'
    """
    env = dict(os.environ if environ is None else environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


# Warnings raised about a DEFAULT argument the user never passed: wrong for every script
# that imports tfdist, so ``import tfdist`` hides them (``install_defaults``).
WRONG_DEFAULTS: tuple[str, ...] = (
    # fit(shuffle=True) is the default, so Keras warns on every fit of a tf.data dataset.
    r"`shuffle=True` was passed, but will be ignored since the data `x` was provided as a "
    r"tf\.data\.Dataset",
)


def install_defaults() -> None:
    """Hides only the warnings in ``WRONG_DEFAULTS`` (what ``import tfdist`` does).

    Example:
        >>> install_defaults()  # fit(dataset) no longer warns about shuffle=True
    """
    for pattern in WRONG_DEFAULTS:
        warnings.filterwarnings("ignore", message=f".*{pattern}")


class _HarmlessFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not is_harmless(record.getMessage())


def install() -> None:
    """Hides the harmless noise in this process: warnings, and the framework's loggers.

    Sets ``TF_CPP_MIN_LOG_LEVEL=2`` if unset (effective when TensorFlow is imported
    later). Idempotent.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for pattern, _ in HARMLESS:
        warnings.filterwarnings("ignore", message=f".*{pattern}")
    for name in ("tensorflow", "absl", "jax", "keras"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HarmlessFilter) for f in logger.filters):
            logger.addFilter(_HarmlessFilter())


@contextlib.contextmanager
def filtered_stderr():
    """Drops the harmless lines written to this process's stderr while active.

    Works on file descriptor 2, so it also catches what TensorFlow's C++ code prints
    before ``TF_CPP_MIN_LOG_LEVEL`` applies (absl's banner, the ``cuInit`` probe). For a
    command that imports TensorFlow and exits, such as ``tfdist info``.

    Example:
        >>> with filtered_stderr():  # doctest: +SKIP
        ...     import tensorflow
    """
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)
    pump = threading.Thread(target=_copy_useful, args=(read, saved), daemon=True)
    pump.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the pump sees EOF
        pump.join(timeout=5.0)
        os.close(saved)


def _copy_useful(read: int, out: int) -> None:
    with os.fdopen(read, "rb") as pipe:
        for line in pipe:
            if not is_harmless(line.decode("utf-8", errors="replace")):
                os.write(out, line)
