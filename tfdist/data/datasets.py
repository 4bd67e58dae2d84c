"""Ready-made data: MNIST through tensorflow_datasets (failing fast offline), and ``scale``.

Example:
    >>> train = pipeline(mnist("train"), 64, map_fn=scale)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import threading
import urllib.error
import urllib.request

import tensorflow as tf

from tfdist.core import config, validate

__all__ = ["TFDS_DATA_DIR_ENV", "scale", "mnist"]

logger = logging.getLogger(__name__)

TFDS_DATA_DIR_ENV = "TFDS_DATA_DIR"


def scale(image, label):
    """Scales images to float32 in [0, 1]; labels pass through. Works on batches too.

    Example:
        >>> train = pipeline(mnist(), 64, map_fn=scale)  # doctest: +SKIP
    """
    return tf.cast(image, tf.float32) / 255.0, label


# Elementwise, so a whole batch can go through one call: reading a dataset into memory
# then skips vectorising it (tf.vectorized_map's tracing), with the same result.
# (Through vars(): mypy does not model attributes set on a function.)
vars(scale)["batch_safe"] = True


def _reachable(url: str, timeout: float) -> str | None:
    """None when ``url`` answers within ``timeout`` s (through any configured proxy),
    else why not. Runs on a thread so a slow DNS lookup cannot outlast the timeout."""
    result: list[str | None] = []

    def probe():
        try:
            request = urllib.request.Request(url, method="HEAD")
            with urllib.request.urlopen(request, timeout=timeout):
                pass
            result.append(None)
        except urllib.error.HTTPError:  # the server answered: the network works
            result.append(None)
        except Exception as err:  # noqa: BLE001 - any failure means "not reachable"
            result.append(f"{type(err).__name__}: {err}")

    thread = threading.Thread(target=probe, name="tfdist-mnist-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else f"no answer within {timeout:.0f} s"


def _check_mnist_args(split, data_dir, timeout) -> float:
    what = "a tfds split name such as 'train' or 'test'"
    validate.instance(split, str, "split", "mnist", what)
    if not split.strip():
        raise ValueError(validate.message("mnist", "split", what, split))
    if data_dir is not None:
        validate.instance(data_dir, (str, os.PathLike), "data_dir", "mnist", "a path or None")
    return validate.number(
        timeout, "timeout", "mnist", low=0.0, low_ok=False, what="a positive number of seconds"
    )


def _data_dir(data_dir) -> str:
    # Resolved here, not by tfds: tfds reads TFDS_DATA_DIR once, when it is imported.
    if data_dir is None:
        data_dir = os.environ.get(TFDS_DATA_DIR_ENV) or os.path.join(
            os.path.expanduser("~"), "tensorflow_datasets"
        )
    return os.fspath(data_dir)


def _prepare(builder, data_dir: str, download: bool, timeout: float) -> None:
    """Downloads MNIST when missing, or fails at once saying how to provide it."""
    where = f"{data_dir} ({TFDS_DATA_DIR_ENV}={os.environ.get(TFDS_DATA_DIR_ENV)!r})"
    how = (
        f"Put the prepared tfds MNIST (mnist/{builder.version}/...) under a directory and "
        f"set {TFDS_DATA_DIR_ENV} to it (or pass data_dir=), or run once where the internet "
        f"is reachable to download it into {data_dir}."
    )
    if not download:
        raise FileNotFoundError(f"mnist: MNIST is not in {where} and download=False. {how}")
    url = getattr(builder, "URL", None) or "https://storage.googleapis.com/"
    problem = _reachable(url, timeout)
    if problem is not None:
        raise FileNotFoundError(
            f"mnist: MNIST is not in {where} and cannot be downloaded: {url} did not answer "
            f"({problem}). {how}"
        )
    logger.info("tfdist.data: downloading MNIST into %s", data_dir)
    builder.download_and_prepare()


def mnist(
    split: str = "train",
    *,
    data_dir: str | os.PathLike | None = None,
    download: bool = True,
    timeout: float = config.DOWNLOAD_PROBE_TIMEOUT_S,
) -> tf.data.Dataset:
    """MNIST through tensorflow_datasets as ``(image uint8 (28, 28, 1), label int64)``.

    Uses the data in ``data_dir`` (else ``$TFDS_DATA_DIR``, else tfds's default
    ``~/tensorflow_datasets``). When it is not there, downloads it if the download
    server answers within ``timeout`` seconds; otherwise fails at once instead of
    letting tfds retry for minutes.

    Args:
        split: a tfds split: ``"train"``, ``"test"``, or tfds slicing like ``"train[:10%]"``.
        data_dir: the tfds data directory; overrides ``TFDS_DATA_DIR``.
        download: whether to download when the data is missing.
        timeout: seconds to wait for the download server before giving up.

    Raises:
        FileNotFoundError: the data is not on disk and cannot be downloaded.
        TypeError, ValueError: an argument is invalid (``split`` not a split of MNIST).

    Example:
        >>> train = mnist("train")  # doctest: +SKIP
        >>> train.cardinality()     # doctest: +SKIP
        60000
    """
    timeout = _check_mnist_args(split, data_dir, timeout)
    data_dir = _data_dir(data_dir)
    import tensorflow_datasets as tfds  # imported late: it costs seconds

    builder = tfds.builder("mnist", data_dir=data_dir)
    if not builder.is_prepared():
        _prepare(builder, data_dir, download, timeout)
    known = set(builder.info.splits.keys())
    unknown = [part for part in split.split("+") if part.split("[")[0].strip() not in known]
    if unknown:
        raise ValueError(
            f"mnist: split must be one of {sorted(known)} (tfds slicing like 'train[:10%]' is "
            f"fine). Received: split={split!r}."
        )
    return builder.as_dataset(split=split, as_supervised=True, shuffle_files=False)
