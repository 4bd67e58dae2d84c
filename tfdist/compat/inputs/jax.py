"""Numpy arrays, ``PyDataset`` and generators into ``fit``/``evaluate``/``predict`` of a
multi-process Keras job on JAX, and ``predict``'s whole result on every process.

Under a ``keras.distribution`` over several processes (``tfdist launch -n 2`` on JAX),
Keras accepts only a ``tf.data.Dataset`` ("the data must be provided as a
`tf.data.Dataset` instance"): the most common calls in Keras code (``fit(x, y,
batch_size=...)``, ``validation_data=(x, y)``, a ``PyDataset``, a generator) fail. Every
process holds the same inputs (the same script ran everywhere), so each process can
iterate the global batches one device would iterate, in the same order, and feed its
share of each: the fix ``keras_jax_multi_process_inputs`` does that, with the same share
Keras's own sharding gives a ``tf.data.Dataset`` (``Distribution.data_shard_id`` of
``min(processes, replicas)`` equal parts). A shuffled epoch draws its order from
process 0's random state (NumPy's for arrays, Python's for a ``PyDataset``), so every
process agrees on it. A generator or ``PyDataset`` runs on every process and must yield
the same batches everywhere (seed any randomness in it alike); each process keeps its
share. Every batch must divide evenly between the data-parallel replicas; one that does
not (a partial last batch of the wrong size) fails in training with an error naming the
counts. In ``evaluate`` and ``predict`` every process feeds such a batch whole (a
``WholeBatch``), and ``partial_batches.jax`` places it on every device.

``predict`` under several processes fails for every input, ``tf.data`` included
("Fetching value for `jax.Array` that spans non-addressable ... devices"): its batches'
outputs live on every process's devices. The fix ``keras_jax_multi_process_predict``
gathers each batch's outputs on every process, so ``predict`` returns every prediction,
in order, on every process, as on one device.

Example:
    >>> from tfdist.compat.inputs import jax as jax_inputs
    >>> [fix.name for fix in jax_inputs.FIXES]
    ['keras_jax_multi_process_inputs', 'keras_jax_multi_process_predict']
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import json
import logging
import random
from dataclasses import dataclass
from typing import cast

from tfdist.core import config, roles, upstream
from tfdist.core.fix_registry import Fix, on_keras_backend, patch, targets

__all__ = [
    "KERAS_JAX_MULTI_PROCESS_PREDICT",
    "KERAS_JAX_MULTI_PROCESS_INPUTS",
    "FIXES",
    "ProcessShare",
    "keras_jax_multi_process_inputs",
    "keras_jax_multi_process_predict",
    "agree_random_state",
]

KERAS_JAX_MULTI_PROCESS_INPUTS = "keras_jax_multi_process_inputs"
KERAS_JAX_MULTI_PROCESS_PREDICT = "keras_jax_multi_process_predict"
_GATHERS = "__tfdist_gathers__"  # set on a predict function that gathers its outputs

# True while evaluate, predict or their *_on_batch run, where
# partial_batches.jax.keras_jax_evaluate_predict_uneven_batches is applied (it sets it):
# a batch that cannot be split evenly is then fed whole, never refused.
INFERENCE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tfdist_jax_inference", default=False
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Share:
    """Which part of every global batch this process feeds.

    Attributes:
        index: this process's part (Keras's ``data_shard_id``).
        parts: equal parts a global batch is cut into (one per process, or per model
            replica when a replica spans processes).
        replicas: data-parallel replicas; every batch must divide evenly between them.
    """

    index: int
    parts: int
    replicas: int


def _share_of(distribution) -> _Share | None:
    """This process's share under ``distribution``, or None where upstream feeds inputs
    as given (one process, no distribution, or ``auto_shard_dataset=False``)."""
    if distribution is None or distribution.num_processes <= 1:
        return None
    if not distribution.auto_shard_dataset:
        return None
    replicas = int(distribution.num_model_replicas)
    # As Distribution.distribute_tf_dataset shards a tf.data.Dataset: one part per
    # process, or per model replica when a replica spans processes (then its processes
    # feed the same part).
    parts = min(int(distribution.num_processes), replicas)
    return _Share(index=int(distribution.data_shard_id), parts=parts, replicas=replicas)


def _check_batch(size: int, share: _Share, what: str, received: str, hint: str) -> None:
    if size % share.replicas == 0 and size % share.parts == 0:
        return
    raise ValueError(
        f"tfdist: {what} has {size} examples, which cannot be split evenly between "
        f"{share.replicas} data-parallel replicas ({share.parts} processes feed one part "
        "each): Keras on JAX gives every replica the same number of examples of every "
        f"batch. Received: {received}. {hint}"
    )


@functools.cache
def whole_batch_class() -> type:
    """``WholeBatch``: a NumPy array every process feeds whole (not its part) because the
    replicas cannot split it evenly; only in ``evaluate`` and ``predict``."""
    import numpy as np

    class WholeBatch(np.ndarray):
        """A batch every process feeds whole, to be placed on every device."""

    return WholeBatch


def _whole_batch(batch):
    import keras
    import numpy as np

    def mark(leaf):
        return None if leaf is None else np.asarray(leaf).view(whole_batch_class())

    return keras.tree.map_structure(mark, batch)


def _check_array_batches(adapter, share: _Share) -> None:
    """Arrays: every batch size is known before the first step; refuse an uneven one now,
    on every process alike, instead of failing (or hanging) in the middle of an epoch.
    In evaluate and predict (``INFERENCE``) such a batch is fed whole instead."""
    batch = adapter.batch_size  # None for a PyDataset or a generator: checked per batch
    if not batch or INFERENCE.get():
        return
    partial = adapter.partial_batch_size or 0
    samples = (adapter.num_batches - (1 if partial else 0)) * batch + partial
    received = f"batch_size={batch} for {samples} examples"
    if samples >= batch:  # at least one full batch
        _check_batch(
            batch,
            share,
            f"every batch (batch_size={batch})",
            received,
            f"Pass a batch_size that is a multiple of {share.replicas}.",
        )
    if partial:
        _check_batch(
            partial,
            share,
            f"the last batch ({samples} examples in batches of {batch})",
            received,
            f"Pass a batch_size for which the last batch is a multiple of {share.replicas} "
            f"examples, or leave out the last {partial} (x[:{samples - partial}]); "
            "nothing is dropped or repeated silently.",
        )


def _cut(batch, share: _Share):
    """This process's part of one global batch (every array sliced along axis 0)."""
    import jax
    import keras
    import numpy as np

    leaves = [leaf for leaf in keras.tree.flatten(batch) if leaf is not None]
    for leaf in leaves:
        if not isinstance(leaf, (np.ndarray, jax.Array)):
            raise TypeError(
                "tfdist: in a multi-process job each process feeds its part of every "
                f"batch, and a batch of {type(leaf).__name__} cannot be sliced. Received: "
                f"a batch element of type {type(leaf)}. Yield numpy arrays, or pass a "
                "tf.data.Dataset."
            )
    if not leaves:
        return batch
    size = int(leaves[0].shape[0])
    if INFERENCE.get() and (size % share.replicas or size % share.parts):
        return _whole_batch(batch)  # evaluate, predict: every process feeds it whole
    _check_batch(
        size,
        share,
        "a batch",
        f"a batch whose first array has shape {tuple(leaves[0].shape)}",
        f"Make every batch the generator or PyDataset yields a multiple of {share.replicas} "
        "examples, its last one included.",
    )
    part = size // share.parts
    start = share.index * part

    def cut(leaf):
        return None if leaf is None else leaf[start : start + part]

    return keras.tree.map_structure(cut, batch)


