"""A ``PyDataset`` or a generator into ``fit`` on TensorFlow: the user's arrays stay as
they are on several replicas (the ``keras_tf_generator_batches_copied`` fix).

``tf.data.Dataset.from_generator`` (what Keras builds from both) keeps a yielded numpy
array's memory as the tensor's when it starts on a 64-byte boundary; under a strategy with
2 replicas the first replica's slice of each batch is then written over in place by the
step (the loss's ``y_true - y_pred``), so the script's label array changes and the next
epoch, and any later ``fit``, trains on it. ``tests/scripts/aligned_inputs_job.py`` puts
the idioms' arrays on that boundary, so this happens on every run instead of on some.
"""

from __future__ import annotations

import functools
import json

import pytest

from conftest import SCRIPTS, equivalence, launch_cli, run_python

JOB = SCRIPTS / "aligned_inputs_job.py"
FIX = "keras_tf_generator_batches_copied"
TOLERANCE = 1e-5
TOPOLOGY = {
    "1 device": {"replicas": 1, "workers": 1},
    "2 devices": {"replicas": 2, "workers": 1},
    "2 workers": {"replicas": 2, "workers": 2},
}
# The first replica's half of each global batch of 16 (64 rows): what upstream overwrites.
FIRST_HALVES = [row for start in range(0, 64, 16) for row in range(start, start + 8)]


@functools.cache
def run(topology: str, exclude: str = "") -> dict:
    env = {"KERAS_BACKEND": "tensorflow", "TFDIST_COMPAT_EXCLUDE": exclude}
    if topology == "2 workers":
        proc = launch_cli("-n", "2", str(JOB), timeout=600, **env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        stdout = proc.stdout
    else:
        if topology == "2 devices":
            env["TFDIST_CPU_DEVICES"] = "2"
        stdout = run_python(
            f"import runpy; runpy.run_path({str(JOB)!r}, run_name='__main__')", timeout=300, **env
        ).stdout
    line = next(line for line in stdout.splitlines() if "ALIGNED " in line)
    result = json.loads(line[line.index("ALIGNED ") + len("ALIGNED ") :])
    got = {key: result["topology"][key] for key in ("replicas", "workers")}
    assert got == TOPOLOGY[topology], (topology, result["topology"])
    return result["idioms"]


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.multiworker
@pytest.mark.parametrize("topology", ["2 devices", "2 workers"])
def test_aligned_arrays_train_as_one_device_and_stay_unchanged(topology):
    one, cell = run("1 device"), run(topology)
    for idiom in ("pydataset", "generator"):
        assert one[idiom]["changed_rows"] == [], idiom
        assert cell[idiom]["changed_rows"] == [], idiom
        equivalence.assert_close(one[idiom]["values"], cell[idiom]["values"], TOLERANCE, idiom)


@pytest.mark.devices
@pytest.mark.upstream_failure("keras_tf_generator_batches_copied")
def test_upstream_overwrites_the_first_replicas_labels_on_two_devices():
    # tf_distribute_partial_batch_evenly's cut copies each slice (a gather), which keeps the
    # user's arrays apart from the step's tensors too: upstream's rebatch, which slices in
    # place, is what this shows, so both are excluded.
    one = run("1 device")
    upstream = run("2 devices", exclude=f"{FIX},tf_distribute_partial_batch_evenly")
    for idiom in ("pydataset", "generator"):
        assert upstream[idiom]["changed_rows"] == FIRST_HALVES, (idiom, upstream[idiom])
        # The first epoch trained on the true labels; the second on overwritten ones.
        loss_one, loss_upstream = one[idiom]["values"]["loss"], upstream[idiom]["values"]["loss"]
        equivalence.assert_close(loss_one[:1], loss_upstream[:1], TOLERANCE, idiom)
        equivalence.assert_differs(loss_one[1:], loss_upstream[1:], TOLERANCE, idiom)
