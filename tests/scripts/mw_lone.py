"""Creates tf.distribute.MultiWorkerMirroredStrategy() from TF_CONFIG and reports it.

Used by tests/compat/test_compat.py: started as one worker of a two-worker TF_CONFIG whose
other worker never starts, it shows whether start-up waits forever (upstream) or
fails with a clear error (tfdist's ``tf_multi_worker_timeouts`` fix).

Prints ``READY <replicas>`` or ``ERROR <type> <message>`` (exit code 3).
"""

import sys

import tensorflow as tf

try:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
except Exception as err:  # noqa: BLE001 - the test reads the message
    print("ERROR", type(err).__name__, str(err).replace("\n", " "), flush=True)
    sys.exit(3)
print("READY", strategy.num_replicas_in_sync, flush=True)
