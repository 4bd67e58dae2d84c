"""What several test jobs share, defined once: their models, the custom loops' command line
and fault injection, and a callback that stops a fit like a kill.

Jobs import it as ``import builders``: a job run as a file has this folder on sys.path, and
one run through ``runpy`` puts it there first.

Example:
    >>> model = builders.bench_model("mlp")  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal

import keras

import tfdist


def bench_model(kind: str, **compile_args):
    """The benchmark jobs' model: the MNIST job's convnet (``kind="convnet"``) or an MLP of
    two 256-wide layers on 784 inputs, compiled with SGD(0.01) (and ``compile_args``)."""
    keras.utils.set_random_seed(0)
    if kind == "convnet":
        from tfdist_examples.recipes import fast_model

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


def loop_arguments(*, dropout: bool, sharded: bool = False) -> argparse.Namespace:
    """The custom-loop jobs' command line (``--dropout``, and ``--sharded`` with its
    faults ``--kill-in-write``/``--plant-damaged``, where the job has those variants)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--sigterm-at-step", type=int, default=None)
    parser.add_argument("--one-device-too", action="store_true")
    if dropout:
        parser.add_argument("--dropout", action="store_true")
    if sharded:
        parser.add_argument("--sharded", action="store_true")
        parser.add_argument("--kill-in-write", type=int, default=None)
        parser.add_argument("--plant-damaged", default=None)
    return parser.parse_args()


def attempt() -> int:
    """Which start of the job this is (``tfdist launch`` counts restarts)."""
    return int(os.environ.get("TFDIST_RESTART", "0"))


def kill_in_write(args: argparse.Namespace, step: int, path: str) -> None:
    """kill -9 in the first attempt right after step ``--kill-in-write``'s save call
    returned, its sharded write to ``path`` under way in the background; says first
    whether that write had landed (it must not have: the kill is mid-write).

    With ``--plant-damaged NAME``, worker 0 first copies the newest finished checkpoint
    to ``NAME`` with its array data files cut in half: a damaged newest checkpoint that
    the relaunch must skip."""
    if attempt() != 0 or step != args.kill_in_write:
        return
    if args.plant_damaged and tfdist.worker_index() == 0:
        from tfdist.checkpoint.sharded import sharded_entries

        directory = os.path.dirname(path)
        _position, newest = sharded_entries(directory)[-1]
        cut_data_files_in_half(shutil.copytree(newest, os.path.join(directory, args.plant_damaged)))
    landed = os.path.exists(path)
    print(json.dumps({"dying_in_write": os.path.basename(path), "landed": landed}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def cut_data_files_in_half(checkpoint: str) -> None:
    """Damages a sharded checkpoint: every array data file to half its size."""
    for folder, _, files in os.walk(os.path.join(checkpoint, "state")):
        if os.path.basename(folder) == "d":
            for name in files:
                path = os.path.join(folder, name)
                os.truncate(path, os.path.getsize(path) // 2)


def inject_fault(args: argparse.Namespace, step: int) -> None:
    """kill -9 in the first attempt; SIGTERM to worker 1 only in the second."""
    if attempt() == 0 and step == args.kill_at_step:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-run, between two saves
    if attempt() == 1 and step == args.sigterm_at_step and tfdist.worker_index() == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice
