"""Loss patterns plain Keras gets right, and one it gets wrong, trained on this process's
topology: the no-harm matrix of the loss fixes (tests/compat/test_no_harm.py).

    TFDIST_CPU_DEVICES=4 python no_harm_job.py [CASE ...]      # logical devices
    tfdist launch -n 2 no_harm_job.py [CASE ...]                 # TensorFlow workers
    KERAS_BACKEND=jax tfdist launch -n 2 no_harm_job.py 'masked GRU' ...  # JAX processes

On JAX only the cases without a TensorFlow ``train_step`` run (``JAX_CASES``).

Cases (each a fresh model, seeded alike, trained with ``fit`` under ``tfdist.scope()``):

* ``loss in tf.cond``: a custom ``train_step`` in the shape of Keras's "customizing what
  happens in fit" guide, the loss object called inside a ``tf.cond`` on the replica's data;
* ``loss in a while loop``: the loss summed in a ``tf.while_loop``;
* ``loss in a nested tf.function``: the loss called through a ``tf.function`` of its own;
* ``masked GRU``: ``Embedding(mask_zero=True)`` -> ``GRU(return_sequences=True)`` -> a
  per-token ``SparseCategoricalCrossentropy``, 300 padded sequences at a global batch of
  64 (the last one 44): each replica's valid tokens differ, in full batches too;
* ``sample weights``: a regression with ``sample_weight``, 100 examples at 32;
* ``conv, batches of 6``: Conv2D + MaxPooling2D, 60 examples at a global batch of 6 (on 4
  replicas, in one process or over 2 workers: 2 + 2 + 1 + 1 each step, never an empty
  replica);
* ``conv, 65 at 6`` and ``conv + BN, 65 at 6`` (a synchronized BatchNormalization
  after the Conv2D): 65 examples, the last batch 5 (2 + 1 + 1 + 1 on 4 replicas);
* ``conv, 63 at 6``: the last batch 3, which leaves one of 4 replicas empty (refused
  before training there);
* ``conv, 74 at 16``: the last batch 10 (5 + 5; 3 + 3 + 2 + 2, dealt over 2 workers as
  slices 0 and 2 to worker 0): each replica reads its share from its slice's size;
* ``conv, 64 then 41 at 16``: a second ``fit`` of the same model on data cut otherwise
  (its last batch 9): the train function is made anew.

On TensorFlow every worker then prints ``SLICES {"worker": i, "memory": [...], "files":
[...]}``: the example ids each of its replicas gets, step by step, from 21 ids at a global
batch of 6, in memory and read from 2 TFRecord files (ids 0-10 and 11-20).

Every worker prints ``NOHARM {"worker": i, "cases": {name: {"values": {...},
"replicas": r, "workers": w, "step_collectives": [...]}}}``: the weights and (for compiled
losses) the loss history, the collectives of each traced train step on this worker (op
type -> count, TensorFlow; ``step_collectives``), and what the case's own model trained on (its ``distribute_strategy`` on
TensorFlow, the devices holding its weights on JAX; not the process's). A custom ``train_step`` reports its replica's
loss as upstream scales it (``1 / replicas``), so its history is not compared.
A failing case reports ``{"error": ...}`` and the others still run.

``TFDIST_TEST_FAULT`` (tests/scripts/faults.py: ``nan``, ``outside_distribution``) injects a
fault tests/e2e/test_checks_catch_faults.py must see caught.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import faults  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import trained_on  # noqa: E402

import tfdist  # noqa: E402

VOCAB, LENGTH = 12, 9


def _scope():
    """``tfdist.scope()``; nothing under the ``outside_distribution`` fault."""
    return contextlib.nullcontext() if faults.active("outside_distribution") else tfdist.scope()


class CustomStep(keras.Model):
    """The guide's custom ``train_step``, with the loss computed by ``compute``."""

    def __init__(self, compute, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)
        self.loss_fn = keras.losses.MeanSquaredError()
        self.tracker = keras.metrics.Mean(name="loss")
        self.compute = compute

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute(self.loss_fn, y, y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


def in_cond(loss_fn, y, y_pred):
    # A predicate on the replica's own data: replicas may take different branches.
    return tf.cond(
        tf.reduce_all(tf.math.is_finite(y_pred)),
        lambda: loss_fn(y, y_pred),
        lambda: tf.constant(0.0),
    )


def in_while(loss_fn, y, y_pred):
    def body(i, total):
        return i + 1, total + loss_fn(y, y_pred) / 2.0

    return tf.while_loop(lambda i, _: i < 2, body, [tf.constant(0), tf.constant(0.0)])[1]


@tf.function
def _nested(loss_fn, y, y_pred):
    return loss_fn(y, y_pred)


def in_nested_function(loss_fn, y, y_pred):
    return _nested(loss_fn, y, y_pred)


def regression(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def custom_step_case(compute) -> keras.Model:
    x, y = regression(96)  # 3 full batches of 32: upstream is right on every topology
    with _scope():
        model = CustomStep(compute)
        model.build((None, 6))
        model.compile(keras.optimizers.SGD(0.1))
    model.history_values = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return model


def masked_gru() -> keras.Model:
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, LENGTH + 1, size=300)
    x = np.zeros((300, LENGTH), "int32")
    for row, length in enumerate(lengths):
        x[row, :length] = rng.integers(1, VOCAB, size=length)
    y = np.roll(x, -1, axis=1)
    with _scope():
        model = keras.Sequential(
            [
                keras.Input((LENGTH,), dtype="int32"),
                keras.layers.Embedding(VOCAB, 8, mask_zero=True),
                keras.layers.GRU(8, return_sequences=True),
                keras.layers.Dense(VOCAB),
            ]
        )
        model.compile(
            keras.optimizers.Adam(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.history_values = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    return model


def sample_weights() -> keras.Model:
    x, y = regression(100, seed=2)  # last batch of 4
    weights = np.random.default_rng(3).uniform(0.1, 2.0, size=100).astype("float32")
    with _scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    model.history_values = model.fit(
        x, y, sample_weight=weights, batch_size=32, epochs=2, shuffle=False, verbose=0
    )
    return model


def conv_batches_of_6(
    examples: int = 60, batchnorm: bool = False, batch: int = 6, then: int = 0
) -> keras.Model:
    """Conv2D + MaxPooling2D on ``examples`` at a global batch of ``batch``; ``then``: a
    second ``fit`` of the same model on the first ``then`` examples."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(examples, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 3, size=examples)
    # BatchNormalization synchronized: its statistics are the global batch's, as on one
    # device (an unsynchronized one differs from one device on any split).
    if batchnorm:
        conv = [
            keras.layers.Conv2D(4, 3),
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.Activation("relu"),
        ]
    else:
        conv = [keras.layers.Conv2D(4, 3, activation="relu")]
    with _scope():
        model = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                *conv,
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            keras.optimizers.SGD(0.05),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.history_values = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    if then:
        model.history_values = model.fit(
            x[:then], y[:then], batch_size=batch, epochs=1, shuffle=False, verbose=0
        )
    return model


CASES = {
    "loss in tf.cond": lambda: custom_step_case(in_cond),
    "loss in a while loop": lambda: custom_step_case(in_while),
    "loss in a nested tf.function": lambda: custom_step_case(in_nested_function),
    "masked GRU": masked_gru,
    "sample weights": sample_weights,
    "conv, batches of 6": conv_batches_of_6,
    "conv, 65 at 6": lambda: conv_batches_of_6(65),
    "conv + BN, 65 at 6": lambda: conv_batches_of_6(65, batchnorm=True),
    "conv, 63 at 6": lambda: conv_batches_of_6(63),
    "conv, 74 at 16": lambda: conv_batches_of_6(74, batch=16),
    "conv, 64 then 41 at 16": lambda: conv_batches_of_6(64, batch=16, then=41),
}


# The cases any backend runs (the others are TensorFlow train_steps).
JAX_CASES = ("masked GRU", "sample weights", "conv, batches of 6")


def _collective(op: str) -> bool:
    """Whether a graph op of type ``op`` is a cross-replica collective (an all-reduce, a
    gather, ...), not the set-up of one."""
    setup = ("CollectiveAssignGroupV2", "CollectiveInitializeCommunicator")
    return (op.startswith("Collective") and op not in setup) or op.startswith("Nccl")


def _traced(function, seen: set) -> list:
    """The concrete functions of every ``tf.function`` that ``function`` holds, through
    the closures of Keras's and tfdist's wrappers."""
    if id(function) in seen:
        return []
    seen.add(id(function))
    found = []
    if hasattr(function, "_list_all_concrete_functions"):  # a tf.function
        found += function._list_all_concrete_functions()
        function = getattr(function, "_python_function", None)
    for cell in getattr(function, "__closure__", None) or ():
        try:
            held = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        if callable(held) and not isinstance(held, keras.Model):
            found += _traced(held, seen)
    return found


def step_collectives(model: keras.Model) -> list[dict[str, int]]:
    """The collectives in each traced train step of ``model`` (op type -> count), whatever
    issued them: the ops of each outermost concrete function of its train function and
    of every function in that graph's library (the replica function, the steps loop,
    nested ``tf.function``s and ``tf.cond`` branches)."""
    graphs = {c.name: c.graph.as_graph_def() for c in _traced(model.train_function, set())}
    inner = {f.signature.name for g in graphs.values() for f in g.library.function}
    steps = []
    for name, graph in graphs.items():
        if name.decode() in inner:  # counted within the step that calls it
            continue
        nodes = [*graph.node, *(node for f in graph.library.function for node in f.node_def)]
        found = Counter(node.op for node in nodes if _collective(node.op))
        steps.append(dict(sorted(found.items())))
    return steps


def result(model: keras.Model) -> dict:
    values = {f"weight {i}": w.ravel().tolist() for i, w in enumerate(model.get_weights())}
    if faults.active("nan"):
        values["weight 0"][0] = float("nan")
    if not isinstance(model, CustomStep):  # a custom step reports its replica's scaled loss
        values["loss"] = [float(v) for v in model.history_values.history["loss"]]
    # What the model itself trained on: its strategy on TensorFlow, the devices and
    # processes holding its weights on JAX.
    return {
        "values": values,
        "step_collectives": step_collectives(model)
        if keras.backend.backend() == "tensorflow"
        else None,
        **trained_on.model_topology(model),
    }


def slices() -> dict:
    """Which examples each of this worker's replicas gets, step by step, when the
    strategy distributes 21 ids at a global batch of 6 (the last batch 3): from memory,
    and read from 2 TFRecord files (ids 0-10 and 11-20)."""
    strategy = tfdist.strategy()
    folder = Path(tempfile.mkdtemp())
    files = [str(folder / f"part-{i}.tfrecord") for i in range(2)]
    for path, ids in zip(files, (range(0, 11), range(11, 21)), strict=True):
        with tf.io.TFRecordWriter(path) as writer:
            for i in ids:
                writer.write(tf.io.serialize_tensor(tf.constant(i, tf.int64)).numpy())
    records = tf.data.TFRecordDataset(files).map(
        lambda r: tf.ensure_shape(tf.io.parse_tensor(r, tf.int64), [])
    )
    out = {}
    for name, dataset in (("memory", tf.data.Dataset.range(21)), ("files", records)):
        distributed = strategy.experimental_distribute_dataset(dataset.batch(6))
        local = strategy.experimental_local_results
        out[name] = [[part.numpy().tolist() for part in local(batch)] for batch in distributed]
    shutil.rmtree(folder)
    return out


def main() -> None:
    names = sys.argv[1:] or list(CASES if keras.backend.backend() == "tensorflow" else JAX_CASES)
    out = {}
    for name in names:
        keras.utils.set_random_seed(0)
        try:
            out[name] = result(CASES[name]())
        except Exception as error:  # a failing case is a result, not a crash of the others
            traceback.print_exc()
            out[name] = {"error": f"{type(error).__name__}: {str(error)[:1500]}"}
    worker = tfdist.cluster_from_env().rank
    print("NOHARM " + json.dumps({"worker": worker, "cases": out}), flush=True)
    if keras.backend.backend() == "tensorflow":
        print("SLICES " + json.dumps({"worker": worker, **slices()}), flush=True)


if __name__ == "__main__":
    main()
