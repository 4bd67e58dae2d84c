"""Times the MNIST recipes side by side: wall time to the final test accuracy, and the ratio.

Each training run is a fresh Python process (the same start-up for every recipe, and a
hard timeout), on the same tf.data pipeline: tfds MNIST decoded once and cached as uint8,
shuffled, batched with the global batch, scaled per batch by the recipe's map,
prefetched. Only ``model.fit`` is timed; the cache is filled before the clock starts.
Runs are interleaved in counterbalanced rounds (tutorial, fast; then fast, tutorial; ...)
so that a change in the machine's load hits both recipes alike, and the ratio
fast/tutorial is taken within each round.

    python -m tools.bench.recipes                     # both recipes, seed 0
    python -m tools.bench.recipes --seeds 0 1 2       # three rounds
    python -m tools.bench.recipes --quick             # smoke test: 2048 examples, 1 epoch
    python -m tools.bench.recipes --recipes fast --per-replica-batch 512   # LR scaled 4x

Needs MNIST in ``TFDS_DATA_DIR`` (or ``--data-dir``); it never downloads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from tools.bench import harness

logger = logging.getLogger(__name__)
REPO = harness.REPO

RECIPES = ("tutorial", "fast")
QUICK_TRAIN, QUICK_TEST = 2048, 1000
SHUFFLE_BUFFER = 10_000
DEFAULT_TIMEOUT_S = 1800.0


def _positive_int(value, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{where}: {name} must be a positive int or None. Received: {name}={value!r}."
        )
    return value


def train_once(
    recipe: str,
    *,
    seed: int = 0,
    quick: bool = False,
    epochs: int | None = None,
    per_replica_batch: int | None = None,
    replicas: int = 1,
    data_dir: str | None = None,
) -> dict:
    """Trains one recipe in this process and returns its wall time and test accuracy.

    TensorFlow fixes its devices at first use, so ``replicas > 1`` (logical CPU devices
    under MirroredStrategy) only works in a fresh process; ``benchmark`` runs every call
    in one.

    Args:
        recipe: ``"tutorial"`` or ``"fast"``.
        seed: ``keras.utils.set_random_seed`` seed (weights and shuffling).
        quick: train on the first 2048 examples for 1 epoch and test on 1000.
        epochs: overrides the recipe's epochs.
        per_replica_batch: overrides the recipe's batch per replica.
        replicas: >1 trains under MirroredStrategy on that many logical CPUs.
        data_dir: tfds data directory; defaults to ``TFDS_DATA_DIR``.

    Returns:
        A dict with ``train_s`` (wall seconds in ``fit``), ``cpu_s`` (process CPU seconds
        in ``fit``), ``test_accuracy``, ``test_loss``, ``epochs``, ``global_batch``, ...

    Example:
        >>> train_once("fast", quick=True)["test_accuracy"]  # doctest: +SKIP
        0.93
    """
    import keras
    import tensorflow as tf
    import tensorflow_datasets as tfds

    from tfdist_examples import recipes as recipes_lib

    if recipe not in recipes_lib.RECIPES:
        raise ValueError(
            f"train_once: recipe must be one of {recipes_lib.recipe_names()}. "
            f"Received: recipe={recipe!r}."
        )
    replicas = _positive_int(replicas, "replicas", "train_once")
    changes = {}
    if quick:
        changes["epochs"] = 1
    if epochs is not None:
        changes["epochs"] = _positive_int(epochs, "epochs", "train_once")
    if per_replica_batch is not None:
        changes["per_replica_batch"] = _positive_int(
            per_replica_batch, "per_replica_batch", "train_once"
        )
    r = recipes_lib.get_recipe(recipe, **changes)

    import tfdist

    strategy = None
    if replicas > 1:  # before any tensor exists: TensorFlow fixes its devices at first use
        strategy = tfdist.strategy(cpu_devices=replicas)

    data_dir = data_dir or os.environ.get("TFDS_DATA_DIR")
    splits = [f"train[:{QUICK_TRAIN}]", f"test[:{QUICK_TEST}]"] if quick else ["train", "test"]
    try:
        # download=False: offline, a missing dataset must fail now, not retry for minutes.
        train, test = tfds.load(
            "mnist", split=splits, as_supervised=True, data_dir=data_dir, download=False
        )
    except AssertionError as e:
        raise FileNotFoundError(
            f"bench_recipes: MNIST is not prepared in data_dir={data_dir!r} ({e}). "
            "Set TFDS_DATA_DIR (or --data-dir) to a tensorflow_datasets directory with mnist."
        ) from None
    num_train = QUICK_TRAIN if quick else 60_000

    keras.utils.set_random_seed(seed)

    train, test = train.cache(), test.cache()
    for _ in train.batch(4096):  # fill the uint8 cache before the clock starts
        pass
    global_batch = r.global_batch(replicas)
    train_ds = (
        train.shuffle(SHUFFLE_BUFFER, seed=seed)
        .batch(global_batch)
        .map(r.train_map, num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(tf.data.AUTOTUNE)
    )
    test_ds = test.batch(1000).map(r.eval_map).prefetch(tf.data.AUTOTUNE)
    steps = r.steps_per_epoch(replicas, num_examples=num_train)

    if strategy is not None:
        with strategy.scope():
            model = r.build_and_compile(replicas, steps_per_epoch=steps)
    else:
        model = r.build_and_compile(replicas, steps_per_epoch=steps)

    wall, cpu = time.perf_counter(), time.process_time()
    history = model.fit(
        train_ds,
        epochs=r.epochs,
        callbacks=[tfdist.callbacks.decay(r.epoch_decay)] if r.epoch_decay else [],
        verbose=0,
    )
    train_s, cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    test_loss, test_accuracy = model.evaluate(test_ds, verbose=0)
    return {
        "recipe": r.name,
        "seed": seed,
        "epochs": r.epochs,
        "replicas": replicas,
        "per_replica_batch": r.per_replica_batch,
        "global_batch": global_batch,
        "train_examples": num_train,
        "train_s": round(train_s, 2),
        "cpu_s": round(cpu_s, 2),
        "final_train_loss": round(float(history.history["loss"][-1]), 5),
        "test_accuracy": round(float(test_accuracy), 5),
        "test_loss": round(float(test_loss), 5),
    }


def _run_child(args: list[str], *, timeout_s: float, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", __spec__.name, "--child", *args]
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired:  # subprocess.run has killed the child by now
        raise TimeoutError(
            f"bench_recipes: a training run took more than timeout_s={timeout_s} s and was "
            f"killed: {' '.join(args)}. Raise --timeout-s on a slow machine, or use --quick."
        ) from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench_recipes: training run {' '.join(args)} exited {proc.returncode}:\n"
            f"{proc.stderr[-3000:]}"
        )
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"bench_recipes: no result from {' '.join(args)}:\n{proc.stdout[-2000:]}")


def run_order(recipes: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, recipe) in counterbalanced order: A B, B A, A B, ...

    Example:
        >>> run_order(["tutorial", "fast"], 3)
        [(0, 'tutorial'), (0, 'fast'), (1, 'fast'), (1, 'tutorial'), (2, 'tutorial'), (2, 'fast')]
    """
    order = []
    for i in range(rounds):
        names = harness.in_turn(list(recipes), i)
        order.extend((i, name) for name in names)
    return order


