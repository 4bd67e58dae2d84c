"""Communication and step options, each measured against the default in alternating pairs.

Every variant runs tests/scripts/mw_bench_job.py (the 269k-parameter MLP, global batch 128,
or ``--model convnet``) with one option changed, paired with a run of the defaults (A B A
B ..., the order inside a pair alternating, after one unrecorded warm-up pair), either as
2 workers (``tfdist launch -n 2``) or as 2 logical devices in one process. It reports the
median ms/step ratio variant/default with its range: below 1 means the option helps.

    python -m tools.bench.comm                    # every variant, 3 pairs
    python -m tools.bench.comm --pairs 1 --only pack-64k --json figures.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

from tools.bench import harness
from tools.bench import launcher as bench_launcher

# name -> (where, job flags). "workers": tfdist launch -n 2; "devices": 2 logical devices.
VARIANTS = {
    "ring": ("workers", ["--implementation", "ring"]),
    "pack-64k": ("workers", ["--bytes-per-pack", str(64 * 1024)]),
    "pack-256k": ("workers", ["--bytes-per-pack", str(256 * 1024)]),
    # On a GPU machine add ("nccl", ["--implementation", "nccl"]). steps_per_execution
    # and jit_compile are not variants (see tools/bench/step_breakdown.py); mw_bench_job.py
    # still takes their flags.
}


def _runner(where: str, base: list[str], flags: list[str]):
    run = bench_launcher.launched if where == "workers" else bench_launcher.one_process

    def once() -> float:
        _, report = run([*base, *flags])
        return report["ms_per_step"]

    return once


def measure(name: str, *, pairs: int = 3, steps: int = 64, model: str = "mlp") -> dict:
    """Ratio variant / default in ms per step, over ``pairs`` alternated pairs.

    Example:
        >>> measure("pack-64k", pairs=1)["ratio_median"]  # doctest: +SKIP
        1.01
    """
    if name not in VARIANTS:
        raise ValueError(f"bench_comm: unknown variant. Received: name={name!r}; {list(VARIANTS)}")
    where, flags = VARIANTS[name]
    base = ["--steps", str(steps), "--warmup", "16", "--model", model]
    a, b = harness.alternate(_runner(where, base, flags), _runner(where, base, []), pairs)
    result = harness.summary(a, b)
    result.update(name=name, where=where, flags=flags, model=model, unit="ms/step")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--model", choices=("mlp", "convnet"), default="mlp")
    parser.add_argument("--only", action="append", choices=sorted(VARIANTS))
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    figures = []
    for name in args.only or list(VARIANTS):
        try:
            f = measure(name, pairs=args.pairs, steps=args.steps, model=args.model)
        except RuntimeError as err:  # a variant that fails on this machine
            last = [line for line in str(err).splitlines() if "Error" in line][-1:]
            print(f"{name:14s} failed: {last}", flush=True)
            figures.append({"name": name, "error": str(err)[-2000:]})
            continue
        figures.append(f)
        print(
            f"{name:14s} {f['where']:8s} variant/default {f['ratio_median']:.3f} "
            f"({f['ratio_min']:.3f}-{f['ratio_max']:.3f}, n={len(f['ratios'])}); "
            f"{statistics.median(f['a']):.1f} vs {statistics.median(f['b']):.1f} ms/step",
            flush=True,
        )
    if args.json:
        harness.write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