# ---------------------------------------------------------------- random state agreement

# The n-th agreement of every process reads the n-th state process 0 published.
_AGREEMENTS = itertools.count()


def _random_state() -> list:
    import numpy as np

    # legacy=True: the tuple (numpy's stub also allows the dict of legacy=False).
    legacy = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state(legacy=True))
    name, keys, pos, has_gauss, gauss = legacy
    version, internal, gauss_next = random.getstate()
    return [[name, keys.tolist(), pos, has_gauss, gauss], [version, list(internal), gauss_next]]


def _set_random_state(state: list) -> None:
    import numpy as np

    (name, keys, pos, has_gauss, gauss), (version, internal, gauss_next) = state
    np.random.set_state((name, np.array(keys, np.uint32), pos, has_gauss, gauss))
    random.setstate((version, tuple(internal), gauss_next))


def agree_random_state(timeout: float = config.SEED_AGREEMENT_TIMEOUT_S) -> None:
    """Sets NumPy's and Python's global random state to process 0's, on every process.

    Keras draws a shuffled epoch's order from them (``np.random.permutation`` for
    arrays, ``random.shuffle`` for a ``PyDataset``). ``keras.utils.set_random_seed``
    with one seed everywhere, or the seed tfdist agrees at start-up, makes them equal
    already; a script that seeds each process differently would otherwise feed some
    examples twice and others never. Every process must call it at the same point: the
    n-th call of each reads the n-th state process 0 published (jax's coordination
    store), waiting up to ``timeout`` seconds.

    Example:
        >>> agree_random_state()  # in a multi-process job  # doctest: +SKIP
    """
    role = roles.jax_process()
    key = f"tfdist/jax_inputs/random_state/{next(_AGREEMENTS)}"
    if role.is_chief:
        upstream.jax_key_value_set(key, json.dumps(_random_state()))
        return
    try:
        text = upstream.jax_key_value_get(key, int(timeout * 1000))
    except Exception as err:  # jax raises its runtime's own error types
        first = str(err).strip().splitlines()
        raise TimeoutError(
            f"tfdist: process {role.rank} did not receive process 0's random "
            f"state for a shuffled epoch within {timeout:.0f} s "
            f"({first[0] if first else type(err).__name__}). Every process must call "
            "fit/evaluate/predict with the same inputs in the same order."
        ) from None
    _set_random_state(json.loads(text))


