"""The fast recipe on several seeds, 1 device and 2 devices, against the tutorial recipe.

Runs ``tfdist train mnist --seed S`` for each seed on 1 device and with ``--devices 2
--per-replica-batch 64`` (the same global batch of 128), each in a fresh process and a
fresh output folder, then the tutorial recipe once per seed listed in ``--tutorial-seeds``
for the time ratio. Reads each run's ``metrics.json`` (test accuracy, wall time) and
writes them, with the machine and versions, to ``--json`` (docs/mnist.md's table is
rendered from that file by tools/docs/figures.py).

    python -m tools.bench.recipe_seeds --seeds 0 1 2 3 4 --json tools/results/recipe_seeds_measured.json
    python -m tools.bench.recipe_seeds --seeds 0 --epochs 1          # a quick look

Needs MNIST in ``TFDS_DATA_DIR``; it never downloads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench import harness

GOAL_ACCURACY = 0.993
GOAL_TIME_RATIO = 0.5
TIMEOUT_S = 1800
TOPOLOGIES = {"1 device": [], "2 devices": ["--devices", "2", "--per-replica-batch", "64"]}


def train(recipe: str, seed: int, extra: list[str], folder: Path) -> dict:
    """One ``tfdist train mnist`` run; its metrics.json."""
    cmd = [sys.executable, "-m", "tfdist", "train", "mnist", "--recipe", recipe]
    cmd += ["--seed", str(seed), "--output", str(folder), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"recipe_seeds: {' '.join(cmd[1:])} exited {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")  # fmt: skip
    return json.loads((folder / "metrics.json").read_text())


def measure(seeds: list[int], tutorial_seeds: list[int], epochs: int | None = None) -> dict:
    """Every run's accuracy and wall time, and the summary the docs show.

    Example:
        >>> measure([0], [], epochs=1)["runs"][0]["topology"]  # doctest: +SKIP
        '1 device'
    """
    if not seeds:
        raise ValueError("recipe_seeds: seeds must name at least one seed. Received: seeds=[]")
    extra = ["--epochs", str(epochs)] if epochs else []
    runs = []
    with tempfile.TemporaryDirectory(prefix="recipe-seeds-") as scratch:
        for seed in seeds:
            for topology, flags in TOPOLOGIES.items():
                m = train("fast", seed, flags + extra, Path(scratch) / f"fast-{seed}-{len(runs)}")
                runs.append(_row("fast", seed, topology, m))
        for seed in tutorial_seeds:
            m = train("tutorial", seed, extra, Path(scratch) / f"tutorial-{seed}")
            runs.append(_row("tutorial", seed, "1 device", m))
    return {"machine": harness.machine(), "epochs": epochs, **summarise(runs), "runs": runs}


def _row(recipe: str, seed: int, topology: str, metrics: dict) -> dict:
    return {
        "recipe": recipe, "seed": seed, "topology": topology,
        "test_accuracy": metrics["test_accuracy"], "wall_time_s": metrics["wall_time_s"],
        "epochs": metrics["epochs"], "global_batch": metrics["global_batch"],
    }  # fmt: skip


def summarise(runs: list[dict]) -> dict:
    """The lowest fast accuracy, whether every run reached the goal, the time ratio.

    Example:
        >>> summarise([{"recipe": "fast", "topology": "1 device", "test_accuracy": 0.994,
        ...   "wall_time_s": 40.0}, {"recipe": "tutorial", "topology": "1 device",
        ...   "test_accuracy": 0.988, "wall_time_s": 100.0}])["time_ratio"]
        0.4
    """
    fast = [r for r in runs if r["recipe"] == "fast"]
    tutorial = [r["wall_time_s"] for r in runs if r["recipe"] == "tutorial"]
    one_device = [r["wall_time_s"] for r in fast if r["topology"] == "1 device"]
    ratio = statistics.median(one_device) / statistics.median(tutorial) if tutorial else None
    return {
        "fast_accuracy_min": min(r["test_accuracy"] for r in fast),
        "all_reach_goal": all(r["test_accuracy"] >= GOAL_ACCURACY for r in fast),
        "time_ratio": None if ratio is None else round(ratio, 3),
        "goals": {"accuracy": GOAL_ACCURACY, "time_ratio": GOAL_TIME_RATIO},
    }


def table(payload: dict) -> list[str]:
    """Markdown lines: one row per seed, a column per topology, then the summary."""
    fast = [r for r in payload["runs"] if r["recipe"] == "fast"]
    seeds = sorted({r["seed"] for r in fast})
    cell = {(r["seed"], r["topology"]): r for r in fast}
    lines = ["| seed | " + " | ".join(TOPOLOGIES) + " |", "|---" * (len(TOPOLOGIES) + 1) + "|"]
    for seed in seeds:
        cells = [cell.get((seed, t)) for t in TOPOLOGIES]
        shown = [
            f"{c['test_accuracy']:.2%} in {c['wall_time_s']:.0f} s" if c else "-" for c in cells
        ]
        lines.append(f"| {seed} | " + " | ".join(shown) + " |")
    tutorial = [r for r in payload["runs"] if r["recipe"] == "tutorial"]
    lines.append("")
    lines.append(
        f"Lowest: {payload['fast_accuracy_min']:.2%} (goal {GOAL_ACCURACY:.1%} on every run: "
        f"{'met' if payload['all_reach_goal'] else 'not met'})."
    )
    if tutorial:
        t = tutorial[0]
        lines.append(
            f"Tutorial recipe, seed {t['seed']}, 1 device: {t['test_accuracy']:.2%} in "
            f"{t['wall_time_s']:.0f} s; fast/tutorial wall time (1 device, medians): "
            f"{payload['time_ratio']} (goal <= {GOAL_TIME_RATIO})."
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--tutorial-seeds", nargs="*", type=int, default=[0])
    parser.add_argument("--epochs", type=int, help="override both recipes' epochs (a quick look)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    payload = measure(args.seeds, args.tutorial_seeds, args.epochs)
    print(harness.machine_line(payload["machine"]))
    print("\n".join(table(payload)))
    if args.json:
        harness.write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
