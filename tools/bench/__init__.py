"""The benchmarks: tfdist against raw TensorFlow and Keras, measured side by side.

Run from the repository root. ``python -m tools.bench`` runs the table of A/B rows
(tools/bench/suite.py; ``--only NAME`` for some, ``--scaling`` for the scaling table);
each row is declared (``TABLE_ROWS``) by the module that measures it: overhead, pipeline,
recipes, restart, launcher, accumulation, partial_batch_cost, checkpoint. What they share
(the machine stamp, A/B alternation, the child environment, the JSON they write) is in
harness.py.

The experiments that are not a row of the table run alone, each writing its figures
(``--json``) to a file of tools/results/ that tools/docs/figures.py renders:

    python -m tools.bench.step_breakdown    # where a step's time goes
    python -m tools.bench.overlap           # all-reduce packs during the backward pass
    python -m tools.bench.comm              # communication options against the default
    python -m tools.bench.epoch_start       # the first step of an epoch
    python -m tools.bench.logical_devices   # 2 logical CPU devices against 1 device
    python -m tools.bench.sharded           # sharded checkpoints on JAX
    python -m tools.bench.recipe_seeds      # the recipes over several seeds
    python -m tools.bench.gpu               # one accelerator (KERAS_BACKEND=jax)
    python -m tools.bench.elastic           # an elastic re-form against a plain restart
"""
