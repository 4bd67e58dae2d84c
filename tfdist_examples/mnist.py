"""The MNIST walkthrough as a restartable job: what ``tfdist train mnist`` runs.

One process (or each worker of ``--workers N``) builds the strategy, the input
pipelines and the recipe's model, restores the newest checkpoint, trains, evaluates on
the test set and, on the chief, writes the final model, ``metrics.json``, the
per-epoch history (``history.csv``) and a plot of the curves (``curves.png``). Running
the same command again after a kill -9 or SIGTERM resumes from the checkpoints; a run
that already finished only evaluates and rewrites its outputs. Each decision (a new
job, resuming from which checkpoint at which epoch and batch, evaluating only, waiting
for the workers) is printed once, on the chief, as a ``tfdist train mnist: ...`` line.
``CKPT_DIR/job.json`` (``tfdist_examples.job``) records what the checkpoints were made
with: a folder from another recipe, global batch or split is refused with a
``ConfigError``; the same global batch on another number of devices or workers resumes
(``--per-replica-batch`` keeps it: 128 on 1 device = 64 on 2). ``metrics.json`` has numbers as numbers, ``wall_time_s`` is the total
over every run of the job (``this_run_wall_time_s`` the last one's) and
``partial_epochs`` names the epochs trained across a mid-epoch restart: Keras's
history row of such an epoch only covers the batches trained after the resume.

Example:
    >>> from tfdist_examples import mnist
    >>> result = mnist.run(mnist.TrainConfig(recipe="fast", epochs=1))  # doctest: +SKIP
    >>> result["test_accuracy"] > 0.98                                   # doctest: +SKIP
    True
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

from tfdist.core import storage, validate
from tfdist.core.config import RESTART_ENV, ConfigError, keras_backend

__all__ = ["MnistMissing", "TrainConfig", "ensure_mnist", "plot_history", "run", "summary_line"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Options of one ``tfdist train mnist`` run (``None`` = the recipe's value).

    Attributes:
        recipe: ``"fast"`` (default) or ``"tutorial"``.
        epochs: total epochs of the job (a resumed job trains only the missing ones).
        per_replica_batch: examples per replica per step.
        output: directory for the model, metrics, history and plot.
        checkpoint_dir: checkpoints and ``job.json`` (default ``OUTPUT/ckpt``): a folder
            or a URL (``s3://``, ``gs://``, any fsspec filesystem). TensorBoard logs go to
            its ``logs/`` (``OUTPUT/logs`` for a URL: TensorFlow writes no ``s3://``).
        devices: devices in this process: that many GPUs when there are GPUs, else that
            many logical CPU devices; None lets ``tfdist.strategy()`` decide.
        seed: seeds the data order (and the model's initial weights), for exact resume.
        save_freq: also checkpoint every that many steps (``"epoch"``: epoch ends only).
        verbose: Keras progress output on the chief (``"auto"``, 0, 1 or 2).
        train_split: the tfds split to train on, e.g. ``"train[:10%]"`` for a quick run.
        backend: ``"tensorflow"`` or ``"jax"`` (sets ``KERAS_BACKEND`` for the job);
            None keeps ``KERAS_BACKEND`` (else Keras's default, TensorFlow).
    """

    recipe: str = "fast"
    epochs: int | None = None
    per_replica_batch: int | None = None
    output: str = "runs/mnist"
    checkpoint_dir: str | None = None
    devices: int | None = None
    seed: int = 0
    save_freq: int | str = 200
    verbose: int | str = "auto"
    train_split: str = "train"
    backend: str | None = None

    @property
    def ckpt_dir(self) -> str:
        return self.checkpoint_dir or os.path.join(self.output, "ckpt")

    @property
    def log_dir(self) -> str:
        """TensorBoard's folder: beside the checkpoints, local when they are in a bucket."""
        if storage.is_url(self.ckpt_dir):
            return os.path.join(self.output, "logs")
        return os.path.join(self.ckpt_dir, "logs")


class MnistMissing(ConfigError, FileNotFoundError):
    """MNIST is neither on disk nor downloadable: a ``FileNotFoundError`` naming
    ``TFDS_DATA_DIR``, and a ``ConfigError`` so ``tfdist train`` prints it as one line."""


