"""Where seeded pipelines start their next iteration: host variables their graphs read.

A seeded pipeline's dataset graph reads its position (epoch, global batches done) from
two host variables when an iteration starts, then moves it to the next epoch.
``set_position`` moves every live seeded pipeline of the process (and those built
later); ``position`` reads one.

Example:
    >>> set_position(3, batch=120)   # doctest: +SKIP
    >>> position(train)              # doctest: +SKIP
    Position(epoch=3, batch=120)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tensorflow as tf

from tfdist.core import process, validate
from tfdist.core.position import Position
from tfdist.data.checks import short
from tfdist.data.host import on_host

__all__ = ["PositionVariables", "PipelineState", "new_state", "set_position", "position"]

logger = logging.getLogger(__name__)

# The attribute of a returned pipeline that holds its PipelineState.
_STATE_ATTRIBUTE = "_tfdist_state"


class PositionVariables:
    """The position of one pipeline, in host variables its dataset graph reads.

    Example:
        >>> where = PositionVariables(Position(2, 5))  # doctest: +SKIP
        >>> where.get()                                # doctest: +SKIP
        Position(epoch=2, batch=5)
    """

    def __init__(self, start: Position):
        self.epoch, self.batch = on_host(
            lambda: (
                tf.Variable(start.epoch, dtype=tf.int64, trainable=False, name="epoch"),
                tf.Variable(start.batch, dtype=tf.int64, trainable=False, name="batch"),
            ),
            "creating the pipeline position",
        )

    def set(self, where: Position) -> None:
        self.epoch.assign(where.epoch)
        self.batch.assign(where.batch)

    def get(self) -> Position:
        return Position(int(self.epoch.numpy()), int(self.batch.numpy()))

    def start_iteration(self) -> tuple[tf.Tensor, tf.Tensor]:
        """Inside a dataset function: this iteration's (epoch, batch), after which the
        position moves on to (epoch + 1, 0)."""
        epoch = self.epoch.read_value()
        batch = self.batch.read_value()
        with tf.control_dependencies([epoch, batch]):
            advanced = tf.group(self.epoch.assign_add(1), self.batch.assign(0))
        with tf.control_dependencies([advanced]):
            return tf.identity(epoch), tf.identity(batch)


@dataclass
class PipelineState:
    """What a pipeline's dataset graph reads by handle; the dataset keeps it alive
    (``process.state().pipelines`` holds weak references only)."""

    position: PositionVariables | None
    seeded: bool
    data: object = None  # host variables holding the cached examples, if in memory

    def attach(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """Stores this state on ``dataset`` (the pipeline returned), for ``position()``."""
        setattr(dataset, _STATE_ATTRIBUTE, self)
        return dataset


def new_state(*, seeded: bool, positioned: bool) -> PipelineState:
    """A new pipeline's state; a positioned one gets position variables, and a seeded one
    starts at the process's position and follows ``set_position`` from now on."""
    state = PipelineState(position=None, seeded=seeded)
    if positioned:
        st = process.state()
        # Under the lock: a set_position() meanwhile either comes before (and the start
        # is already its position) or after (and finds this pipeline registered).
        with st.lock:
            state.position = PositionVariables(st.data_start if seeded else Position())
            if seeded:
                st.pipelines.add(state.position)
    return state


def set_position(epoch: int, batch: int = 0) -> None:
    """Sets where every seeded pipeline of this process starts its next iteration.

    The next iteration of each live seeded pipeline (the next ``iter()``, the next Keras
    epoch) draws its order from ``(seed, epoch)`` and skips ``batch`` GLOBAL batches;
    once it starts, the position moves to ``(epoch + 1, 0)``. Pipelines built later
    start from this position too. Unseeded pipelines (validation, say) ignore it.
    Checkpointing calls it in ``on_epoch_begin`` to resume exactly.

    Args:
        epoch: epoch number (>= 0) whose order the next iteration uses.
        batch: global batches (>= 0) of that epoch already trained on.

    Example:
        >>> set_position(3, batch=120)   # doctest: +SKIP
        >>> first = next(iter(train))    # batch 120 of epoch 3's order  # doctest: +SKIP
    """
    hint = "Pass the epoch to resume and the number of global batches already done."
    where = Position(
        validate.non_negative_int(epoch, "epoch", "set_position", hint),
        validate.non_negative_int(batch, "batch", "set_position", hint),
    )
    st = process.state()
    with st.lock:
        st.data_start = where
        holders = list(st.pipelines)
    for holder in holders:
        holder.set(where)
    logger.debug("tfdist.data: position of %d seeded pipeline(s) set to %s", len(holders), where)


def position(dataset: tf.data.Dataset) -> Position:
    """The position of a seeded pipeline: where its next iteration will start.

    Args:
        dataset: a dataset returned by ``pipeline(..., seed=...)``.

    Raises:
        TypeError: ``dataset`` is not a ``tf.data.Dataset``.
        ValueError: ``dataset`` is not a seeded pipeline.

    Example:
        >>> train = pipeline(ds, 32, seed=0)  # doctest: +SKIP
        >>> for _ in train: pass              # doctest: +SKIP
        >>> position(train)                   # doctest: +SKIP
        Position(epoch=1, batch=0)
    """
    what = "a pipeline built with a seed, as returned by tfdist.data.pipeline(..., seed=...)"
    hint = (
        "Transformed copies (dataset.map(...)) do not carry the position; ask the pipeline itself."
    )
    validate.instance(dataset, tf.data.Dataset, "dataset", "position", what, hint)
    state = getattr(dataset, _STATE_ATTRIBUTE, None)
    if state is None or not state.seeded:
        raise ValueError(validate.message("position", "dataset", what, short(dataset), hint))
    return state.position.get()
