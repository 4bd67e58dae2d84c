"""One process of the JAX input-pipeline checks: prints, as JSON, the example ids this
process receives at every step, after Keras's own per-process sharding (what ``fit``
feeds it).

Run in one process (``TFDIST_CPU_DEVICES=4``) or as ``tfdist launch -n 2
--devices-per-worker 2`` with ``KERAS_BACKEND=jax`` (see tests/data/test_data_jax.py).
Each process seeds TensorFlow's global generator differently, so an unseeded pipeline
is the same on every process only if the processes agree on its seed.
"""

import json

import numpy as np
import tensorflow as tf

import tfdist
from tfdist import data

EXAMPLES = 64
ids = np.arange(EXAMPLES, dtype=np.int64)

with tfdist.scope() as distribution:
    tf.random.set_seed(1000 + tfdist.worker_index())
    seeded = data.pipeline(ids, 2, seed=7)
    unseeded = data.pipeline(ids, 2)
    streamed = data.pipeline(tf.data.Dataset.from_tensor_slices(ids), 2, cache=False, shuffle=16)
    evaluation = data.pipeline(ids, 2, shuffle=None)


def epoch(dataset):
    """The ids this process gets at each step of one epoch (what fit iterates)."""
    fed = distribution.distribute_dataset(dataset)
    return [[int(v) for v in batch.numpy()] for batch in fed]


result = {
    "process": tfdist.worker_index(),
    "processes": tfdist.num_workers(),
    "global_batch": tfdist.global_batch_size(2),
    "declared": int(distribution.distribute_dataset(seeded).cardinality()),
    "seeded": [epoch(seeded) for _ in range(2)],
    "unseeded": [epoch(unseeded) for _ in range(2)],
    "streamed": [epoch(streamed)],
    "evaluation": [epoch(evaluation)],
}
data.set_position(1, 3)  # a resumed job: epoch 1 from its 4th batch, then epoch 2 in full
result["resumed"] = [epoch(seeded) for _ in range(2)]
print(json.dumps(result))