def _strategy(devices: int | None):
    import tensorflow as tf

    import tfdist

    if tfdist.backends.name() == "jax":
        # keras.distribution DataParallel over every device of the job; --devices was
        # applied as TFDIST_CPU_DEVICES before JAX started (see _select_backend).
        return tfdist.distribute.current()
    if devices is None:
        return tfdist.distribute.strategy()
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return tfdist.distribute.strategy(cpu_devices=devices)
    if devices > len(gpus):
        raise ConfigError(
            f"train mnist: --devices {devices} asks for more GPUs than the {len(gpus)} "
            f"present. Received: devices={devices}. Pass at most {len(gpus)}."
        )
    names = [f"/gpu:{i}" for i in range(devices)]
    return tfdist.distribute.strategy("mirrored" if devices > 1 else "one_device", devices=names)


def _number(text: str) -> int | float | str:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _history_rows(path: str) -> list[dict]:
    """Keras's CSV log as numbers, one row per epoch (the last row wins when a run was
    killed between writing an epoch's row and its checkpoint, and the epoch ran again)."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        rows = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]
    by_epoch = {row["epoch"]: row for row in rows}
    return [by_epoch[e] for e in sorted(by_epoch)]


def plot_history(history_csv: str, png_path: str, *, title: str = "MNIST") -> str:
    """Draws loss and accuracy per epoch (train and test) from Keras's CSV log into a PNG.

    Example:
        >>> plot_history("runs/mnist/history.csv", "runs/mnist/curves.png")  # doctest: +SKIP
        'runs/mnist/curves.png'
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    rows = _history_rows(history_csv)
    if not rows:
        raise ValueError(
            "plot_history: no epochs recorded in history_csv. "
            f"Received: history_csv={history_csv!r}. Train at least one epoch first."
        )
    epochs = [int(r["epoch"]) + 1 for r in rows]  # Keras counts from 0, people from 1
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("loss", "accuracy"), strict=True):
        ax.plot(epochs, [float(r[metric]) for r in rows], "o-", label="train")
        if rows[0].get(f"val_{metric}") not in (None, ""):
            ax.plot(epochs, [float(r[f"val_{metric}"]) for r in rows], "s-", label="test")
        ax.set_xlabel("epoch")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def summary_line(metrics: dict) -> str:
    """The one line the job ends with, e.g. ``test_accuracy=0.9921 test_loss=0.0251 ...``."""
    return (
        f"test_accuracy={metrics['test_accuracy']:.4f} test_loss={metrics['test_loss']:.4f} "
        f"epochs={metrics['epochs']} recipe={metrics['recipe']} replicas={metrics['replicas']} "
        f"wall_time_s={metrics['wall_time_s']:.1f}"
    )


def _say(message: str) -> None:
    """Prints one decision of the job, on the chief only (workers stay quiet)."""
    import tfdist

    if tfdist.distribute.is_chief():
        print(f"tfdist train mnist: {message}", flush=True)


def run(config: TrainConfig) -> dict:
    """Trains (or resumes) the MNIST job of ``config``; returns the metrics it wrote.

    Raises:
        FileNotFoundError: MNIST is not on disk and cannot be downloaded (names
            ``TFDS_DATA_DIR``; a ``MnistMissing``).
        ConfigError: the checkpoint folder belongs to a job with another recipe, replica
            count or batch (see ``tfdist_examples.job``).

    Example:
        >>> run(TrainConfig(epochs=1, output="/tmp/mnist"))["epochs"]  # doctest: +SKIP
        1
    """
    start = time.perf_counter()
    import tfdist
    from tfdist_examples import job

    _say_waiting()
    strategy = _strategy(config.devices)
    recipe = _recipe(config)
    replicas = tfdist.distribute.num_replicas(strategy=strategy)
    # Load the data first: a missing dataset should fail before anything is written.
    train, test = _datasets(config, recipe, strategy)
    steps_per_epoch = _steps_per_epoch(train, recipe, replicas)
    record = job.open_record(config.ckpt_dir, _identity(config, recipe, replicas))
    os.makedirs(config.output, exist_ok=True)
    model, initial_epoch = tfdist.make_or_restore(
        _model_builder(config, recipe, replicas, steps_per_epoch),
        config.ckpt_dir,
        strategy=strategy,
    )
    resumed = tfdist.resume_state(model)  # None for a fresh model
    _say_start(config, recipe, initial_epoch, resumed, steps_per_epoch)
    record.start_run(resumed, steps_per_epoch, start)
    history_csv = os.path.join(config.output, "history.csv")
    _fit(model, config, recipe, (train, test), initial_epoch, history_csv, record)
    test_loss, test_accuracy = model.evaluate(test, verbose=0)
    tfdist.save(model, os.path.join(config.output, "model.keras"))
    record.save()
    metrics = _metrics(config, recipe, replicas, record, history_csv)
    metrics.update(test_accuracy=float(test_accuracy), test_loss=float(test_loss))
    if tfdist.distribute.is_chief():
        _write_outputs(config.output, recipe.name, metrics, history_csv)
    return metrics


