"""The docs' measured figures, generated from the JSON files the benchmark tools write.

Every figure in docs/ comes from a file a tool wrote, with the machine, the versions and
the date inside it; this tool renders those files into the pages' generated blocks:

* docs/benchmarks.md: ``tools/results/benchmark_measured.json``
  (``python -m tools.bench --pairs 3 --json tools/results/benchmark_measured.json``) and
  ``tools/results/benchmark_runs.json``, runs in a row on one machine
  (``python -m tools.docs.figures --combine-runs run1.json run2.json run3.json``);
* docs/scaling.md: ``python -m tools.scaling_model --gpu tools/results/gpu_measured.json``, from
  ``tools/results/scaling_measured.json`` and ``tools/results/gpu_measured.json`` (``tools/bench/gpu.py``);
* docs/mnist.md: ``tools/results/recipe_seeds_measured.json`` (``python -m tools.bench.recipe_seeds
  --json tools/results/recipe_seeds_measured.json``);
* docs/checkpoints.md: ``tools/results/sharded_measured.json`` (``python -m tools.bench.sharded
  --rounds 5 --mb 60 --every 10 --processes 2 --idle-core --json
  tools/results/sharded_measured.json``) and
  ``tools/results/epoch_start_measured.json`` (``python -m tools.bench.epoch_start --json
  tools/results/epoch_start_measured.json``) and ``tools/results/epoch_start_loaded_measured.json`` (the
  same with ``--load 2``), and ``tools/results/logical_devices_measured.json`` (``python
  tools/bench/logical_devices.py --rounds 3 --json tools/results/logical_devices_measured.json``),
  and ``tools/results/step_breakdown_measured.json`` (``python -m tools.bench.step_breakdown --pairs 2
  --json tools/results/step_breakdown_measured.json``), and ``tools/results/partial_batch_cost_measured.json``
  (``python -m tools.bench.partial_batch_cost --pairs 5 --json
  tools/results/partial_batch_cost_measured.json``), in docs/benchmarks.md.

    python -m tools.docs.figures            # print the blocks
    python -m tools.docs.figures --write    # replace them in the pages

tests/project/test_docs.py checks the pages hold exactly these blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
from pathlib import Path

from tools import generated_block

TOOLS = Path(__file__).resolve().parents[1]
RESULTS = TOOLS / "results"
DOCS = TOOLS.parent / "docs"
BENCHMARK_JSON = RESULTS / "benchmark_measured.json"
BENCHMARK_RUNS_JSON = RESULTS / "benchmark_runs.json"
STABLE = 0.15  # a row is stable when its min and max lie within 15 % of its median
RECIPE_SEEDS_JSON = RESULTS / "recipe_seeds_measured.json"
ELASTIC_JSON = RESULTS / "elastic_measured.json"
SHARDED_JSON = RESULTS / "sharded_measured.json"
EPOCH_START_JSON = RESULTS / "epoch_start_measured.json"
# The same tool with --load 2 (busy loops beside the job); rendered after the quiet run.
EPOCH_START_LOADED_JSON = RESULTS / "epoch_start_loaded_measured.json"
LOGICAL_DEVICES_JSON = RESULTS / "logical_devices_measured.json"
STEP_BREAKDOWN_JSON = RESULTS / "step_breakdown_measured.json"
PARTIAL_BATCH_COST_JSON = RESULTS / "partial_batch_cost_measured.json"


def _machine_line(mach: dict) -> str:
    gpus = ", ".join(mach.get("gpus") or []) or "none"
    return (
        f"Machine: {mach['cpu']}, {mach['cores']} cores, GPUs: {gpus}; python "
        f"{mach['python']}, tensorflow {mach['tensorflow']}, keras {mach['keras']}, tfdist "
        f"{mach.get('tfdist')}; measured {mach['date']}."
    )


def _ratio(row: dict) -> str:
    if row.get("error"):
        return f"error: {row['error']}"
    ratios = row["ratios"]
    return f"{row['median']:.3g} ({min(ratios):.3g}-{max(ratios):.3g}, n={len(ratios)})"


def benchmarks_block(payload: dict) -> list[str]:
    """The benchmark table of ``payload`` (what ``tools/bench/suite.py --json`` writes)."""
    met = {True: "yes", False: "**no**", None: "-"}
    lines = [
        _machine_line(payload["machine"]) + f" {payload['pairs']} alternated pair(s) per row.",
        "",
        "| name | A | B | A/B median (min-max) | goal | met |",
        "|---|---|---|---|---|---|",
    ]
    for row in payload["rows"]:
        lines.append(
            f"| {row['name']} | {row['a']} | {row['b']} | {_ratio(row)} | {row['goal']} "
            f"| {met[row.get('met')]} |"
        )
    notes = [f"- {r['name']}: {r['notes']}" for r in payload["rows"] if r.get("notes")]
    notes += _per_execution_savings(payload["rows"])
    return lines + ([""] + notes if notes else [])


def _per_execution_savings(rows: list[dict]) -> list[str]:
    """What ``steps_per_execution=8`` saves per step against 1, on each side of the
    ``multi-worker-*`` rows: the per-step host round trip and reduction of the logs that
    K = 8 makes once per 8 steps (medians of each row's A and B values)."""
    by_name = {row["name"]: row for row in rows if not row.get("error") and row.get("a_values")}
    lines = []
    for name in ("multi-worker-step", "multi-worker-accumulation"):
        k1, k8 = by_name.get(name), by_name.get(f"{name}-k8")
        if k1 is None or k8 is None:
            continue
        saved = {
            side: statistics.median(k1[f"{side}_values"]) - statistics.median(k8[f"{side}_values"])
            for side in ("a", "b")
        }
        lines.append(
            f"- {name}, K = 1 minus K = 8: {saved['a']:.1f} {k1['value_unit']} on 2 workers, "
            f"{saved['b']:.1f} on 2 devices (the per-step round trip and reduction of the "
            f"logs that K = 8 makes once per 8 steps)"
        )
    return lines


def _spread(row: dict) -> float:
    """The largest distance of a row's ratios from their median, as a fraction of it.

    Example:
        >>> round(_spread({"median": 2.0, "ratios": [1.8, 2.0, 2.5]}), 2)
        0.25
    """
    return max(abs(r - row["median"]) for r in row["ratios"]) / row["median"]


def runs_block(runs: list[dict]) -> list[str]:
    """Each row's median and range in every run of ``runs``, and whether it is stable.

    A run is what ``tools/bench/suite.py --json`` writes; a row is stable in a run when
    every ratio lies within ``STABLE`` of that run's median.
    """
    names = [row["name"] for row in runs[0]["rows"]]
    header = " | ".join(f"run {i + 1}" for i in range(len(runs)))
    lines = [
        _machine_line(runs[-1]["machine"])
        + f" {len(runs)} runs in a row, {runs[0]['pairs']} alternated pair(s) per row each.",
        "",
        f"| name | {header} | every ratio within ±{STABLE:.0%} of its run's median | goal met |",
        "|---|" + "---|" * len(runs) + "---|---|",
    ]
    met = {True: "yes", False: "no", None: "-"}
    for name in names:
        rows = [next(r for r in run["rows"] if r["name"] == name) for run in runs]
        ok = [r for r in rows if not r.get("error")]
        stable = len(ok) == len(rows) and all(_spread(r) <= STABLE for r in ok)
        spreads = ", ".join(f"{_spread(r):.0%}" for r in ok)
        verdicts = "/".join(met[r.get("met")] for r in rows)
        cells = " | ".join(_ratio(r) for r in rows)
        lines.append(
            f"| {name} | {cells} | {'yes' if stable else '**no**'} ({spreads}) | {verdicts} |"
        )
    return lines


def combine_runs(paths: list[str]) -> dict:
    """One payload of several ``tools/bench/suite.py --json`` files, in the order given.

    Example:
        >>> combine_runs(["a.json", "b.json"])["runs"][0]["pairs"]  # doctest: +SKIP
        3
    """
    runs = [json.loads(Path(p).read_text()) for p in paths]
    names = [[row["name"] for row in run["rows"]] for run in runs]
    if len(runs) < 2 or any(n != names[0] for n in names):
        raise ValueError(
            f"combine_runs: needs 2 or more runs of the same rows. Received: {paths} with "
            f"rows {names}. Run tools/bench/suite.py with the same --only and --pairs each time."
        )
    return {"runs": runs}


def scaling_block() -> list[str]:
    """The scaling model's report (its inputs name their machines and dates)."""
    from tools import scaling_model

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        scaling_model.main(["--gpu", str(RESULTS / "gpu_measured.json")])
    lines = out.getvalue().rstrip("\n").splitlines()[1:]  # drop "scaling model, <today>"
    # Its sections become sub-headings of the page's.
    return [("###" + line[2:]) if line.startswith("## ") else line for line in lines]


def recipe_seeds_block(payload: dict) -> list[str]:
    """The fast recipe's seeds table of ``payload`` (what ``tools/bench/recipe_seeds.py`` writes)."""
    from tools.bench import recipe_seeds

    return [_machine_line(payload["machine"]), "", *recipe_seeds.table(payload)]


def sharded_block(payload: dict) -> list[str]:
    """The sharded-checkpoint figures of ``payload`` (what ``tools/bench/sharded.py`` writes)."""
    from tools.bench import sharded as bench_sharded

    return [f"- {line}" for line in bench_sharded.report(payload).splitlines()]


def epoch_start_block(payload: dict) -> list[str]:
    """The first step of an epoch (what ``tools/bench/epoch_start.py`` writes)."""
    from tools.bench import epoch_start as bench_epoch_start

    lines = bench_epoch_start.report(payload).splitlines()
    return [_machine_line(payload["machine"]), "", *(f"- {line}" for line in lines)]


def logical_devices_block(payload: dict) -> list[str]:
    """1 device against 2 logical devices (what ``tools/bench/logical_devices.py`` writes)."""
    from tools.bench import logical_devices as bench_logical_devices

    lines = bench_logical_devices.report(payload).splitlines()
    return [_machine_line(payload["machine"]), "", lines[0], "", *(f"- {x}" for x in lines[1:])]


def step_breakdown_block(payload: dict) -> list[str]:
    """The parts of a step on 2 workers and 2 devices (what ``tools/bench/step_breakdown.py`` writes)."""
    from tools.bench import step_breakdown

    return step_breakdown.format_table(payload).splitlines()


def partial_batch_cost_block(payload: dict) -> list[str]:
    """Full batches with the partial-batch fixes on and off (what
    ``tools/bench/partial_batch_cost.py`` writes)."""
    from tools.bench import partial_batch_cost as bench_partial_batch_cost

    lines = bench_partial_batch_cost.report(payload).splitlines()
    return [_machine_line(payload["machine"]), "", lines[0], "", *(f"- {x}" for x in lines[1:])]


def elastic_block(payload: dict) -> list[str]:
    """An elastic re-form against a plain restart (``tools/bench/elastic.py``)."""
    from tools.bench import elastic

    return [_machine_line(payload["machine"]), "", elastic.report(payload)]


def blocks() -> dict[str, tuple[Path, str]]:
    """name -> (page, block with its markers)."""
    payload = json.loads(BENCHMARK_JSON.read_text())
    found = {
        "benchmarks": (DOCS / "benchmarks.md", benchmarks_block(payload)),
        "benchmark runs": (
            DOCS / "benchmarks.md",
            runs_block(json.loads(BENCHMARK_RUNS_JSON.read_text())["runs"]),
        ),
        "scaling model": (DOCS / "scaling.md", scaling_block()),
    }
    seeds = recipe_seeds_block(json.loads(RECIPE_SEEDS_JSON.read_text()))
    found["recipe seeds"] = (DOCS / "mnist.md", seeds)
    sharded = sharded_block(json.loads(SHARDED_JSON.read_text()))
    found["sharded checkpoints"] = (DOCS / "checkpoints.md", sharded)
    epoch_start = epoch_start_block(json.loads(EPOCH_START_JSON.read_text()))
    if EPOCH_START_LOADED_JSON.exists():
        epoch_start += ["", *epoch_start_block(json.loads(EPOCH_START_LOADED_JSON.read_text()))]
    found["epoch start"] = (DOCS / "benchmarks.md", epoch_start)
    logical = logical_devices_block(json.loads(LOGICAL_DEVICES_JSON.read_text()))
    found["logical devices"] = (DOCS / "benchmarks.md", logical)
    breakdown = step_breakdown_block(json.loads(STEP_BREAKDOWN_JSON.read_text()))
    found["step breakdown"] = (DOCS / "benchmarks.md", breakdown)
    partial = partial_batch_cost_block(json.loads(PARTIAL_BATCH_COST_JSON.read_text()))
    found["partial batch cost"] = (DOCS / "benchmarks.md", partial)
    if ELASTIC_JSON.exists():
        found["elastic"] = (
            DOCS / "elastic.md",
            elastic_block(json.loads(ELASTIC_JSON.read_text())),
        )
    return {
        name: (page, "\n".join([_begin(name), *lines, _end(name)]))
        for name, (page, lines) in found.items()
    }


def _begin(name: str) -> str:
    return f"<!-- {name}: begin (python -m tools.docs.figures --write) -->"


def _end(name: str) -> str:
    return f"<!-- {name}: end -->"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the blocks in docs/")
    parser.add_argument(
        "--combine-runs",
        nargs="+",
        metavar="RUN_JSON",
        help="write these python -m tools.bench --json runs to tools/results/benchmark_runs.json, and the "
        "last one to tools/results/benchmark_measured.json",
    )
    args = parser.parse_args(argv)
    if args.combine_runs:
        combined = combine_runs(args.combine_runs)
        BENCHMARK_RUNS_JSON.write_text(json.dumps(combined, indent=2) + "\n")
        BENCHMARK_JSON.write_text(json.dumps(combined["runs"][-1], indent=2) + "\n")
    status = 0
    for name, (page, block) in blocks().items():
        if args.write:
            status |= generated_block.replace(page, _begin(name), _end(name), block, "docs_figures")
        else:
            print(block)
    return status


if __name__ == "__main__":
    sys.exit(main())
