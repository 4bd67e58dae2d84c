"""ModelParallel layouts checked and shown (tfdist.backends.layouts): a LayoutMap key that matches no
variable is an error (upstream replicates silently), ``describe`` shows where each weight
lives, and ``estimate_memory`` equals the bytes the devices really hold."""

from __future__ import annotations

import pytest

from conftest import SCRIPTS, last_json_line, run_python

MESH = {"batch": 2, "model": 2}


@pytest.fixture(scope="module")
def jax_job() -> dict:
    """tests/scripts/layouts_job.py: every JAX case, one process on a 2x2 mesh of CPUs."""
    proc = run_python(
        f"import runpy; runpy.run_path({str(SCRIPTS / 'layouts_job.py')!r}, run_name='__main__')",
        timeout=240,
        KERAS_BACKEND="jax",
        TFDIST_CPU_DEVICES="4",
    )
    return last_json_line(proc.stdout)


def test_unmatched_keys_follow_keras_full_match_rule():
    from tfdist.backends.layouts import unmatched_keys

    paths = ["dense_one/kernel", "dense_one/bias", "dense_one/output"]
    assert unmatched_keys(["dense_one/kernal", ".*kernel", "dense", "(bad"], paths) == [
        "dense_one/kernal",
        "dense",  # a prefix is not a match: Keras uses re.fullmatch
        "(bad",
    ]
    assert unmatched_keys(["dense_one/output"], paths) == []  # output-tensor keys count


def test_shard_bytes_divide_by_the_mesh_axes_of_each_dimension():
    from tfdist.backends.layouts import shard_bytes

    assert shard_bytes((8, 16), "float32", (None, "model"), MESH) == 8 * 8 * 4
    assert shard_bytes((8, 16), "bfloat16", (("batch", "model"), None), MESH) == 2 * 16 * 2
    assert shard_bytes((5,), "float32", ("model",), MESH) == 3 * 4  # uneven: ceil
    assert shard_bytes((8, 16), "float32", (), MESH) == 8 * 16 * 4


def test_describe_and_estimate_memory_inputs_are_checked():
    import tfdist

    with pytest.raises(
        TypeError, match="Received: model=None. For the devices .* run `tfdist info`"
    ):
        tfdist.describe()

    with pytest.raises(TypeError, match="Received: model_or_builder=3"):
        tfdist.estimate_memory(3)
    with pytest.raises(ValueError, match=r"Received: mesh\['model'\]=0"):
        tfdist.estimate_memory(lambda: None, mesh={"model": 0})


@pytest.mark.jax
@pytest.mark.devices
@pytest.mark.slow
def test_a_typo_in_a_layout_map_key_names_the_key_and_the_nearest_path(jax_job):
    error = jax_job["typo_error"]
    assert error and "'dense_one/kernal'" in error
    assert "nearest variable paths ['dense_one/kernel'" in error
    assert "allow_unmatched_keys=True" in error
    # a model built by fit after the scope (no Input) is checked at its first batch
    assert "'subclassed/dense_one/kernel'" in (jax_job["typo_error_at_fit"] or "")
    # opted out: no error, and the key shards nothing (upstream's behaviour)
    assert jax_job["opt_out_spec"] == "P(None, None)"


@pytest.mark.jax
@pytest.mark.devices
@pytest.mark.slow
def test_describe_shows_the_sharded_kernel_at_half_its_bytes(jax_job):
    rows = {row["path"]: row for row in jax_job["describe_rows"]}
    kernel = rows["dense_one/kernel"]
    assert kernel["layout"] == "PartitionSpec(None, 'model')"
    assert kernel["bytes_per_device"] * 2 == kernel["bytes"] == 8 * 16 * 4
    assert not kernel["replicated"] and rows["dense_two/kernel"]["replicated"]
    assert "dense_one/kernel" in jax_job["describe_text"]
    # warned above the threshold (32 B here): the replicated ones only
    warned = {w.split(" ")[0] for w in jax_job["describe_warnings"]}
    assert warned == {"dense_two/kernel", "dense_one/bias"}


@pytest.mark.jax
@pytest.mark.devices
@pytest.mark.slow
def test_estimate_memory_equals_the_bytes_each_device_holds(jax_job):
    """Parameters + Adam state, estimated shapes-only, vs the shards' bytes (tolerance 1%:
    measured equal here, the margin is for optimizer scalars another version may add)."""
    est = jax_job["estimate"]
    measured = set(jax_job["measured_per_device"].values())
    assert len(measured) == 1 and len(jax_job["measured_per_device"]) == 4
    assert est["parameters"] + est["optimizer_state"] == pytest.approx(measured.pop(), rel=0.01)
    assert est["slots"] == 2 and est["abstract"] is True
    assert est["gradients"] == est["parameters"]  # every weight trainable
    assert (est["fits_1k"], est["fits_1m"]) == (False, True)


@pytest.mark.jax
@pytest.mark.devices
@pytest.mark.slow
def test_keras_hub_gemma_layout_map_is_checked_described_and_estimated(jax_job):
    assert "gemma" in jax_job, "keras_hub is missing: pip install -e '.[test]'"
    gemma = jax_job["gemma"]
    rows = {row["path"]: row for row in gemma["rows"]}
    assert rows["token_embedding/embeddings"]["layout"] == "PartitionSpec('model', 'batch')"
    assert rows["token_embedding/embeddings"]["bytes_per_device"] * 4 == 64 * 16 * 4
    assert set(gemma["measured"].values()) == {gemma["estimate_parameters"]}


_TF_DESCRIBE = """
import json, keras, tfdist
with tfdist.scope():
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(16, name="dense_one")(inputs))
report = tfdist.describe(model, replicated_warning_bytes=100)
print(json.dumps({"rows": report.rows, "warnings": report.warnings}))
"""


@pytest.mark.devices
def test_describe_on_tensorflow_shows_mirrored_variables_whole_on_each_replica():
    proc = run_python(_TF_DESCRIBE, timeout=180, KERAS_BACKEND="tensorflow", TFDIST_CPU_DEVICES="2")
    result = last_json_line(proc.stdout)
    kernel = result["rows"][0]
    assert kernel["layout"] == "mirrored x2"
    assert kernel["bytes_per_device"] == kernel["bytes"] == 8 * 16 * 4
    assert [w.split(" ")[0] for w in result["warnings"]] == ["dense_one/kernel"]


@pytest.mark.jax
@pytest.mark.multiworker
@pytest.mark.slow
def test_a_mesh_whose_batch_rows_do_not_follow_the_processes_is_refused():
    """Under 2 processes x 2 devices, Keras feeds process p the p-th half of each global
    batch: a 2x2 mesh over list_devices() and a 1x4 mesh are accepted; the same devices in
    column order, or the batch axis second, would put both halves on each process (measured
    before this check: trained weights 0.1 away from one process) and are refused."""
    from conftest import launch_cli

    proc = launch_cli(
        "-n", "2", "--devices-per-worker", "2", str(SCRIPTS / "mesh_order_job.py"),
        timeout=240, KERAS_BACKEND="jax",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for worker in ("w0", "w1"):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"[{worker}] {{"))
        result = last_json_line(line.partition(" ")[2])
        assert result["listed"] == "accepted" and result["model_only"] == "accepted"
        for case in ("by_column", "batch_second"):
            assert "process 0's devices hold rows [0, 1] of the batch axis 'batch'" in result[case]
            assert "Keras feeds process 0 the rows [0]" in result[case]
            assert "keras.distribution.list_devices() in its order" in result[case]