# ---------------------------------------------------------------- the adapter


class ProcessShare:
    """Keras's adapter of an input, feeding this process's part of every global batch.

    ``adapter`` (Keras's own, for arrays, a ``PyDataset`` or a generator) yields the
    global batches one device would see; each is cut into ``share.parts`` equal parts
    along the batch axis and this process keeps part ``share.index``: the rows Keras's
    ``distribute_tf_dataset`` gives it of a ``tf.data.Dataset``'s batch. Keras then
    assembles the global batch from every process's part. Counts (``num_batches``,
    ``batch_size``) stay the global ones. A generator or ``PyDataset`` runs on every
    process and must yield the same batches on each.

    Example:
        >>> ProcessShare(adapter, _Share(0, 2, 4), shuffle=False).num_batches  # doctest: +SKIP
        5
    """

    def __init__(self, adapter, share: _Share, *, shuffle):
        self._adapter = adapter
        self._share = share
        # Arrays and a PyDataset shuffle (upstream ignores shuffle for a generator).
        array_or_py_dataset = upstream.keras_shareable_adapter_classes()[:2]
        shuffles = bool(shuffle) and isinstance(adapter, array_or_py_dataset)
        # A PyDataset with workers shuffles in the enqueuer thread that on_epoch_begin
        # starts; everything else draws its order when its iterator starts.
        enqueued = getattr(adapter, "enqueuer", None) is not None
        self._agree_at_epoch_begin = shuffles and enqueued
        self._agree_at_iterator = shuffles and not enqueued

    def _parts(self, make_iterator):
        if self._agree_at_iterator:
            agree_random_state()
        for batch in make_iterator():
            yield _cut(batch, self._share)

    def get_jax_iterator(self):
        return self._parts(self._adapter.get_jax_iterator)

    def get_numpy_iterator(self):
        return self._parts(self._adapter.get_numpy_iterator)

    def get_tf_dataset(self):
        raise NotImplementedError("tfdist: ProcessShare feeds the JAX backend only.")

    def get_torch_dataloader(self):
        raise NotImplementedError("tfdist: ProcessShare feeds the JAX backend only.")

    def on_epoch_begin(self):
        if self._agree_at_epoch_begin:
            agree_random_state()
        self._adapter.on_epoch_begin()

    def on_epoch_end(self):
        self._adapter.on_epoch_end()

    @property
    def num_batches(self):
        return self._adapter.num_batches

    @property
    def batch_size(self):
        return self._adapter.batch_size

    @property
    def has_partial_batch(self):
        return self._adapter.has_partial_batch

    @property
    def partial_batch_size(self):
        return self._adapter.partial_batch_size


