"""A broken script: ``model.predict`` on the chief only, while the other worker finishes.

Upstream, the chief's collective waits for a peer that never joins, then fails with
TensorFlow's "The tasks have crashed" and a traceback. Under tfdist the worker ends with
one line that names the lost worker and the every-worker rule.
"""

import keras
import numpy as np

import tfdist

with tfdist.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.zeros((64, 4), "float32")
model.fit(x, np.zeros((64, 1), "float32"), batch_size=16, epochs=1, verbose=0)
if tfdist.is_chief():
    model.predict(x, batch_size=16, verbose=0)  # broken: worker 1 never calls it
print("END", tfdist.worker_index(), flush=True)
