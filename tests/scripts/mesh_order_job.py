"""Which meshes ``tfdist.scope`` accepts under 2 processes x 2 devices; one JSON line each.

Keras feeds process p the p-th slice of every global batch, so process p's devices must
hold exactly those rows of the batch axis. Tried: the 2x2 mesh over
``keras.distribution.list_devices()`` (accepted), the same devices in column order (the
batch rows split inside each process: refused), the batch axis second (refused), and 1x4
(the batch axis 1: every process feeds the whole batch; accepted).

    tfdist launch -n 2 --devices-per-worker 2 mesh_order_job.py
"""

import json

import numpy as np
from keras import distribution as kd

import tfdist


def attempt(shape, names, devices):
    mesh = kd.DeviceMesh(shape, names, devices=devices)
    layouts = kd.LayoutMap(mesh)
    layouts[".*kernel"] = (None, "model")
    try:
        with tfdist.scope(layout_map=layouts, batch_dim_name="batch", allow_unmatched_keys=True):
            pass
    except tfdist.ConfigError as err:
        return str(err)
    return "accepted"


listed = kd.list_devices()
by_column = np.array(listed).reshape(2, 2).T.reshape(-1).tolist()
print(
    json.dumps(
        {
            "listed": attempt((2, 2), ["batch", "model"], listed),
            "by_column": attempt((2, 2), ["batch", "model"], by_column),
            "batch_second": attempt((2, 2), ["model", "batch"], listed),
            "model_only": attempt((1, 4), ["batch", "model"], listed),
        }
    ),
    flush=True,
)