@contextlib.contextmanager
def _no_distribution():
    """No distribution set in this thread inside the block (Keras's is thread-local)."""
    from keras import distribution as kd

    previous = kd.distribution()
    kd.set_distribution(None)
    try:
        yield
    finally:
        kd.set_distribution(previous)


def _process_share_adapter(original, x, kwargs, share: _Share):
    """Keras's own adapter of ``x`` (built as for one process), cut to this process's
    share; for inputs other than arrays, PyDataset and generators, upstream's refusal."""
    with _no_distribution():
        adapter = original(x, **kwargs)
    if not isinstance(adapter, upstream.keras_shareable_adapter_classes()):
        return original(x, **kwargs)  # torch, grain: upstream's answer, unchanged
    _check_array_batches(adapter, share)
    return ProcessShare(adapter, share, shuffle=kwargs.get("shuffle"))


def keras_jax_multi_process_inputs() -> None:
    """Feeds numpy arrays, ``PyDataset`` and generators to a multi-process JAX job.

    Upstream's ``get_data_adapter`` refuses every input but a ``tf.data.Dataset`` when a
    ``keras.distribution`` spans several processes (with ``auto_shard_dataset``), so
    ``fit(x, y, batch_size=...)``, numpy ``validation_data``/``validation_split``,
    ``evaluate``, ``predict``, a ``PyDataset`` or a generator fail under ``tfdist launch
    -n 2``. The fix builds Keras's own adapter as on one process (same validation,
    ``sample_weight``/``class_weight`` handling, batches and order) and wraps it in
    ``ProcessShare``: each process feeds its equal part of every global batch (the rows
    Keras's own ``distribute_tf_dataset`` would give it), and a shuffled epoch's order
    is process 0's (``agree_random_state``). Keras assembles the global batch from the
    parts, so every step sees exactly one device's batch: the same examples, each once,
    and the same epoch length. Batches that do not divide evenly between the replicas
    fail with an error naming the counts. One process, no distribution,
    ``auto_shard_dataset=False``, ``tf.data`` and custom adapters: upstream unchanged.
    """
    from keras import distribution as kd

    module = upstream.keras_data_adapters_module()
    adapter_base = upstream.keras_data_adapter_class()

    def make(original):
        def get_data_adapter(
            x,
            y=None,
            sample_weight=None,
            batch_size=None,
            steps_per_epoch=None,
            shuffle=False,
            class_weight=None,
        ):
            kwargs = {
                "y": y,
                "sample_weight": sample_weight,
                "batch_size": batch_size,
                "steps_per_epoch": steps_per_epoch,
                "shuffle": shuffle,
                "class_weight": class_weight,
            }
            share = _share_of(kd.distribution())
            if share is None or isinstance(x, adapter_base) or module.is_tf_dataset(x):
                return original(x, **kwargs)
            return _process_share_adapter(original, x, kwargs, share)

        return get_data_adapter

    patch(module, "get_data_adapter", KERAS_JAX_MULTI_PROCESS_INPUTS, make)


# ---------------------------------------------------------------- predict


def _whole(value):
    """A batch output spread over several processes' devices, gathered (numpy) here."""
    import jax

    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(value, tiled=True)
    return value


