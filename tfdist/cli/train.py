"""``tfdist train mnist``: the MNIST walkthrough job, restartable (``tfdist_examples.mnist``)."""

from __future__ import annotations

import argparse

from tfdist.cli.shared import quiet_tensorflow

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Trains the job ``args.job`` names; its exit code."""
    quiet_tensorflow()
    from tfdist.core import quiet
    from tfdist_examples import mnist  # TensorFlow-free until it trains

    with quiet.filtered_stderr():  # TensorFlow's C++ start-up lines, as under launch
        return mnist.main(args)


def add_parser(sub) -> None:
    """Adds ``train`` and its jobs to the ``tfdist`` subcommands ``sub``."""
    train = sub.add_parser(
        "train",
        help="run a walkthrough job (mnist) as a restartable job",
        description="Train a walkthrough job. Run the same command again after a kill or "
        "SIGTERM and it resumes from its checkpoints.",
    )
    jobs = train.add_subparsers(dest="job", metavar="JOB")
    jobs.required = True
    mnist = jobs.add_parser(
        "mnist",
        help="MNIST convnet: --recipe fast (>= 99%% test accuracy) or tutorial (the guides')",
        description="Train MNIST (from tensorflow_datasets; set TFDS_DATA_DIR to run offline). "
        "Writes OUTPUT/model.keras, metrics.json, history.csv, curves.png, checkpoints and "
        "TensorBoard logs, and ends with a line `test_accuracy=...`. Rerun the same command to "
        "resume, also on another number of devices or workers with the same global batch "
        "(--per-replica-batch); a checkpoint folder made with another recipe, global batch or "
        "split is refused (OUTPUT/ckpt/job.json records them and the total training time).",
    )
    _add_train_mnist_options(mnist)
    train.set_defaults(func=run)


def _add_train_mnist_options(mnist) -> None:
    mnist.add_argument(
        "--recipe",
        choices=("fast", "tutorial"),
        default="fast",
        help="fast: >= 99%% test accuracy in little time; tutorial: the guides' model and "
        "12 epochs (default: %(default)s)",
    )
    mnist.add_argument("--epochs", type=int, help="total epochs (default: the recipe's)")
    mnist.add_argument("--per-replica-batch", type=int, help="default: the recipe's")
    mnist.add_argument("--output", default=None, help="default: runs/mnist-RECIPE")
    mnist.add_argument(
        "--checkpoint-dir", help="a folder or a URL (s3://, gs://...); default: OUTPUT/ckpt"
    )
    mnist.add_argument(
        "--devices", type=int, help="devices per process: GPUs if any, else logical CPUs"
    )
    mnist.add_argument(
        "--workers",
        type=int,
        default=1,
        help="run N workers on this host via `tfdist launch`, in a private network "
        "namespace; MNIST is fetched first (default: %(default)s)",
    )
    mnist.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="with --workers: group restarts allowed (default: %(default)s)",
    )
    mnist.add_argument(
        "--seed", type=int, default=0, help="data order and initial weights (default: %(default)s)"
    )
    mnist.add_argument(
        "--save-freq",
        default="200",
        help="checkpoint every N steps as well as every epoch ('epoch': epochs only) "
        "(default: %(default)s)",
    )
    mnist.add_argument(
        "--verbose",
        default="auto",
        choices=("auto", "0", "1", "2"),
        help="Keras progress output on the chief: 0 none, 1 progress bar, 2 one line per "
        "epoch, auto as Keras (default: %(default)s)",
    )
    mnist.add_argument(
        "--backend",
        choices=("tensorflow", "jax"),
        default=None,
        help="Keras backend of the job: sets KERAS_BACKEND (default: $KERAS_BACKEND, "
        "else tensorflow)",
    )
    mnist.add_argument(
        "--train-split",
        default="train",
        help="tfds split to train on, e.g. 'train[:10%%]' for a quick run (default: train)",
    )
