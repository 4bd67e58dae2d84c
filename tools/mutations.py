"""Breaks the code on purpose, one named mutation at a time, and runs the tests that should notice.

Each mutation replaces one exact piece of source text; the tests named beside it run
(``python -m pytest -n 0``); the file is restored whatever happens. A mutation is
``caught`` when those tests fail, ``NOT CAUGHT`` when they pass. The table is the
evidence that the suite can fail where it matters.

    python tools/mutations.py              # every mutation
    python tools/mutations.py --list       # their names
    python tools/mutations.py check_nothing_equal warm_excepthook

It edits the working tree in place (restored after each mutation) and refuses to run when
a file it would mutate has uncommitted changes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    before: str
    after: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "check_nothing_equal",
        "tfdist/check/verdict.py",
        "    if weights.reason == NOTHING:\n",
        "    if False:\n",
        ("tests/check/test_check.py::test_a_comparison_of_no_variable_is_never_equal_and_exits_2",),
    ),
    Mutation(
        "check_process_0_only",
        "tfdist/check/verdict.py",
        "    for rank, result in sorted(run.ranks.items()):",
        "    for rank, result in sorted(run.ranks.items())[:1]:",
        ("tests/check/test_check.py::test_every_process_is_compared_and_the_worst_one_is_named",),
    ),
    Mutation(
        "check_ignores_replicas",
        "tfdist/check/verdict.py",
        "    elif verdict.replicas is not None and verdict.replicas < verdict.asked:",
        "    elif False:",
        (
            "tests/check/test_check.py::"
            "test_a_topology_that_trained_fewer_replicas_than_it_has_is_not_distributed_never_equal",
        ),
    ),
    Mutation(
        "warm_excepthook",
        "tests/warm_start.py",
        "        _uncaught(exc, traceback)",
        "        traceback.print_exc()",
        ("tests/project/test_warm_start.py::test_a_warm_job_ends_as_a_fresh_process_does",),
    ),
    Mutation(
        "dealing_known_files",
        "tfdist/core/batch_order.py",
        "    if workers == 1:\n        return True",
        "    if True:\n        return True",
        (
            "tests/compat/test_partial_batches.py::"
            "test_the_dealing_is_known_only_where_slices_go_to_workers_in_turn",
        ),
    ),
    Mutation(
        "unscoped_never_adopts",
        "tfdist/unscoped.py",
        "        if st.unscoped_default is None:\n            _adopt()",
        "        if False:\n            _adopt()",
        (
            "tests/e2e/test_corpus.py::"
            "test_every_example_trains_on_every_replica_and_equals_one_device_or_says_why",
        ),
    ),
    Mutation(
        "collective_keys_shared",
        "tfdist/compat/collective_keys.py",
        "            if earlier and upstream.tf_collective_key_base(self) == 0:",
        "            if False:",
        ("tests/compat/test_collective_keys.py",),
    ),
    Mutation(
        "custom_step_summed",
        "tfdist/compat/custom_train_step.py",
        "        if replicas > 1:\n            grads = [_divided(g, replicas) for g in grads]",
        "        if False:\n            grads = [_divided(g, replicas) for g in grads]",
        ("tests/compat/test_custom_train_step.py::test_examples_own_train_steps_equal_one_device",),
    ),
    Mutation(
        "exit_word_wrong_key",
        "tfdist/core/exit_hold.py",
        'upstream.tf_key_value_set(f"tfdist/exit/{self.rank}"',
        'upstream.tf_key_value_set(f"tfdist/exits/{self.rank}"',
        (
            "tests/core/test_exit_hold.py::"
            "test_tensorflow_peers_the_chief_reads_the_word_a_worker_writes",
            "tests/test_barrier.py::test_the_chief_leaves_because_a_worker_said_it_leaves",
        ),
    ),
    Mutation(
        "exit_word_waits_15_s",
        "tfdist/core/exit_hold.py",
        "TELL_S = 2.0 ",
        "TELL_S = 15.0 ",
        (
            "tests/core/test_exit_hold.py::"
            "test_a_worker_whose_word_hangs_leaves_after_its_2_s_bound",
        ),
    ),
    Mutation(
        "known_cut_wasted_all_reduce",
        "tfdist/compat/loss_weights.py",
        "    share = tf.cast(share, loss.dtype)\n",
        "    share = tf.cast(share, loss.dtype)\n"
        "    share += 0 * tf.distribute.get_replica_context().all_reduce('SUM', share)\n",
        (
            "tests/compat/test_no_harm.py::"
            "test_the_loss_fix_all_reduces_only_where_the_data_decides",
        ),
    ),
    Mutation(
        "full_batch_share_not_1",
        "tfdist/compat/loss_weights.py",
        "equal: upstream's is one device's\n                    return loss\n",
        "equal: upstream's is one device's\n                    return _shared(loss, 0.999)\n",
        (
            "tests/project/test_benchmark.py::"
            "test_partial_batch_cost_sides_train_weights_equal_bit_for_bit",
        ),
    ),
    Mutation(
        "jax_initialize_once_swapped",
        "tfdist/compat/jax_fixes.py",
        "return original(job_addresses, num_processes, process_id)",
        "return original(job_addresses, process_id, num_processes)",
        (
            "tests/compat/test_upstream_keras.py::"
            "test_keras_tests_fail_with_the_fixes_only_where_they_fail_without[jax]",
        ),
    ),
)


def _dirty(path: str) -> bool:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--", path], cwd=REPO, capture_output=True, text=True
    )
    return bool(out.stdout.strip())


def run(mutation: Mutation) -> tuple[str, float]:
    """``caught`` / ``NOT CAUGHT`` (or why it could not run) and the seconds it took."""
    target = REPO / mutation.path
    original = target.read_text()
    if original.count(mutation.before) != 1:
        return "stale: the text to mutate is not found once", 0.0
    started = time.monotonic()
    target.write_text(original.replace(mutation.before, mutation.after))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider"]
            + ["-o", "addopts=", *mutation.tests],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    finally:
        target.write_text(original)
    verdict = "caught" if proc.returncode == 1 else "NOT CAUGHT"
    if proc.returncode not in (0, 1):
        verdict = f"error (pytest exit {proc.returncode})"
    return verdict, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutations' names")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    if args.list:
        print("\n".join(known))
        return 0
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutations {unknown}; --list names them")
    chosen = [known[n] for n in args.names] or list(MUTATIONS)
    dirty = sorted({m.path for m in chosen if _dirty(m.path)})
    if dirty:
        parser.error(f"commit or stash your changes to {dirty} first")
    missed = 0
    for mutation in chosen:
        verdict, seconds = run(mutation)
        missed += verdict != "caught"
        print(f"{mutation.name:<30} {verdict:<12} {seconds:6.1f} s", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