def _identity(config: TrainConfig, recipe, replicas: int) -> dict:
    """What a checkpoint folder must agree on to be resumed by this job."""
    import tfdist

    return {
        "recipe": recipe.name,
        "replicas": replicas,
        "per_replica_batch": recipe.per_replica_batch,
        "global_batch": recipe.global_batch(replicas),
        "train_split": config.train_split,
        "backend": tfdist.backends.name(),
    }


def _metrics(config: TrainConfig, recipe, replicas: int, record, history_csv: str) -> dict:
    import tfdist

    runs = record.data["runs"]
    return {
        "test_accuracy": None,
        "test_loss": None,
        "epochs": recipe.epochs,
        "resumed_from": runs[-1]["resumed_from"],
        # Total training time of the job over every run (restarts included).
        "wall_time_s": record.data["wall_time_s"],
        "this_run_wall_time_s": runs[-1]["wall_time_s"],
        "runs": len(runs),
        "partial_epochs": record.data["partial_epochs"],
        "replicas": replicas,
        "workers": tfdist.distribute.num_workers(),
        "backend": record.data["identity"]["backend"],
        "recipe": recipe.name,
        "per_replica_batch": recipe.per_replica_batch,
        "global_batch": recipe.global_batch(replicas),
        "config": asdict(config),
        "history": _history_rows(history_csv),
    }


def _say_waiting() -> None:
    import tfdist

    workers = tfdist.cluster_from_env().num_workers
    if workers > 1:
        _say(f"waiting for all {workers} workers to connect")


def _say_start(config: TrainConfig, recipe, initial_epoch: int, resumed, steps: int) -> None:
    """The one line saying what this run does: start, resume, or only evaluate."""
    if initial_epoch >= recipe.epochs:
        _say(
            f"{config.ckpt_dir} already finished {recipe.epochs} epochs: evaluating only "
            "(delete it or pass --output elsewhere to train again, or raise --epochs)"
        )
    elif resumed is not None:
        _say(
            f"resuming from {resumed.path} at epoch {resumed.epoch + 1} of {recipe.epochs}, "
            f"batch {resumed.batch} of {steps}"
        )
    else:
        _say(
            f"starting a new job in {config.ckpt_dir}: {recipe.epochs} epochs of {steps} "
            f"steps, recipe {recipe.name}"
        )


def _recipe(config: TrainConfig):
    """The recipe of ``config``, with its epochs and batch overrides."""
    from tfdist_examples.recipes import get_recipe

    changes = {}
    if config.epochs is not None:
        changes["epochs"] = config.epochs
    if config.per_replica_batch is not None:
        changes["per_replica_batch"] = config.per_replica_batch
    return get_recipe(config.recipe, **changes)


def _datasets(config: TrainConfig, recipe, strategy):
    """The training and test pipelines (MnistMissing when MNIST cannot be had)."""
    import tfdist

    try:
        train_raw, test_raw = tfdist.data.mnist(config.train_split), tfdist.data.mnist("test")
    except FileNotFoundError as err:
        raise MnistMissing(str(err)) from err
    train = tfdist.data.pipeline(
        train_raw,
        recipe.per_replica_batch,
        map_fn=recipe.train_map,
        map_on="batch",
        seed=config.seed,
        strategy=strategy,
    )
    test = tfdist.data.pipeline(
        test_raw, recipe.per_replica_batch, map_fn=recipe.eval_map, shuffle=None, strategy=strategy
    )
    return train, test


def _steps_per_epoch(train, recipe, replicas: int) -> int:
    steps = int(train.cardinality())
    if steps <= 0:  # unknown cardinality: fall back to the arithmetic
        steps = math.floor(60_000 / recipe.global_batch(replicas))
    return steps


