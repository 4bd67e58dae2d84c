"""What several test jobs share, defined once: their models, the custom loops' command line
and fault injection, and a callback that stops a fit like a kill.

Jobs import it as ``import builders``: a job run as a file has this folder on sys.path, and
one run through ``runpy`` puts it there first.

Example:
    >>> model = builders.bench_model("mlp")  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import signal

import keras

import tfdist


def bench_model(kind: str, **compile_args):
    """The benchmark jobs' model: the MNIST job's convnet (``kind="convnet"``) or an MLP of
    two 256-wide layers on 784 inputs, compiled with SGD(0.01) (and ``compile_args``)."""
    keras.utils.set_random_seed(0)
    if kind == "convnet":
        from tfdist.examples.recipes import fast_model

        model = fast_model()  # the MNIST job's own convnet
    else:
        model = keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_args,
    )
    return model


def dense_classifier(optimizer):
    """8 inputs -> Dense(16, relu) ``dense_1`` -> 4 logits ``dense_2`` (seed 1), with
    accuracy: the JAX jobs' model, whose layer names their layout maps use."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="dense_1")(inputs)
    outputs = keras.layers.Dense(4, name="dense_2")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class StopAfter(keras.callbacks.Callback):
    """Ends the fit abruptly after global step ``step`` (no save: like a kill)."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)) == self.step:
            raise KeyboardInterrupt


# ------------------------------------------------------------------ the custom loops' jobs


def loop_arguments(*, dropout: bool) -> argparse.Namespace:
    """The custom-loop jobs' command line (``--dropout`` where the job has that variant)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--sigterm-at-step", type=int, default=None)
    parser.add_argument("--one-device-too", action="store_true")
    if dropout:
        parser.add_argument("--dropout", action="store_true")
    return parser.parse_args()


def attempt() -> int:
    """Which start of the job this is (``tfdist launch`` counts restarts)."""
    return int(os.environ.get("TFDIST_RESTART", "0"))


def inject_fault(args: argparse.Namespace, step: int) -> None:
    """kill -9 in the first attempt; SIGTERM to worker 1 only in the second."""
    if attempt() == 0 and step == args.kill_at_step:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-run, between two saves
    if attempt() == 1 and step == args.sigterm_at_step and tfdist.worker_index() == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice
