"""Start-up that does not depend on the script's order (tfdist.startup, tfdist.bootstrap).

The process is configured (logical devices, multi-worker collectives, fixes) just before
TensorFlow creates its context, whatever the script does first.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, SCRIPTS, child_env, equivalence, last_json_line, run_python


def run_fresh(code: str, **env):
    """``run_python`` in a fresh interpreter: how a process starts is what these test."""
    return run_python(code, warm=False, **env)


def test_import_tfdist_installs_hooks_without_importing_tensorflow():
    proc = run_fresh(
        """
        import sys, tfdist
        from tfdist import startup
        assert startup.installed()
        print("TF" if "tensorflow" in sys.modules else "NO-TF")
        """
    )
    assert proc.stdout.strip() == "NO-TF"


@pytest.mark.devices
def test_fixes_are_applied_when_their_package_is_imported():
    proc = run_fresh(
        """
        import json
        import tfdist
        from tfdist import compat
        before = compat.applied()
        import tensorflow  # imports Keras too
        applies = [fix.name for fix in compat.FIXES if fix.applies()]
        print(json.dumps([before, compat.applied(), applies]))
        """
    )
    before, after, applies = last_json_line(proc.stdout)
    assert before == [] and after == applies and "keras_tf_multi_worker_mean" in after


@pytest.mark.devices
def test_the_startup_hook_is_applied_like_a_fix_and_no_exclusion_removes_it():
    """tfdist's own hook on ``Context.ensure_initialized`` goes through
    ``fix_registry.apply_fix`` (guarded, recorded) like every fix; with every fix
    excluded it is still there, so the logical devices still apply."""
    proc = run_fresh(
        """
        import json
        import tfdist
        from tfdist import compat
        from tfdist.core import process
        import tensorflow as tf
        devices = len(tf.config.list_logical_devices("CPU"))
        print(json.dumps([process.state().applied_fixes, compat.applied(), devices]))
        """,
        TFDIST_CPU_DEVICES="2",
        TFDIST_COMPAT_EXCLUDE="all",
    )
    recorded, applied, devices = last_json_line(proc.stdout)
    assert recorded == ["tfdist_startup"] and applied == [] and devices == 2


@pytest.mark.devices
def test_a_tensorflow_op_before_the_scope_keeps_the_logical_devices():
    proc = run_fresh(
        """
        import tfdist
        import tensorflow as tf
        tf.constant(1.0)                     # TensorFlow starts before any strategy
        print(len(tf.config.list_logical_devices("CPU")), tfdist.num_replicas())
        """,
        TFDIST_CPU_DEVICES="2",
    )
    assert proc.stdout.split()[-2:] == ["2", "2"]


@pytest.mark.devices
def test_tensorflow_started_before_tfdist_was_imported_is_still_a_clear_error():
    proc = run_fresh(
        """
        import tensorflow as tf
        tf.constant(1.0)                     # too late: devices are fixed
        import tfdist
        try:
            tfdist.num_replicas()
        except RuntimeError as err:
            print("ERR", err)
        """,
        TFDIST_CPU_DEVICES="2",
    )
    assert "ERR" in proc.stdout and "already initialised its devices" in proc.stdout


def _tutorial(n_devices: int | None = None) -> dict:
    env = {"TFDIST_CPU_DEVICES": str(n_devices)} if n_devices else {}
    proc = run_fresh(
        f"import runpy; runpy.run_path({str(SCRIPTS / 'tutorial_order.py')!r}, "
        "run_name='__main__')",
        timeout=300,
        **env,
    )
    return last_json_line(proc.stdout)


def _assert_same_weights(a: dict, b: dict) -> None:
    equivalence.assert_close(a["weights"], b["weights"], 1e-5)


@pytest.mark.devices
@pytest.mark.slow
@pytest.mark.mnist
def test_tutorial_order_gives_the_same_weights_on_1_device_2_devices_and_2_workers():
    one = _tutorial()
    two = _tutorial(2)
    launched = subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", "-n", "2", str(SCRIPTS / "tutorial_order.py")],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-5000:]
    workers = [
        last_json_line(line.partition(" ")[2])
        for line in launched.stdout.splitlines()
        if line.startswith("[w") and '"replicas"' in line
    ]
    assert (one["replicas"], two["replicas"]) == (1, 2)
    assert [(w["replicas"], w["workers"]) for w in workers] == [(2, 2), (2, 2)]
    assert one["loss"][1] < one["loss"][0]  # it trained
    for other in (two, *workers):
        _assert_same_weights(one, other)


@pytest.mark.multiworker
@pytest.mark.slow
def test_a_hand_built_strategy_after_a_tensorflow_op_works_under_launch(tmp_path):
    """Upstream: 'Collective ops must be configured at program startup'. Under tfdist
    launch the worker's collectives are set up before the first op, and the script's own
    MultiWorkerMirroredStrategy shares them."""
    script = tmp_path / "by_hand.py"
    script.write_text(
        textwrap.dedent(
            """
            import json
            import numpy as np
            import tensorflow as tf
            x = np.random.RandomState(0).rand(256, 8).astype("float32")
            y = (x.sum(axis=1) > 4).astype("int64")
            ds = tf.data.Dataset.from_tensor_slices((x, y))   # TensorFlow starts first
            strategy = tf.distribute.MultiWorkerMirroredStrategy()
            import keras
            with strategy.scope():
                keras.utils.set_random_seed(1)
                model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
                model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(True))
            model.fit(ds.batch(64), epochs=1, verbose=0)
            print(json.dumps({"replicas": strategy.num_replicas_in_sync}))
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", "-n", "2", str(script)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count('{"replicas": 2}') == 2
