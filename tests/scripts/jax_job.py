"""One training script for the JAX backend equivalence tests (run with KERAS_BACKEND=jax).

``python jax_job.py dp``: ``with tfdist.scope():`` (DataParallel over every device of the
job); ``python jax_job.py mp``: a 2x2 ModelParallel with the regex LayoutMap keys of
Keras's distribution guide. The same global batches and seed everywhere; ``fit`` is
called after the scope, as TensorFlow scripts do. Prints one JSON line.
"""

import json
import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from keras import distribution as kd

import tfdist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import builders  # noqa: E402

GLOBAL_BATCH = 32


def build():
    return builders.dense_classifier(keras.optimizers.SGD(0.1))


def layout_map():
    mesh = kd.DeviceMesh((2, 2), ["batch", "model"], devices=kd.list_devices())
    layout = kd.LayoutMap(mesh)
    layout["dense.*kernel"] = (None, "model")
    layout["dense.*bias"] = ("model",)
    return layout


mode = sys.argv[1] if len(sys.argv) > 1 else "dp"
rng = np.random.RandomState(0)
x = rng.rand(256, 8).astype("float32")
y = (x.sum(axis=1) * 4 / 8).astype("int64") % 4
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

options = {"layout_map": layout_map()} if mode == "mp" else {}
with tfdist.scope(**options):
    model = build()
history = model.fit(data, epochs=3, verbose=0)
kernel = model.get_layer("dense_1").kernel
print(
    json.dumps(
        {
            "mode": mode,
            "replicas": tfdist.num_replicas(),
            "workers": tfdist.num_workers(),
            "chief": tfdist.is_chief(),
            "kernel_sharding": str(getattr(kernel.value.sharding, "spec", "single device")),
            "loss": [float(v) for v in history.history["loss"]],
            "weights": [w.tolist() for w in model.get_weights()],
        }
    )
)
