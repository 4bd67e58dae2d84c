"""``pipeline(global_batch=N)``: sized for the whole job, checked against the data axis of a
distribution entered later (a ModelParallel mesh has fewer replicas than devices)."""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from tfdist.data import checks

from conftest import last_json_line, run_python

DATA = np.arange(64, dtype="float32").reshape(32, 2)


def test_exactly_one_batch_size_is_required():
    for kwargs in ({}, {"per_replica_batch": 4, "global_batch": 8}):
        with pytest.raises(ValueError, match=r"pass exactly one of per_replica_batch= and"):
            tfdist.data.pipeline(DATA, **kwargs)
    with pytest.raises(ValueError, match=r"global_batch must be a positive int.*Received"):
        tfdist.data.pipeline(DATA, global_batch=0)


def test_global_batch_sizes_the_batches():
    train = tfdist.data.pipeline(DATA, global_batch=8, shuffle=None)
    assert [int(b.shape[0]) for b in train] == [8, 8, 8, 8]


def test_a_global_batch_the_replicas_cannot_divide_is_refused_with_what_divides_it():
    """What an elastic job that restarts on 3 workers with a global batch of 32 is told
    (tfdist.data.pipeline checks it against the replicas of the group it runs on)."""
    with pytest.raises(ValueError) as refused:
        checks.global_batch(32, 3)
    assert str(refused.value) == (
        "pipeline: global_batch must divide evenly between the 3 replicas. Received: "
        "global_batch=32. Pass a multiple of 3, e.g. 30. A job resumed from a checkpoint "
        "on another number of replicas (an elastic job that lost or got back a node) "
        "trains the same model only with the same global batch: run it on a number of "
        "replicas that divides 32 (1, 2, 4, 8, 16, 32), e.g. bound Ray's "
        "ScalingConfig(num_workers=(min, max)) to such counts."
    )
    assert checks.global_batch(24, 3) == 24


# Built before a 2x2 ModelParallel scope (DataParallel over 4 devices is in effect then),
# entered after: global_batch keeps its size; per_replica_batch counted 4 replicas.
_MESH_SCRIPT = """
import json, logging
import numpy as np
import keras
import tfdist
from keras import distribution as kd

warnings = []
class Catch(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("tfdist").addHandler(Catch())

data = np.zeros((64, 2), "float32")
by_global = tfdist.data.pipeline(data, global_batch=16, shuffle=None)
by_replica = tfdist.data.pipeline(data, per_replica_batch=4, shuffle=None)
mesh = kd.DeviceMesh((2, 2), ["batch", "model"], devices=kd.list_devices())
layout = kd.LayoutMap(mesh)
with tfdist.scope(layout_map=layout):
    replicas = tfdist.num_replicas()
try:
    bad = tfdist.data.pipeline(data, global_batch=7, shuffle=None)
    error = None
except ValueError as err:
    error = str(err)
print(json.dumps({
    "replicas": replicas,
    "global": int(next(iter(by_global)).shape[0]),
    "per_replica": int(next(iter(by_replica)).shape[0]),
    "warnings": [w for w in warnings if "tfdist.scope" in w],
    "error": error,
}))
"""


@pytest.mark.jax
@pytest.mark.devices
def test_a_model_parallel_scope_checks_pipelines_built_before_it():
    result = last_json_line(
        run_python(_MESH_SCRIPT, KERAS_BACKEND="jax", TFDIST_CPU_DEVICES="4").stdout
    )
    assert result["replicas"] == 2
    assert result["global"] == 16  # what was asked, on any mesh
    assert result["per_replica"] == 16  # 4 x 4 devices, not 4 x 2 data replicas
    assert result["warnings"] == [
        "tfdist.scope: a pipeline built for 4 replicas has global batch 16 (4 per replica); "
        "this distribution has 2 data-parallel replicas, so each gets 8 examples, not 4. "
        "Build the pipeline inside the scope, or size it with pipeline(..., global_batch=N)."
    ]
    assert result["error"].startswith(
        "pipeline: global_batch must divide evenly between the 2 replicas. Received: "
        "global_batch=7. Pass a multiple of 2, e.g. 6."
    )
