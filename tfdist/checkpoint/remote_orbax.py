"""Orbax on ``s3://`` and ``gs://`` URLs: what the installed Orbax needs to write there.

Sharded checkpoints (``tfdist.checkpoint.sharded``) in a bucket go through Orbax's own
remote path, with three settings made here:

* Orbax's paths are ``etils.epath`` paths, which use TensorFlow's ``tf.io.gfile`` for
  URLs whenever TensorFlow is installed; TensorFlow has no ``s3://`` filesystem (moved to
  tensorflow-io), so epath is told to use fsspec (s3fs, gcsfs), as tfdist's archives do
  (``EPATH_USE_TF=false``, unless the environment sets it).
* Orbax 0.12 builds tensorstore's native kvstore only for ``gs://`` (its ``gcs`` driver);
  an ``s3://`` path was refused ("Checkpoint path should be absolute"). ``s3://`` paths
  are given tensorstore's ``s3`` driver here, with ``AWS_ENDPOINT_URL`` and the region
  from the environment where set (tensorstore does not read the endpoint from it).
  Local and ``gs://`` paths are built exactly as Orbax builds them.
* A rename on an object store is a copy of every object, not atomic, so a bucket
  checkpoint is committed by a marker instead: ``ATOMICITY`` (Orbax's ``COMMIT_FILE``
  mode) writes in place and writes ``commit_success.txt`` last, once every process has
  written its shards; a directory without it is an unfinished write.

Example:
    >>> prepare("/tmp/ckpt")  # a local path: nothing to do
    False
"""

from __future__ import annotations

import os

from tfdist.core import storage, upstream

__all__ = ["COMMIT_MARKER", "prepare", "atomicity_options"]

# Orbax's commit marker (orbax.checkpoint._src.path.atomicity_types.COMMIT_SUCCESS_FILE).
COMMIT_MARKER = "commit_success.txt"
_installed = {"s3": False}


def prepare(path: str) -> bool:
    """Makes Orbax able to write and read ``path``; True when it is a URL.

    Example:
        >>> prepare("s3://bucket/run/ckpt-1.orbax")  # doctest: +SKIP
        True
    """
    if not storage.is_url(path):
        return False
    if "EPATH_USE_TF" not in os.environ:
        os.environ["EPATH_USE_TF"] = "false"
        upstream.epath_tf_check_cache_clear()  # read once and cached by epath
    if path.lower().startswith("s3://") and not _installed["s3"]:
        _install_s3_kvstore()
        _installed["s3"] = True
    return True


def atomicity_options():
    """Orbax's commit-marker mode (``commit_success.txt`` written last), for URLs."""
    import orbax.checkpoint as ocp

    return ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)


def _s3_kvstore(path: str) -> dict:
    """tensorstore's ``s3`` kvstore spec for ``s3://bucket/key``."""
    bucket, _, key = path[len("s3://") :].partition("/")
    spec = {"driver": "s3", "bucket": bucket, "path": key}
    if os.environ.get("AWS_ENDPOINT_URL"):
        spec["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    return spec


def _install_s3_kvstore() -> None:
    """Routes Orbax's ``s3://`` paths to tensorstore's ``s3`` driver, through the branch
    Orbax takes for ``gs://`` (a bucket kvstore; other paths are left to Orbax)."""
    gcs_utils, ts_utils = upstream.orbax_gcs_utils(), upstream.orbax_tensorstore_utils()
    normalize, remote, kvstore = (
        ts_utils._normalize_path,
        ts_utils._use_gcs_driver,
        gcs_utils.get_kvstore_for_gcs,
    )

    def normalize_path(path: str) -> str:
        if path.startswith("s3://"):  # normpath would make it s3:/...
            return "s3://" + normalize(path[len("s3://") :]).lstrip("/")
        return normalize(path)

    def use_bucket_driver(directory: str) -> bool:
        return directory.startswith("s3://") or remote(directory)

    def bucket_kvstore(path: str) -> dict:
        return _s3_kvstore(path) if path.startswith("s3://") else kvstore(path)

    ts_utils._normalize_path = normalize_path
    ts_utils._use_gcs_driver = use_bucket_driver
    gcs_utils.get_kvstore_for_gcs = bucket_kvstore