def summarize(runs: Sequence[dict], *, target: float = 0.99) -> dict:
    """Per-recipe times and accuracies, and fast/tutorial ratios paired by round.

    Runs carry ``round`` (``benchmark`` sets it; the seed stands in without one); the
    ratio of a round compares two runs made back to back, which is what cancels the
    machine's changing load.

    Example:
        >>> runs = [{"recipe": "tutorial", "seed": 0, "train_s": 100.0, "test_accuracy": 0.986},
        ...         {"recipe": "fast", "seed": 0, "train_s": 40.0, "test_accuracy": 0.992}]
        >>> summarize(runs)["ratio_fast_over_tutorial"]
        0.4
    """
    out: dict = {"recipes": {}}
    for name in dict.fromkeys(r["recipe"] for r in runs):
        mine = [r for r in runs if r["recipe"] == name]
        acc = [r["test_accuracy"] for r in mine]
        times = [r["train_s"] for r in mine]
        cpu = [r["cpu_s"] for r in mine if "cpu_s" in r]
        out["recipes"][name] = {
            "train_s": times,
            "train_s_mean": round(statistics.fmean(times), 2),
            # CPU seconds are less disturbed by other processes than wall time.
            "cpu_s_mean": round(statistics.fmean(cpu), 2) if cpu else None,
            "test_accuracy": acc,
            "test_accuracy_mean": round(statistics.fmean(acc), 5),
            "test_accuracy_min": min(acc),
            f"all_reach_{target}": all(a >= target for a in acc),
        }
    by_round: dict = {}
    for r in runs:
        by_round.setdefault(r.get("round", r["seed"]), {})[r["recipe"]] = r["train_s"]
    ratios = [
        round(t["fast"] / t["tutorial"], 4)
        for t in by_round.values()
        if {"fast", "tutorial"} <= set(t)
    ]
    if ratios:
        out["ratios_by_round"] = ratios
        out["ratio_fast_over_tutorial"] = round(statistics.median(ratios), 4)
    return out


