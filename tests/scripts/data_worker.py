"""One worker of the multi-worker input-pipeline checks: prints, as JSON, the example ids
this worker's replicas received at every step of every epoch.

The examples are the ids 0..N-1, written by the test as int64 features in TFRecord
files (one file, like tfds MNIST, and several files). Run one process per worker, each
with its TF_CONFIG (see tests/data/test_data.py):

    python data_worker.py --one-file ids.tfrecord --files a.tfrecord b.tfrecord c.tfrecord
"""

import argparse
import json

import tensorflow as tf

import tfdist
from tfdist import data

parser = argparse.ArgumentParser()
parser.add_argument("--one-file", required=True)
parser.add_argument("--files", nargs="+", required=True)
parser.add_argument("--per-replica", type=int, default=8)
args = parser.parse_args()

strategy = tfdist.strategy()


def parse(record):
    return tf.io.parse_single_example(record, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"]


def ids_from(files):
    return tf.data.TFRecordDataset(files).map(parse)


def epoch_ids(dataset):
    """Ids per step seen by this worker's replicas, in replica order."""
    steps = []
    for batch in strategy.experimental_distribute_dataset(dataset):
        parts = strategy.experimental_local_results(batch)
        steps.append([int(v) for part in parts for v in part.numpy()])
    return steps


@tf.function
def count_step(batch):
    # A real collective per step, as in training: a worker with no data left for a step
    # (partial last batch, uneven files) must still join it, or the others hang.
    def replica_fn(ids):
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce("sum", tf.shape(ids, out_type=tf.int64)[0])

    return strategy.run(replica_fn, args=(batch,))


def counted_steps(dataset):
    return [
        int(strategy.experimental_local_results(count_step(batch))[0])
        for batch in strategy.experimental_distribute_dataset(dataset)
    ]


result = {"replicas": strategy.num_replicas_in_sync}
one_file = ids_from([args.one_file])

# Seeded, one file (DATA sharding): epoch k's order from (seed, k); positions skip.
seeded = data.pipeline(one_file, args.per_replica, seed=7, shuffle=1000, drop_remainder=False)
result["seeded"] = [epoch_ids(seeded) for _ in range(2)]
data.set_position(0, 2)
result["seeded_skip"] = [epoch_ids(seeded)]
data.set_position(0)
result["seeded_counts"] = counted_steps(seeded)

# Unseeded and shuffled, one file: the workers must still shuffle alike.
unseeded = data.pipeline(one_file, args.per_replica, shuffle=1000, drop_remainder=False)
result["unseeded"] = [epoch_ids(unseeded) for _ in range(2)]

# Unseeded, several files (FILE sharding, streamed): the files need not split evenly
# between the workers, so one runs out of data before the other.
by_file = data.pipeline(
    ids_from(args.files), args.per_replica, shuffle=1000, cache=False, drop_remainder=False
)
result["by_file"] = [epoch_ids(by_file)]
result["by_file_counts"] = counted_steps(by_file)
print(json.dumps(result))
