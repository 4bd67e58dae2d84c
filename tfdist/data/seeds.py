"""Shuffle seeds: one per epoch from (seed, epoch), and one agreed by every worker.

A seeded pipeline's epoch k is shuffled by a seed drawn from ``(seed, k)`` alone. An
unseeded pipeline draws one seed from TensorFlow's global generator; under
multi-worker the chief's draw is shared, since with DATA sharding every worker must
shuffle alike or examples are seen twice or never.

Example:
    >>> seed = agreed_seed(tfdist.strategy(), num_workers=1)  # doctest: +SKIP
"""

from __future__ import annotations

import tensorflow as tf

from tfdist import backends
from tfdist.core import config
from tfdist.data.host import on_host

__all__ = ["SEED_RANGE", "epoch_seed", "agreed_seed"]

SEED_RANGE = 2**31 - 1


def epoch_seed(seed: tf.Tensor, epoch: tf.Tensor) -> tf.Tensor:
    """The shuffle seed of one epoch, inside a dataset function.

    Philox keyed by (seed, epoch): the same on every platform and in every process.
    """
    return tf.random.stateless_uniform(
        [], tf.stack([seed, epoch]), minval=0, maxval=SEED_RANGE, dtype=tf.int64
    )


def _local_seed() -> int:
    try:
        return on_host(
            lambda: int(tf.random.uniform([], 0, SEED_RANGE, dtype=tf.int64)), "drawing a seed"
        )
    except RuntimeError as err:  # op determinism is on and no global seed is set
        raise RuntimeError(
            "pipeline: shuffling needs a seed because op determinism is enabled. "
            "Pass seed=... to pipeline(), or call keras.utils.set_random_seed(...) first."
        ) from err


def agreed_seed(strategy, num_workers: int) -> int:
    """A shuffle seed for an unseeded pipeline, the same on every worker.

    Drawn from TensorFlow's global generator, so ``keras.utils.set_random_seed`` makes
    it reproducible. Under multi-worker the chief's draw is shared (the backend's
    ``chief_value``: an all-reduce on TensorFlow, jax's coordination store on JAX, where
    Keras gives each process its share of the same global batches), which every worker
    must reach: the wait is bounded (a worker may still be loading its data) by
    ``config.SEED_AGREEMENT_TIMEOUT_S``.

    Example:
        >>> agreed_seed(strategy, 2)  # every worker gets the chief's draw  # doctest: +SKIP
        1804289383
    """
    local = _local_seed()
    if num_workers == 1:
        return local
    timeout = config.SEED_AGREEMENT_TIMEOUT_S
    try:
        return int(backends.get().chief_value("shuffle seed", local, timeout, strategy))
    except TimeoutError as err:
        raise RuntimeError(
            f"pipeline: {err} Every worker must build the same pipelines in the same "
            "order; or pass seed=... so that no agreement is needed."
        ) from err.__cause__
