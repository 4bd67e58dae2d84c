"""Every JAX check of tfdist.backends.layouts on a 2x2 mesh, in one process; prints one JSON line.

Run with ``KERAS_BACKEND=jax TFDIST_CPU_DEVICES=4``: a typo'd LayoutMap key (refused when
the scope exits, and at ``fit`` for a model built there), the opt-out, ``describe`` of a
sharded kernel, ``estimate_memory`` against the bytes the devices hold, and (when
``keras_hub`` is installed) a tiny Gemma backbone with its own ``get_layout_map``.
"""

import json

import keras
import numpy as np
from keras import distribution as kd

import tfdist

out = {}


def build():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="dense_one")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="dense_two")(hidden))


def layout(key="dense_one/kernel"):
    mesh = kd.DeviceMesh((2, 2), ["batch", "model"], devices=kd.list_devices())
    layout_map = kd.LayoutMap(mesh)
    layout_map[key] = (None, "model")
    return layout_map


def error_of(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def typo_at_exit():
    with tfdist.scope(layout_map=layout("dense_one/kernal")):
        build()


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense_one = keras.layers.Dense(4, name="dense_one")

    def call(self, x):
        return self.dense_one(x)


def typo_at_fit():
    with tfdist.scope(layout_map=layout("dense_one/kernal")):
        model = Subclassed()  # no Input: built by fit, after the scope
        model.compile("sgd", "mse")  # its metric variables are no build
    model.fit(np.zeros((8, 8), "float32"), np.zeros((8, 4), "float32"), batch_size=4, verbose=0)


def device_bytes(variables):
    """Bytes each device holds of ``variables``, measured from the arrays' shards."""
    per_device = {}
    for variable in variables:
        for shard in variable.value.addressable_shards:
            per_device[str(shard.device)] = per_device.get(str(shard.device), 0) + shard.data.nbytes
    return per_device


out["typo_error"] = error_of(typo_at_exit)
out["typo_error_at_fit"] = error_of(typo_at_fit)

with tfdist.scope(layout_map=layout("dense_one/kernal"), allow_unmatched_keys=True):
    opted_out = build()
out["opt_out_spec"] = str(opted_out.get_layer("dense_one").kernel.value.sharding.spec)

with tfdist.scope(layout_map=layout()):
    model = build()
    model.compile(keras.optimizers.Adam(1e-3), "mse")
model.optimizer.build(model.trainable_variables)
report = tfdist.describe(model, replicated_warning_bytes=32)
out["describe_rows"] = report.rows
out["describe_text"] = report.text
out["describe_warnings"] = report.warnings
measured = device_bytes(model.variables + model.optimizer.variables)
estimate = tfdist.estimate_memory(build, layout_map=layout(), optimizer="adam")
out["measured_per_device"] = measured
out["estimate"] = {
    "parameters": estimate.parameters,
    "optimizer_state": estimate.optimizer_state,
    "gradients": estimate.gradients,
    "slots": estimate.slots_per_weight,
    "abstract": estimate.abstract,
    "fits_1k": estimate.fits(1024),
    "fits_1m": estimate.fits(2**20),
    "text": str(estimate),
}

try:
    import keras_hub
except ImportError:
    keras_hub = None
if keras_hub is not None:

    def gemma():
        return keras_hub.models.GemmaBackbone(
            vocabulary_size=64,
            num_layers=2,
            num_query_heads=2,
            num_key_value_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            head_dim=8,
        )

    mesh = kd.DeviceMesh((2, 2), ["batch", "model"], devices=kd.list_devices())
    gemma_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    with tfdist.scope(layout_map=gemma_map):
        backbone = gemma()
    gemma_report = tfdist.describe(backbone)
    gemma_estimate = tfdist.estimate_memory(gemma, layout_map=gemma_map, optimizer="sgd")
    out["gemma"] = {
        "keys": list(gemma_map),
        "text": gemma_report.text,
        "rows": gemma_report.rows,
        "measured": device_bytes(backbone.variables),
        "estimate_parameters": gemma_estimate.parameters,
    }

print(json.dumps(out, default=str))