def _model_builder(config: TrainConfig, recipe, replicas: int, steps_per_epoch: int):
    """The ``build_fn`` of ``make_or_restore``: the recipe's model, seeded, compiled."""

    def build_and_compile():
        import keras

        keras.utils.set_random_seed(config.seed)
        return recipe.build_and_compile(replicas, steps_per_epoch=steps_per_epoch)

    return build_and_compile


def _fit(model, config: TrainConfig, recipe, data, initial_epoch: int, history_csv: str, record):
    """Trains the epochs still missing, with the standard callbacks (+ CSV on the chief)."""
    import keras

    import tfdist

    train, test = data
    chief = tfdist.distribute.is_chief()
    callbacks = tfdist.callbacks.standard(
        config.ckpt_dir,
        decay=recipe.epoch_decay,
        save_freq=config.save_freq,
        log_dir=config.log_dir,
    )
    callbacks.append(record.callback())
    if chief:
        # append=True keeps the epochs of earlier (interrupted) runs in one history.
        callbacks.append(keras.callbacks.CSVLogger(history_csv, append=initial_epoch > 0))
    if initial_epoch < recipe.epochs:
        model.fit(
            train,
            epochs=recipe.epochs,
            initial_epoch=initial_epoch,
            validation_data=test,
            callbacks=callbacks,
            shuffle=False,  # the pipeline shuffles; Keras would only warn
            verbose=config.verbose if chief else 0,
        )