def _gathering(predict_function):
    import keras

    def gathered(state, iterator):
        outputs, state = predict_function(state, iterator)
        return keras.tree.map_structure(_whole, outputs), state

    setattr(gathered, _GATHERS, True)
    return gathered


def keras_jax_multi_process_predict() -> None:
    """Returns every prediction, in order, on every process of a multi-process JAX job.

    Under a ``keras.distribution`` spanning several processes each batch's outputs are
    one global ``jax.Array`` whose rows live on every process's devices; upstream's
    ``predict`` concatenates them with NumPy, which cannot read rows held by another
    process ("Fetching value for `jax.Array` that spans non-addressable ... devices"),
    so ``predict`` fails for every input, ``tf.data`` included. The fix wraps the
    predict function Keras makes so that each batch's outputs are gathered on every
    process (``process_allgather``: the global array, rows in batch order) before
    Keras concatenates them: the result is one device's, on every process.
    Single-process runs keep upstream's predict function unchanged.
    """
    from keras import distribution as kd

    def make(original):
        def make_predict_function(self, force=False):
            made = original(self, force=force)
            function = self.predict_function
            dist = kd.distribution()
            spans = dist is not None and dist.num_processes > 1
            if spans and function is not None and not getattr(function, _GATHERS, False):
                self.predict_function = _gathering(function)
            return None if made is None else self.predict_function

        return make_predict_function

    patch(
        upstream.keras_jax_trainer_class(),
        "make_predict_function",
        KERAS_JAX_MULTI_PROCESS_PREDICT,
        make,
    )


_DA = "keras.src.trainers.data_adapters"
_KJ = "keras.src.backend.jax.trainer:"

FIXES: list[Fix] = [
    Fix(
        KERAS_JAX_MULTI_PROCESS_INPUTS,
        "Keras 3 on JAX with several processes refuses numpy arrays, PyDataset and "
        "generators in fit/evaluate/predict: 'the data must be provided as a "
        "`tf.data.Dataset` instance'",
        on_keras_backend("jax"),
        keras_jax_multi_process_inputs,
        targets=targets(
            _DA + ":get_data_adapter",
            _DA + ":is_tf_dataset",
            _DA + ".data_adapter:DataAdapter",
            _DA + ".array_data_adapter:ArrayDataAdapter._get_iterator",
            _DA + ".array_data_adapter:ArrayDataAdapter.partial_batch_size",
            _DA + ".py_dataset_adapter:PyDatasetAdapter._finite_generator",
            _DA + ".py_dataset_adapter:PyDatasetAdapter.on_epoch_begin",
            _DA + ".py_dataset_adapter:PyDatasetAdapter.enqueuer (instance)",
            _DA + ".generator_data_adapter:GeneratorDataAdapter.get_jax_iterator",
            "keras.src.trainers.epoch_iterator:EpochIterator._enumerate_iterator",
            _KJ + "JAXEpochIterator._get_distributed_iterator",
            "keras.src.backend.jax.distribution_lib:distribute_data_input",
            "keras.src.distribution.distribution_lib:Distribution.data_shard_id",
            "keras.src.distribution.distribution_lib:Distribution.distribute_tf_dataset",
        ),
        acts_where=(
            "fit/evaluate/predict of numpy arrays, a PyDataset or a generator under a "
            "keras.distribution over >1 process; tf.data, one process: upstream's path"
        ),
        no_harm=(),  # none yet
    ),
    Fix(
        KERAS_JAX_MULTI_PROCESS_PREDICT,
        "Keras 3 on JAX with several processes: predict fails for every input "
        "('Fetching value for `jax.Array` that spans non-addressable ... devices')",
        on_keras_backend("jax"),
        keras_jax_multi_process_predict,
        targets=targets(
            _KJ + "JAXTrainer.make_predict_function",
            _KJ + "JAXTrainer.predict",
        ),
        acts_where=(
            "predict under a keras.distribution over >1 process; one process: upstream's "
            "predict function"
        ),
        no_harm=(),  # none yet
    ),
]
