"""Input pipelines done right for distributed training: global batch, cache, shuffle, shard.

``pipeline()`` turns a finite ``tf.data.Dataset`` (or in-memory arrays) into what a
strategy wants: mapped, cached, reshuffled every epoch, batched with the GLOBAL batch,
prefetched, with the auto-shard policy set so each worker sees its share once. A seeded
pipeline draws the order of epoch k from (seed, k) alone and has a *position*
(``tfdist.core.position.Position(epoch, batch)``: global batches already done in that
epoch) that ``set_position()`` moves, so a restarted job resumes on exactly the batch
it stopped at. ``mnist()`` loads MNIST through tensorflow_datasets and fails fast,
naming ``TFDS_DATA_DIR``, when the data is neither on disk nor downloadable.

The modules, each one idea, imported one way (lowest first): ``host`` (TensorFlow work
on this host's CPU, outside any strategy scope), ``checks`` (arguments), ``positions``
(``set_position``/``position``), ``sharding`` (auto-shard policy), ``seeds``,
``memory`` (a source read into memory), ``epochs`` (one epoch per iteration from a
position), ``pipeline``; ``datasets`` (``mnist``, ``scale``) stands alone.

Example:
    >>> import tfdist
    >>> train = tfdist.data.pipeline(tfdist.data.mnist("train"), 64,     # doctest: +SKIP
    ...                              map_fn=tfdist.data.scale, seed=1)
    >>> model.fit(train, epochs=3)                                        # doctest: +SKIP
"""

from __future__ import annotations

from tfdist.core.position import Position
from tfdist.data.checks import MAP_ON
from tfdist.data.datasets import mnist, scale
from tfdist.data.pipeline import pipeline
from tfdist.data.positions import position, set_position

__all__ = [
    "MAP_ON",
    "Position",
    "pipeline",
    "set_position",
    "position",
    "scale",
    "mnist",
]