def benchmark(
    *,
    recipes: Sequence[str] = RECIPES,
    seeds: Sequence[int] = (0,),
    quick: bool = False,
    epochs: int | None = None,
    per_replica_batch: int | None = None,
    replicas: int = 1,
    data_dir: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict:
    """Trains each recipe once per seed, interleaved, each run in a fresh process.

    Args:
        recipes: recipe names, e.g. ``("tutorial", "fast")``.
        seeds: one round per seed; the order alternates between rounds.
        quick: 2048 training examples and 1 epoch per run (a smoke test).
        epochs: overrides every recipe's epochs.
        per_replica_batch: overrides every recipe's batch per replica.
        replicas: logical CPU replicas (MirroredStrategy) when > 1.
        data_dir: tfds data directory; defaults to ``TFDS_DATA_DIR``.
        timeout_s: hard limit for each run; the run is killed after it.

    Returns:
        ``{"runs": [...], "summary": {...}, "machine": {...}}`` (see ``summarize``).

    Example:
        >>> benchmark(quick=True)["summary"]["ratio_fast_over_tutorial"]  # doctest: +SKIP
        0.7
    """
    from tfdist_examples.recipes import RECIPES as KNOWN

    if isinstance(recipes, str) or not recipes or any(n not in KNOWN for n in recipes):
        raise ValueError(
            f"benchmark: recipes must be a non-empty list of names from {sorted(KNOWN)}. "
            f"Received: recipes={recipes!r}."
        )
    if isinstance(seeds, (str, int)) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ValueError(
            f"benchmark: seeds must be a non-empty list of ints. Received: seeds={seeds!r}."
        )
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(
            f"benchmark: timeout_s must be a positive number. Received: timeout_s={timeout_s!r}."
        )
    for name, value in (("epochs", epochs), ("per_replica_batch", per_replica_batch)):
        if value is not None:
            _positive_int(value, name, "benchmark")
    _positive_int(replicas, "replicas", "benchmark")

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    if data_dir:
        env["TFDS_DATA_DIR"] = str(data_dir)
    common = ["--replicas", str(replicas)]
    if quick:
        common.append("--quick")
    if epochs is not None:
        common += ["--epochs", str(epochs)]
    if per_replica_batch is not None:
        common += ["--per-replica-batch", str(per_replica_batch)]

    load_before = os.getloadavg()
    runs = []
    for i, name in run_order(recipes, len(seeds)):
        seed = seeds[i]
        logger.info("bench_recipes: %s seed=%d", name, seed)
        result = _run_child([name, "--seed", str(seed), *common], timeout_s=timeout_s, env=env)
        result["round"] = i
        logger.info("bench_recipes: %s", result)
        runs.append(result)
    return {
        "runs": runs,
        "summary": summarize(runs),
        "machine": {
            **harness.machine(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--quick", action="store_true", help="2048 examples, 1 epoch per run")
    p.add_argument("--epochs", type=int)
    p.add_argument("--per-replica-batch", type=int)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--data-dir")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.add_argument("--child", metavar="RECIPE", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return p


# --- the table's rows (python -m tools.bench, tools/bench/suite.py) --------------------


def _figures_time_to_accuracy(quick: bool, pairs: int) -> dict:
    return benchmark(quick=quick, seeds=list(range(1 if quick else pairs)))


def _result_time_to_accuracy(f: dict, quick: bool) -> harness.Result:
    summary = f["summary"]
    fast, tutorial = summary["recipes"]["fast"], summary["recipes"]["tutorial"]
    ratios = summary["ratios_by_round"]
    reaches = fast["all_reach_0.99"]
    return harness.Result(
        ratios,
        met=None if quick else (statistics.median(ratios) < 1 and reaches),
        a_values=fast["train_s"],
        b_values=tutorial["train_s"],
        notes=f"test accuracy fast {fast['test_accuracy']} vs tutorial "
        f"{tutorial['test_accuracy']}; fit time only, each run a fresh process"
        + (" (quick: 2048 examples, 1 epoch: no accuracy goal)" if quick else ""),
    )


TABLE_ROWS = [
    harness.Row(
        "time-to-accuracy",
        "fast recipe (>= 99.0%)",
        "tutorial recipe, 12 epochs",
        "< 1 and reaches 99%",
        _figures_time_to_accuracy,
        _result_time_to_accuracy,
    )
]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line; prints one JSON result line per run and a summary table."""
    args = _parser().parse_args(argv)
    if args.child:
        result = train_once(
            args.child,
            seed=args.seed,
            quick=args.quick,
            epochs=args.epochs,
            per_replica_batch=args.per_replica_batch,
            replicas=args.replicas,
            data_dir=args.data_dir,
        )
        print(json.dumps(result), flush=True)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = benchmark(
        recipes=args.recipes,
        seeds=args.seeds,
        quick=args.quick,
        epochs=args.epochs,
        per_replica_batch=args.per_replica_batch,
        replicas=args.replicas,
        data_dir=args.data_dir,
        timeout_s=args.timeout_s,
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{'recipe':<10}{'seed':>5}{'epochs':>7}{'batch':>7}{'train s':>9}{'cpu s':>8}{'test acc':>10}"
    )
    for r in result["runs"]:
        print(
            f"{r['recipe']:<10}{r['seed']:>5}{r['epochs']:>7}{r['global_batch']:>7}"
            f"{r['train_s']:>9.1f}{r['cpu_s']:>8.1f}{r['test_accuracy']:>10.4f}"
        )
    s = result["summary"]
    for name, v in s["recipes"].items():
        print(
            f"{name}: mean train {v['train_s_mean']:.1f} s (CPU {v['cpu_s_mean']} s), accuracy mean "
            f"{v['test_accuracy_mean']:.4f} min {v['test_accuracy_min']:.4f}"
        )
    if "ratio_fast_over_tutorial" in s:
        print(
            f"ratio fast/tutorial (median over rounds): {s['ratio_fast_over_tutorial']:.3f} "
            f"(per round: {s['ratios_by_round']})"
        )
    m = result["machine"]
    print(f"{harness.machine_line(m)}; load {m['loadavg_before']} -> {m['loadavg_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
