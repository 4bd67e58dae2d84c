"""Gradient clipping on 2 devices and 2 workers equals clipping on one device.

Upstream Keras 3 clips each replica's part of the gradient before the all-reduce under
Mirrored/MultiWorkerMirroredStrategy; the fix ``keras_tf_clip_after_all_reduce`` clips the
all-reduced gradient once. ``tests/scripts/clip_job.py`` trains every variant (no
clipping, ``global_clipnorm``, ``clipnorm``, ``clipvalue``, accumulation, loss scaling,
weight decay with a moving average, eager) in one process and prints the weights.
"""

from __future__ import annotations

import json

import pytest

from tfdist import compat
from tfdist.compat import clipping

from conftest import SCRIPTS, equivalence, last_json_line, launch_cli, popen_python

SCRIPT = str(SCRIPTS / "clip_job.py")
TOL = 1e-5
CLIPPED = ("global_clipnorm", "clipnorm", "clipvalue")
WORKER_VARIANTS = ("none", *CLIPPED, "accumulate", "loss_scale")
# Under a hand-built MirroredStrategy (the same class tfdist.scope() builds): the idioms.
HAND_BUILT = ("none", *CLIPPED, "loss_scale")


def run_job(*argv: str, **env) -> dict:
    return run_jobs((list(argv), env))[0]


def run_jobs(*jobs: tuple[list[str], dict]) -> list[dict]:
    """Several clip_job.py runs ``(argv, env)`` side by side (most of each is TF's import)."""
    procs = [popen_python(str(SCRIPT), *argv, **env) for argv, env in jobs]
    try:
        outputs = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, f"{out[-3000:]}\n{err[-5000:]}"
    return [last_json_line(out) for out, _ in outputs]


def max_diff(a, b) -> float:
    return equivalence.max_difference(a, b)


def check_mirrored(result: dict) -> None:
    """The fix applied, and the job trained on a MirroredStrategy of 2 replicas."""
    assert clipping.KERAS_TF_CLIP_AFTER_ALL_REDUCE in result["applied"]
    topology = (result["replicas"], result["strategy"])
    assert topology == (2, "MirroredStrategy"), topology


def check_weights(result: dict, one_device: dict, what: str) -> None:
    """Every variant the job trained equals one device's within ``TOL``."""
    weights = result["weights"]
    diffs = {variant: max_diff(w, one_device[variant]) for variant, w in weights.items()}
    equivalence.assert_within(diffs, TOL, what)


@pytest.fixture(scope="module")
def one_device() -> dict:
    """Every variant's weights on one device: what the other topologies must reproduce."""
    result = run_job(TFDIST_CPU_DEVICES="1")
    assert result["replicas"] == 1
    weights = result["weights"]
    # Clipping did something: each limit changes the weights of the same optimizer unclipped.
    assert max_diff(weights["global_clipnorm"], weights["none"]) > 1e-3
    return weights


# ------------------------------------------------------------------ unit


def test_the_fix_is_registered_and_patches_the_keras_optimizer():
    import keras

    assert clipping.KERAS_TF_CLIP_AFTER_ALL_REDUCE in compat.fix_names()
    assert clipping.KERAS_TF_CLIP_AFTER_ALL_REDUCE in compat.apply_all()
    patched = keras.optimizers.Optimizer._backend_apply_gradients
    assert patched.__tfdist_fix__ == clipping.KERAS_TF_CLIP_AFTER_ALL_REDUCE
    (fix,) = clipping.FIXES
    assert "keras.src.optimizers.optimizer:Optimizer._backend_apply_gradients" in {
        target.entry for target in fix.targets
    }


def test_no_strategy_one_replica_and_no_clipping_keep_upstreams_code():
    import keras
    import tensorflow as tf

    clips = clipping.clips_per_replica_upstream
    adam = keras.optimizers.Adam
    one = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert not clips(adam(global_clipnorm=1.0))  # no strategy
    assert not one.run(lambda: clips(adam(global_clipnorm=1.0)))  # one replica
    # Clipping as upstream's _clip_gradients reads it: a limit of 0 clips nothing.
    for limit in ("clipnorm", "global_clipnorm", "clipvalue"):
        assert clipping._clipping(adam(**{limit: 1.0}))
        assert not clipping._clipping(adam(**{limit: 0.0}))
    assert not clipping._clipping(adam())


# ------------------------------------------------------------------ equivalence


@pytest.mark.devices
@pytest.mark.slow
def test_two_devices_clip_as_one_device_under_tfdist_and_a_hand_built_strategy(one_device):
    # One strategy per process: two in one process can collide in their collective keys.
    tfdist_scope, hand_built = run_jobs(
        ([], {"TFDIST_CPU_DEVICES": "2"}),
        (["--scope", "mirrored", "--variants", ",".join(HAND_BUILT)], {"TFDIST_CPU_DEVICES": "2"}),
    )
    assert set(tfdist_scope["weights"]) == set(one_device)  # every variant
    assert set(hand_built["weights"]) == set(HAND_BUILT)
    for result in (tfdist_scope, hand_built):
        check_mirrored(result)
        check_weights(result, one_device, result["strategy"])


@pytest.mark.devices
@pytest.mark.slow
@pytest.mark.upstream_failure("keras_tf_clip_after_all_reduce")
def test_upstream_clips_each_replicas_gradient(one_device):
    result = run_job(
        "--variants",
        ",".join(("none", *CLIPPED)),
        TFDIST_CPU_DEVICES="2",
        TFDIST_COMPAT_EXCLUDE=clipping.KERAS_TF_CLIP_AFTER_ALL_REDUCE,
    )
    assert (
        clipping.KERAS_TF_CLIP_AFTER_ALL_REDUCE not in result["applied"] and result["replicas"] == 2
    )
    weights = result["weights"]
    diffs = {variant: max_diff(w, one_device[variant]) for variant, w in weights.items()}
    assert diffs["none"] < TOL, diffs  # without clipping upstream is right
    # When this fails, upstream clips the global gradient: retire keras_tf_clip_after_all_reduce.
    assert all(diffs[variant] > 1e-4 for variant in CLIPPED), diffs


@pytest.mark.multiworker
@pytest.mark.slow
def test_two_workers_clip_as_one_device(one_device):
    proc = launch_cli("-n", "2", SCRIPT, "--variants", ",".join(WORKER_VARIANTS), timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    results = {}
    for line in proc.stdout.splitlines():
        prefix, _, rest = line.partition(" ")
        if rest.startswith("{"):
            results[prefix] = json.loads(rest)
    assert set(results) == {"[w0]", "[w1]"}
    for prefix, result in results.items():
        assert (
            result["worker"] == int(prefix[2])
            and clipping.KERAS_TF_CLIP_AFTER_ALL_REDUCE in result["applied"]
        )
        assert result["strategy"] == "CollectiveAllReduceStrategy" and result["replicas"] == 2
        weights = result["weights"]
        diffs = {variant: max_diff(weights[variant], one_device[variant]) for variant in weights}
        assert set(diffs) == set(WORKER_VARIANTS), (prefix, diffs)
        equivalence.assert_within(diffs, TOL, prefix)
