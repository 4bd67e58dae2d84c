"""The private jax names tfdist uses, one helper each (listed in ``tfdist.core.upstream``)."""

from __future__ import annotations

from typing import Any


def jax_distributed_client() -> Any:
    """jax's distributed client (``jax._src.distributed.global_state.client``): the
    helpers below use its store and barrier, which jax's public API does not expose. None
    before ``jax.distributed.initialize``; a method looked up on it then fails with
    AttributeError."""
    from jax._src import distributed

    return distributed.global_state.client


def jax_wait_at_barrier(name: str, timeout_ms: int) -> None:
    """The same through jax's distributed client (``sync_global_devices`` has no timeout)."""
    jax_distributed_client().wait_at_barrier(name, timeout_ms)


def jax_key_value_set(key: str, value: str) -> None:
    """Publishes ``key=value`` in jax's coordination service store (every process sees it).

    Raises jax's runtime error (``ALREADY_EXISTS`` in its message) when ``key`` is set.
    """
    jax_distributed_client().key_value_set(key, value)


def jax_key_value_get(key: str, timeout_ms: int) -> str:
    """Waits up to ``timeout_ms`` for ``key`` in jax's coordination service store.

    Raises jax's runtime error (``DEADLINE_EXCEEDED`` in its message) when it does not
    appear in time, another one when the service is gone.
    """
    return jax_distributed_client().blocking_key_value_get(key, timeout_ms)


def jax_key_value_put(key: str, value: str) -> None:
    """Sets ``key=value`` in jax's coordination store, replacing an earlier value."""
    jax_distributed_client().key_value_set(key, value, allow_overwrite=True)


def jax_key_value_try_get(key: str) -> str | None:
    """``key``'s value in jax's coordination store now, or None when it is not set.

    Raises jax's runtime error when the coordination service does not answer.
    """
    try:
        return jax_distributed_client().key_value_try_get(key)
    except Exception as err:  # noqa: BLE001 - jax's one error type; "NOT_FOUND" is no error
        if "NOT_FOUND" in str(err):
            return None
        raise


def orbax_tensorstore_utils() -> Any:
    """``orbax.checkpoint._src.serialization.tensorstore_utils``: Orbax 0.12 gives only
    ``gs://`` paths a bucket kvstore (``_use_gcs_driver``) and normalizes ``s3://`` into
    ``s3:/`` (``_normalize_path``); ``tfdist.checkpoint.remote_orbax`` extends both to
    ``s3://``, which has no public setting."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    return tensorstore_utils


def orbax_gcs_utils() -> Any:
    """``orbax.checkpoint._src.path.gcs_utils``: its ``get_kvstore_for_gcs`` builds the
    bucket kvstore spec, given tensorstore's ``s3`` driver for ``s3://`` paths."""
    from orbax.checkpoint._src.path import gcs_utils

    return gcs_utils


def epath_tf_check_cache_clear() -> None:
    """Forgets etils.epath's cached "is TensorFlow installed" answer
    (``etils.epath.gpath._is_tf_installed``), so that ``EPATH_USE_TF=false`` set after its
    first use takes effect (TensorFlow's gfile has no ``s3://``)."""
    from etils.epath import gpath

    gpath._is_tf_installed.cache_clear()
