"""Sharded checkpoints in one process on 4 CPU devices; prints one JSON line.

Run with ``KERAS_BACKEND=jax TFDIST_CPU_DEVICES=4``. A model with Dropout whose first
layer is sharded over the ``model`` axis trains on a 2x2 mesh with
``tfdist.callbacks.checkpoint(dir, sharded=True)`` and is stopped after step 13. Copies
of that directory are then resumed by ``make_or_restore`` on a 2x2, a 4x1 and a 1x4
mesh (the global batch unchanged) and trained to the end; the weights are compared with
an uninterrupted run. Then: a damaged newest checkpoint falls back to the previous one; a
model of another width is refused; every restore here builds the Sequential model again
in this process, so its variable paths differ from the saved ones (keras#23251's case).
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import keras
import numpy as np
from keras import distribution as kd

import tfdist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by runpy too
import builders  # noqa: E402
import equivalence  # noqa: E402

EPOCHS, GLOBAL_BATCH, EXAMPLES = 2, 32, 256  # 8 steps an epoch, 16 in all
rng = np.random.default_rng(0)
x = rng.normal(size=(EXAMPLES, 6)).astype("float32")
y = rng.integers(0, 3, EXAMPLES)
train = tfdist.data.pipeline((x, y), global_batch=GLOBAL_BATCH, shuffle=EXAMPLES, seed=3)
root = tempfile.mkdtemp(prefix="sharded-job-")


def layout_map(shape):
    devices = kd.list_devices()[: shape[0] * shape[1]]
    mesh = kd.DeviceMesh(shape, ["batch", "model"], devices=devices)
    layouts = kd.LayoutMap(mesh)
    layouts[".*dense_one/kernel"] = (None, "model")
    layouts[".*dense_one/bias"] = ("model",)
    return layouts


def build(width=16):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(width, activation="relu", name="dense_one"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(3, name="dense_two"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def fit(directory, shape=(2, 2), stop=None, max_to_keep=5, build_fn=build):
    with tfdist.scope(layout_map=layout_map(shape)):
        model, initial_epoch = tfdist.make_or_restore(build_fn, directory)
    resumed = tfdist.resume_state(model)
    kernel = model.get_layer("dense_one").kernel.value
    placed = {
        "mesh": list(kernel.sharding.mesh.devices.shape),
        "spec": str(kernel.sharding.spec),
        "devices": len(kernel.sharding.device_set),
    }
    callback = tfdist.callbacks.checkpoint(
        directory, save_freq=5, max_to_keep=max_to_keep, sharded=True
    )
    try:
        callbacks = [callback] + ([builders.StopAfter(stop)] if stop else [])
        model.fit(train, epochs=EPOCHS, initial_epoch=initial_epoch, callbacks=callbacks, verbose=0)
    except KeyboardInterrupt:
        callback.wait()  # the write under way finishes, as it would before a kill -9 here
    step = None if resumed is None else resumed.step
    return model, step, placed


def diff(a, b):
    return equivalence.max_difference(a.get_weights(), b.get_weights())


def names(directory):
    return sorted(os.listdir(directory))


out = {}
reference, _, _ = fit(os.path.join(root, "reference"), max_to_keep=2)
out["reference_kept"] = names(os.path.join(root, "reference"))

stopped = os.path.join(root, "stopped")
fit(stopped, stop=13)
out["stopped"] = names(stopped)
# What each process wrote: Orbax's per-process shard stores.
out["process_stores"] = sorted(
    n for n in os.listdir(os.path.join(stopped, "ckpt-2-2.orbax", "state")) if "process" in n
)


def compressors(checkpoint):
    """The compressors the saved arrays' zarr metadata names (read through OCDBT)."""
    import tensorstore as ts

    spec = {"driver": "ocdbt", "base": "file://" + os.path.join(checkpoint, "state")}
    store = ts.KvStore.open(spec).result()
    keys = [key.decode() for key in store.list().result() if key.endswith(b".zarray")]
    return sorted({str(json.loads(store.read(key).result().value)["compressor"]) for key in keys})


def writer_nice():
    """The nice values of tensorstore's pool threads in this process, after the saves."""
    values = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "ts_pool_worker":
                    values.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except OSError:  # the thread ended after listdir (seen on jax 0.12)
            continue
    return sorted(values)


# The threads first: reading the metadata through tensorstore starts pool threads of its own.
out["writer"] = {"nice": writer_nice()}
out["writer"]["compressors"] = compressors(os.path.join(stopped, "ckpt-2-2.orbax"))

out["resumed"] = {}
for shape in [(2, 2), (4, 1), (1, 4)]:
    copy = os.path.join(root, "on-{}x{}".format(*shape))
    shutil.copytree(stopped, copy)
    model, step, placed = fit(copy, shape)
    out["resumed"]["{}x{}".format(*shape)] = dict(placed, step=step, diff=diff(model, reference))

# A damaged newest checkpoint: every data file of ckpt-2-2 cut to half its size.
damaged = os.path.join(root, "damaged")
shutil.copytree(stopped, damaged)
builders.cut_data_files_in_half(os.path.join(damaged, "ckpt-2-2.orbax"))
model, step, _ = fit(damaged)
out["damaged"] = {"step": step, "diff": diff(model, reference), "names": names(damaged)}

# Another architecture: refused, nothing moved.
other = os.path.join(root, "other")
shutil.copytree(stopped, other)
try:
    fit(other, build_fn=lambda: build(width=8))
    out["other"] = None
except ValueError as err:
    out["other"] = {"error": str(err), "names": names(other)}

shutil.rmtree(root)
print(json.dumps(out), flush=True)
sys.exit(0)
