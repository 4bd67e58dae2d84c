"""docs/corpus.md's table: the Keras examples' shapes (tests/corpus/), run unchanged.

``tests/e2e/test_corpus.py`` runs every corpus script on one device and distributed, checks
each cell against one device, and, with ``TFDIST_CORPUS_JSON=tools/results/corpus.json``,
writes what it found there; this tool renders that file. ``EXPECTED`` below is the one list
of the cells that cannot equal one device (the test asserts they differ, or fail with the
message given), each with the property of the script that explains it (``PROPERTIES``).

    python -m tools.docs.corpus_table            # print the table
    python -m tools.docs.corpus_table --write    # replace it in docs/corpus.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools import generated_block

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "tools" / "results" / "corpus.json"
PAGE = REPO / "docs" / "corpus.md"
BEGIN, END = "<!-- corpus table: begin -->", "<!-- corpus table: end -->"

BACKENDS = ("tensorflow", "jax")
TOPOLOGIES = ("2 devices", "2 workers")
TOLERANCE = 1e-5  # the largest difference from one device that counts as equal

PROPERTIES = {
    "dropout_per_replica": "each replica draws its own Dropout mask for its part of the batch",
    "unsynchronized_batchnorm": (
        "each replica normalises with the statistics of its own part of the batch"
    ),
    "random_draws_per_replica": (
        "the keras.random draws of an own train_step (the VAE's sampling, the GAN's latent "
        "vectors and label noise) are drawn per replica, for its part of the batch"
    ),
    "augmentation_drawn_per_process": (
        "the random augmentation layers of the tf.data map draw for each process's own "
        "part of the batch, not for the global batch one device draws for"
    ),
    "batch_wide_sum": "ops.tensordot over the batch axis sums each replica's part only",
    "loop_outside_replica_context": (
        "a GradientTape loop that never calls strategy.run steps outside any replica, while "
        "the job's strategy holds the variables"
    ),
}

# (script, backend or "*", topology or "*") -> ("differs", [property, ...]) or
# ("error", property, a regular expression the error's text matches)
EXPECTED = {
    ("mnist_convnet", "tensorflow", "*"): ("differs", ["dropout_per_replica"]),
    ("image_augmentation", "tensorflow", "*"): ("differs", ["unsynchronized_batchnorm"]),
    ("image_augmentation", "jax", "2 workers"): ("differs", ["augmentation_drawn_per_process"]),
    ("vae", "tensorflow", "*"): ("differs", ["random_draws_per_replica"]),
    ("gan", "tensorflow", "*"): ("differs", ["random_draws_per_replica"]),
    ("tensordot_model", "tensorflow", "*"): ("differs", ["batch_wide_sum"]),
    ("custom_loop", "tensorflow", "*"): (
        "error",
        "loop_outside_replica_context",
        r"DistributedVariable\.handle is not available outside the replica context",
    ),
}


def expected(script: str, backend: str, topology: str):
    """The expectation for one cell, or None (equal to one device)."""
    for key in ((script, backend, topology), (script, backend, "*"), (script, "*", topology)):
        if key in EXPECTED:
            return EXPECTED[key]
    return EXPECTED.get((script, "*", "*"))


def verdict(worst: dict[str, float], expectation) -> str:
    """The cell's text in the JSON and the table, from the worst difference of each part
    (weights, history, outputs) and the cell's expectation."""
    if expectation is not None and expectation[0] == "error":
        return f"error: {expectation[1]}"
    if expectation is None:
        return f"equal (worst {max(worst.values()):.1e})"
    parts = ", ".join(f"{part} {value:.1e}" for part, value in worst.items())
    return f"differs ({parts}): {', '.join(expectation[1])}"


def _cell(cells: dict, script: str, backend: str, topology: str, tensorflow_only: set) -> str:
    if backend != "tensorflow" and script in tensorflow_only:
        return "TensorFlow only"
    found = cells.get((script, backend, topology))
    if found is None:
        return "not run"
    replicas = ", ".join(str(n) for n in found["replicas"]) or "-"
    return f"{found['verdict']}; replicas {replicas}"


def markdown(results: dict | None = None) -> str:
    results = json.loads(RESULTS.read_text()) if results is None else results
    cells = {(c["script"], c["backend"], c["topology"]): c for c in results["cells"]}
    tensorflow_only = set(results["tensorflow_only"])
    columns = [(b, t) for b in BACKENDS for t in TOPOLOGIES]
    names = {"tensorflow": "TensorFlow", "jax": "JAX"}
    rows = [
        BEGIN,
        "| script | " + " | ".join(f"{names[b]}: {t}" for b, t in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for script in results["scripts"]:
        row = [_cell(cells, script, b, t, tensorflow_only) for b, t in columns]
        rows.append(f"| `{script}.py` | " + " | ".join(row) + " |")
    rows.append("")
    rows.append(
        f"Equal: weights, logged history and outputs within {TOLERANCE:g} of one device's "
        f"(the worst difference shown; for a difference, each part's); replicas: what each "
        f"process's models trained on. "
        f"Measured with {results['versions']}"
        + "".join(
            f"; {names[b]} on {m['machine']}, Python {m['python']}, {m['date']}"
            for b, m in sorted(results.get("measured_by_backend", {}).items())
        )
        + "."
    )
    rows.append("")
    used = sorted({p for e in EXPECTED.values() for p in ([e[1]] if e[0] == "error" else e[1])})
    rows.extend(f"- `{name}`: {PROPERTIES[name]}" for name in used)
    rows.append(END)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/corpus.md")
    args = parser.parse_args(argv)
    table = markdown()
    if not args.write:
        print(table)
        return 0
    return generated_block.replace(PAGE, BEGIN, END, table, "corpus_table")


if __name__ == "__main__":
    sys.exit(main())
