"""One restartable training script, run unchanged everywhere (issue 11's "done means").

    python same_script.py CKPT_DIR [dp|mp]
    tfdist launch -n 2 --devices-per-worker 2 same_script.py CKPT_DIR

Model, ``tfdist.data.pipeline``, ``tfdist.make_or_restore`` and
``tfdist.callbacks.standard``, then ``tfdist.save`` and ``tfdist.load(in_scope=True)`` on
every worker. ``dp`` (default) distributes with ``tfdist.scope()``: one device, N logical
devices (TFDIST_CPU_DEVICES), N processes under ``tfdist launch``, on either Keras
backend. ``mp`` (JAX only) builds in a 2x2 ``ModelParallel`` (``tfdist.scope(layout_map=
...)``). The global batch is the same everywhere, so the final weights must be too.
Prints one JSON line.
"""

import json
import os
import sys

import equivalence
import numpy as np

import tfdist

GLOBAL_BATCH = 16
directory = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "dp"

import builders  # noqa: E402
import keras  # noqa: E402


def build_and_compile():
    return builders.dense_classifier(keras.optimizers.Adam(0.01))


def scope_options():
    if mode != "mp":
        return {}
    from keras import distribution as kd

    mesh = kd.DeviceMesh((2, 2), ["batch", "model"], devices=kd.list_devices())
    layout = kd.LayoutMap(mesh)
    layout["dense.*kernel"] = (None, "model")
    layout["dense.*bias"] = ("model",)
    return {"layout_map": layout}


rng = np.random.RandomState(0)
x = rng.rand(256, 8).astype("float32")
y = (x.sum(axis=1) * 4 / 8).astype("int64") % 4

with tfdist.scope(**scope_options()):
    per_replica = GLOBAL_BATCH // tfdist.num_replicas()
    train = tfdist.data.pipeline((x, y), per_replica, shuffle=256, seed=7)
    model, initial_epoch = tfdist.make_or_restore(build_and_compile, directory)
model.fit(
    train,
    epochs=3,
    initial_epoch=initial_epoch,
    verbose=0,
    callbacks=tfdist.callbacks.standard(
        directory, decay={0: 0.01, 2: 0.005}, save_freq=5, tensorboard=False, print_lr=False
    ),
)
path = tfdist.save(model, os.path.join(directory, "final.keras"))
with tfdist.scope(**scope_options()):
    loaded = tfdist.load(path, in_scope=True)
weights = model.get_weights()
print(
    json.dumps(
        {
            "backend": keras.backend.backend(),
            "mode": mode,
            "replicas": tfdist.num_replicas(),
            "workers": tfdist.num_workers(),
            "chief": tfdist.is_chief(),
            "steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
            "loaded_diff": equivalence.max_difference(weights, loaded.get_weights()),
            "weights": [w.tolist() for w in weights],
        }
    ),
    flush=True,
)