def _write_outputs(output: str, recipe_name: str, metrics: dict, history_csv: str) -> None:
    """The chief's ``metrics.json`` and, when epochs were recorded, ``curves.png``."""
    with open(os.path.join(output, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    if metrics["history"]:
        plot_history(
            history_csv, os.path.join(output, "curves.png"), title=f"MNIST, {recipe_name} recipe"
        )


def _save_freq(text: str) -> int | str:
    if text == "epoch":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            validate.message(
                "train mnist", "--save-freq", "a positive number of steps or 'epoch'", text
            )
        )
    return value


def _flag(check, value, flag: str, **kwargs):
    """``check`` (a ``tfdist.core.validate`` function) of a command-line flag, failing with a
    ``ConfigError``: ``tfdist train`` prints it as one line and exits with 2."""
    try:
        return check(value, flag, "train mnist", **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None


def _verbose(flag: str, stdout=None) -> int | str:
    """Keras's ``verbose`` for ``--verbose``: "auto" writes one line per epoch (Keras's 2)
    when stdout is a pipe or a file, so a log gets no progress-bar redraws, colour codes
    or backspaces; under ``tfdist launch`` the launcher renders a worker's bar itself.

    Example:
        >>> import io
        >>> _verbose("auto", stdout=io.StringIO())
        2
    """
    if flag != "auto":
        return int(flag)
    stdout = sys.stdout if stdout is None else stdout
    try:
        terminal = stdout.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        terminal = False
    launched = RESTART_ENV in os.environ  # a worker of tfdist launch: its output is a pipe
    return "auto" if terminal or launched else 2


def config_from_args(args) -> TrainConfig:
    """The ``TrainConfig`` of parsed ``tfdist train mnist`` arguments (no TensorFlow).

    Example:
        >>> from tfdist.cli import build_parser
        >>> config_from_args(build_parser().parse_args(["train", "mnist", "--epochs", "2"])).epochs
        2
    """
    for name in ("epochs", "per_replica_batch", "devices"):
        value = getattr(args, name)
        if value is not None:
            _flag(validate.positive_int, value, "--" + name.replace("_", "-"))
    output = args.output or os.path.join("runs", f"mnist-{args.recipe}")
    _check_folder(output, "--output")
    if args.checkpoint_dir is not None:
        _check_folder(args.checkpoint_dir, "--checkpoint-dir")
    return TrainConfig(
        recipe=args.recipe,
        epochs=args.epochs,
        per_replica_batch=args.per_replica_batch,
        output=output,
        checkpoint_dir=args.checkpoint_dir,
        devices=args.devices,
        seed=args.seed,
        save_freq=_save_freq(args.save_freq),
        verbose=_verbose(args.verbose),
        train_split=args.train_split,
        backend=getattr(args, "backend", None),
    )


def _check_folder(path: str, flag: str) -> None:
    """A folder flag naming an existing file (or, for ``--output``, a URL) fails at once,
    before TensorFlow starts."""
    if storage.is_url(path):
        if flag == "--checkpoint-dir":
            return  # checkpoints and job.json go through fsspec (tfdist.core.storage)
        # The job's own outputs (model, metrics, history, plot) are local files; a URL
        # would become a local folder named after its scheme.
        raise ConfigError(
            validate.message(
                "train mnist",
                flag,
                "a local folder",
                path,
                "Pass a local folder (a mounted bucket works); --checkpoint-dir takes a "
                "URL (s3://, gs://, any fsspec filesystem).",
            )
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(
            validate.message(
                "train mnist",
                flag,
                "a folder (it is created if missing)",
                path,
                "That path is a file: pass another folder.",
            )
        )


def worker_argv(config: TrainConfig) -> list[str]:
    """The ``tfdist train mnist`` arguments each worker of ``--workers N`` runs with.

    Example:
        >>> worker_argv(TrainConfig(epochs=2, output="out"))[:4]
        ['train', 'mnist', '--recipe', 'fast']
    """
    argv = ["train", "mnist", "--recipe", config.recipe, "--output", config.output]
    argv += ["--seed", str(config.seed)]
    if config.checkpoint_dir is not None:
        argv += ["--checkpoint-dir", config.checkpoint_dir]
    argv += ["--save-freq", str(config.save_freq), "--verbose", str(config.verbose)]
    argv += ["--train-split", config.train_split]
    if config.backend is not None:
        argv += ["--backend", config.backend]
    if config.epochs is not None:
        argv += ["--epochs", str(config.epochs)]
    if config.per_replica_batch is not None:
        argv += ["--per-replica-batch", str(config.per_replica_batch)]
    return argv


def _select_backend(config: TrainConfig) -> None:
    """Sets ``KERAS_BACKEND`` (and, under JAX, ``--devices`` logical CPU devices) before
    Keras starts; a Keras already started with another backend is a ``ConfigError``."""
    if config.backend is None:
        return
    keras = sys.modules.get("keras")
    running = keras_backend() if keras is not None else None
    if running is not None and running != config.backend:
        raise ConfigError(
            f"train mnist: Keras already runs on {running}. Received: "
            f"--backend={config.backend}. Run `tfdist train mnist` in a new process."
        )
    os.environ["KERAS_BACKEND"] = config.backend
    if config.backend == "jax" and config.devices is not None:
        os.environ.setdefault("TFDIST_CPU_DEVICES", str(config.devices))


def ensure_mnist(train_split: str = "train") -> None:
    """Downloads and prepares MNIST (``tfdist.data.mnist``) unless it is on disk already;
    a ``MnistMissing`` naming ``TFDS_DATA_DIR`` when it cannot be had.

    Example:
        >>> ensure_mnist("train[:5%]")  # doctest: +SKIP
    """
    import tfdist

    try:
        tfdist.data.mnist(train_split)
        tfdist.data.mnist("test")
    except FileNotFoundError as err:
        raise MnistMissing(str(err)) from err


def main(args) -> int:
    """Runs ``tfdist train mnist`` from parsed arguments; returns the exit code.

    With ``--workers N`` (N > 1) it starts N workers through ``tfdist launch`` (each
    running this job without ``--workers``, with ``--devices`` devices each) and returns
    the launcher's exit code; otherwise it trains in this process and prints the summary
    line on the chief.
    """
    config = config_from_args(args)
    _flag(validate.integer, args.workers, "--workers", low=1, what=">= 1")
    _flag(validate.integer, args.max_restarts, "--max-restarts", low=0, what=">= 0")
    _select_backend(config)
    if args.workers > 1:
        from tfdist import launch

        # Workers run in a private network namespace (no internet): fetch MNIST here.
        ensure_mnist(config.train_split)
        _say(f"launching {args.workers} workers")

        return launch.run(
            launch.LaunchOptions(
                nproc=args.workers,
                target="tfdist",
                module=True,
                args=tuple(worker_argv(config)),
                devices_per_worker=config.devices,
                max_restarts=args.max_restarts,
            )
        )
    metrics = run(config)
    from tfdist import distribute

    if distribute.is_chief():
        print(summary_line(metrics), flush=True)
    return 0
