"""Running TensorFlow work on this host's CPU, outside any strategy scope.

Example:
    >>> v = on_host(lambda: tf.Variable(0, trainable=False), "making a counter")  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import tensorflow as tf

from tfdist.core import config

__all__ = ["on_host"]


def on_host(fn: Callable, what: str):
    """Runs ``fn`` on a fresh thread, under ``tf.init_scope()`` on this host's CPU.

    Variables created this way are plain host variables: a strategy scope would turn
    ``tf.Variable`` into a distributed (mirrored, maybe GPU-resident) variable, which
    tf.data functions cannot read. Strategy scopes are thread-local, so a fresh thread
    escapes any scope the caller has open.

    Args:
        what: what ``fn`` does, for the error when it does not finish in time.

    Example:
        >>> seed = on_host(lambda: int(tf.random.uniform([], 0, 9, tf.int64)), "a seed")  # doctest: +SKIP
    """
    box: list = []

    def target():
        try:
            with tf.init_scope(), tf.device("/CPU:0"):
                box.append(fn())
        except BaseException as err:  # re-raised on the caller's thread
            box.append(err)

    thread = threading.Thread(target=target, name="tfdist-data-host", daemon=True)
    thread.start()
    thread.join(timeout=config.HOST_CALL_TIMEOUT_S)
    if not box:
        raise RuntimeError(
            f"tfdist.data: {what} did not finish within {config.HOST_CALL_TIMEOUT_S:.0f} s; "
            "TensorFlow may be stuck initialising its devices, or the host is out of memory."
        )
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]
