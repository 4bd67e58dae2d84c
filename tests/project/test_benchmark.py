"""tools/bench/suite.py: every row reports a ratio with its range (no timing is asserted).

Every row's reporting runs on sample figures; two rows run end to end with ``--quick``
(the whole quick suite took ~245 s, most of it starting processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, child_env, last_json_line, run_python, tool_module


def test_unknown_row_is_an_error_naming_the_choices():
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--only", "nope"],
        capture_output=True, text=True, timeout=60, env=child_env(), cwd=REPO,
    )  # fmt: skip
    assert (
        proc.returncode == 2
        and "unknown name(s) ['nope']" in proc.stderr
        and "'cli'" in proc.stderr
    )


def _summary(a: list[float], b: list[float]) -> dict:
    """The harness's summary of alternated runs (what the launcher's rows return)."""
    return tool_module("bench.harness").summary(a, b)


def _sample_figures() -> dict:
    """What each row's benchmark module returns, in miniature (no measuring)."""
    two = {"a": [1.2, 1.4], "b": [1.0, 1.0]}
    checkpoint = {
        "state_mb": 50.1, "file_mb": 50.3, "step_s": 0.2,
        "save": {"ratios": [1.1, 1.2], "ratio_median": 1.15, "a_s": [1.1, 1.2], "b_s": [1.0, 1.0]},
        "restore": {"ratios": [1.0, 1.3], "ratio_median": 1.15, "a_s": [1.0, 1.3],
                    "b_s": [1.0, 1.0]},
    }  # fmt: skip
    return {
        "overhead": {"ratios": [1.0, 1.02, 1.5, 1.01], "a_epoch_s": [5.0, 5.1, 7.5, 5.05],
                     "b_epoch_s": [5.0] * 4, "replicas": 2, "steps_per_epoch": 117, "repeats": 2},
        "pipeline": {"naive_wall_s": [20.0, 21.0], "pipeline_wall_s": [2.5, 2.8], "epochs": 10,
                     "pipeline_examples_per_s": 230000, "naive_examples_per_s": 30000},
        "input-bound": {"input_bound_ratio": 1.02, "pipeline_step_ms": 10.2,
                        "in_memory_step_ms": 10.0, "rounds": 3, "input_bound_ratio_cpu": 1.01},
        "time-to-accuracy": {"summary": {"ratios_by_round": [0.4, 0.5], "recipes": {
            "fast": {"train_s": [40.0, 50.0], "test_accuracy": [0.993], "all_reach_0.99": True},
            "tutorial": {"train_s": [100.0, 100.0], "test_accuracy": [0.991]}}}},
        "restart": {"resumed_to_first_step_s": [5.5, 6.0], "fresh_to_first_step_s": [5.0, 5.0],
                    "batches_applied_twice": 0, "steps_recomputed_goal_met": True,
                    "killed_after_step": 7, "save_freq": 5, "steps_recomputed": 2,
                    "batches_skipped": 0, "restart_extra_s": 0.4},
        "launcher": _summary(**two),
        "multi-worker-step": _summary(**two),
        "multi-worker-step-k8": {**_summary([1.1, 1.15], [1.0, 1.0]), "steps_per_execution": 8},
        "multi-worker-accumulation": {**_summary([1.1, 1.15], [1.0, 1.0]), "accumulation_steps": 4, "steps": 420,
                                      "warmup": 20, "goal_ratio": 1.2},
        "multi-worker-accumulation-k8": {**_summary([1.1, 1.15], [1.0, 1.0]), "accumulation_steps": 4,
                                         "steps": 424, "warmup": 24, "goal_ratio": 1.2,
                                         "steps_per_execution": 8},
        "partial-batch-cost": {"configs": {"2 workers, 1 output": {
            "a_ms": [20.5, 21.0], "b_ms": [20.0, 20.0], "ratios": [1.025, 1.05],
            "max_abs_weight_diff": 0.0, "weights_equal": True, "timed_steps": 237,
            "steps_per_epoch": 80}}},
        "checkpoint-save": checkpoint,
        "checkpoint-restore": checkpoint,
    }  # fmt: skip


def test_every_row_turns_its_figures_into_a_ratio_with_its_range():
    bench = tool_module("bench.suite")
    samples = _sample_figures()
    names = [c.name for c in bench.COMPARISONS]
    assert names == [*bench.CHILD_ROWS, "cli"] and set(samples) == set(bench.CHILD_ROWS)
    for quick in (False, True):
        rows = []
        for comp in bench.COMPARISONS[:-1]:
            res = bench.CHILD_ROWS[comp.name].result(samples[comp.name], quick)
            assert res.ratios and all(r > 0 for r in res.ratios), comp.name
            rows.append((comp, res, None))
        table = bench.format_table(bench.machine(), rows)
        for comp, res, _ in rows:
            assert f"| {comp.name} | {comp.a} | {comp.b} | {res.median:.3g} (" in table
    accumulation = bench.CHILD_ROWS["multi-worker-accumulation"].result
    assert accumulation(samples["multi-worker-accumulation"], False).met is True  # 1.125 <= 1.2
    slow = {**samples["multi-worker-accumulation"], **_summary([1.5, 1.6], [1.0, 1.0])}
    assert accumulation(slow, False).met is False
    step = bench.CHILD_ROWS["multi-worker-step-k8"].result
    assert step(samples["multi-worker-step-k8"], False).met is True  # 1.125 <= 1.2 with K=8
    assert (
        bench.CHILD_ROWS["multi-worker-step"].result(samples["multi-worker-step"], False).met
        is None
    )
    assert "steps_per_execution=8" in step(samples["multi-worker-step-k8"], False).notes
    # Rows of ~1 s measurements report the median of each group of repeated pairs.
    launcher = {**_summary([1.0, 3.0, 1.2, 1.1], [1.0] * 4), "repeats": 2}
    assert bench.CHILD_ROWS["launcher"].result(launcher, False).ratios == [2.0, 1.15]
    overhead = bench.CHILD_ROWS["overhead"].result(samples["overhead"], False)
    assert overhead.ratios == [1.01, 1.255] and overhead.met is False
    partial = bench.CHILD_ROWS["partial-batch-cost"].result
    assert partial(samples["partial-batch-cost"], False).met is True  # 1.0375 <= 1.05
    differ = samples["partial-batch-cost"]["configs"]["2 workers, 1 output"]
    differ = {"configs": {"2 workers, 1 output": {**differ, "weights_equal": False}}}
    assert partial(differ, True).met is False and "a bug" in partial(differ, True).notes


def test_runs_in_a_row_are_combined_and_judged_stable_within_15_percent(tmp_path):
    figures = tool_module("docs.figures")
    mach = tool_module("bench.suite").machine()

    def run(ratios):
        rows = [
            {
                "name": "save",
                "a": "A",
                "b": "B",
                "goal": "<= 1.2",
                "met": True,
                "median": sorted(ratios)[1],
                "ratios": ratios,
            }
        ]
        return {"machine": mach, "quick": False, "pairs": 3, "rows": rows}  # fmt: skip

    steady, jumpy = run([1.0, 1.1, 1.14]), run([0.8, 1.0, 1.05])  # 0.8 is 20 % off
    paths = []
    for i, payload in enumerate([steady, steady, jumpy]):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(payload))
    runs = figures.combine_runs(paths)["runs"]
    assert runs == [steady, steady, jumpy]
    row = figures.runs_block(runs)[-1]
    assert row.startswith("| save | 1.1 (1-1.14, n=3) | 1.1 (1-1.14, n=3) | 1 (0.8-1.05, n=3) |")
    assert row.endswith("| **no** (9%, 9%, 20%) | yes/yes/yes |")
    assert figures.runs_block(runs[:2])[-1].endswith("| yes (9%, 9%) | yes/yes |")
    other = {**steady, "rows": [{**steady["rows"][0], "name": "restore"}]}
    paths[-1].write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"the same rows.*--only"):
        figures.combine_runs(paths)


def test_what_steps_per_execution_saves_per_step_is_rendered_from_both_rows():
    figures = tool_module("docs.figures")

    def row(name, a, b):
        return {"name": name, "a_values": a, "b_values": b, "value_unit": "ms/step"}

    rows = [row("multi-worker-step", [30.0, 28.0, 29.0], [17.0, 18.0, 16.0])]
    assert figures._per_execution_savings(rows) == []  # no K = 8 row: nothing to say
    rows.append(row("multi-worker-step-k8", [21.0, 20.0, 22.0], [14.0, 13.0, 15.0]))
    (line,) = figures._per_execution_savings(rows)
    assert line.startswith("- multi-worker-step, K = 1 minus K = 8: 8.0 ms/step on 2 workers, ")
    assert "3.0 on 2 devices" in line
    rows[-1] = {**rows[-1], "error": "RuntimeError: broken"}  # a failed row is left out
    assert figures._per_execution_savings(rows) == []


def test_accumulation_rounds_to_whole_windows_and_validates():
    ba = tool_module("bench.accumulation")
    assert ba.window_steps(420, 20) == (420, 20) and ba.window_steps(30, 5) == (32, 8)
    with pytest.raises(ValueError, match=r"Received: steps=0, warmup=4"):
        ba.window_steps(0, 4)


@pytest.mark.slow
@pytest.mark.mnist
def test_quick_rows_run_end_to_end_and_write_the_same_figures_as_json(tmp_path):
    # Two real rows: one in this process (cli), one in a child process (checkpoint-save);
    # every other row's reporting is checked on sample figures above.
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--quick", "--json", str(out),
         "--only", "cli", "--only", "checkpoint-save"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=child_env(PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [row["name"] for row in figures["rows"]] == ["checkpoint-save", "cli"]
    for row in figures["rows"]:
        assert row["error"] is None, row
        assert row["ratios"] and all(r > 0 for r in row["ratios"]), row
        # the table shows the same median as the JSON
        assert f"| {row['name']} |" in proc.stdout and f"{row['median']:.3g}" in proc.stdout
    assert figures["machine"]["cores"] == os.cpu_count()
    assert proc.stdout.startswith("machine: ")


def test_scaling_rows_are_efficiency_against_one_worker_one_device():
    bs = tool_module("bench.scaling")
    rows = bs.table_rows("jax", {"1x1": [100.0, 120.0], "2x1": [50.0, 70.0], "4x2": [30.0]}, 128)
    assert [(r["workers"], r["devices_per_worker"], r["replicas"]) for r in rows] == [
        (1, 1, 1), (2, 1, 2), (4, 2, 8),
    ]  # fmt: skip
    assert [round(r["efficiency"], 3) for r in rows] == [1.0, 0.545, 0.273]
    assert rows[0]["ms_per_step"] == pytest.approx(1000 * 128 / 110)


def test_scaling_rounds_alternate_their_order():
    bs = tool_module("bench.scaling")
    order = []
    runs = {name: (lambda n=name: order.append(n) or 1.0) for name in ("a", "b", "c")}
    assert bs.rounds_of(runs, 2) == {"a": [1.0, 1.0], "b": [1.0, 1.0], "c": [1.0, 1.0]}
    assert order == ["a", "b", "c", "c", "b", "a"]


def test_scaling_commands_use_the_launcher_and_logical_devices():
    bs = tool_module("bench.scaling")
    cmd, env = bs.command("tensorflow", 1, 2, ["--steps", "5"])
    assert cmd[-2:] == ["--steps", "5"]
    assert cmd[1].endswith("mw_bench_job.py") and env["TFDIST_CPU_DEVICES"] == "2"
    cmd, env = bs.command("jax", 4, 2, [])
    assert cmd[2:8] == ["tfdist", "launch", "-n", "4", "--devices-per-worker", "2"]
    assert cmd[-1].endswith("jax_bench_job.py") and env["KERAS_BACKEND"] == "jax"
    assert "TFDIST_CPU_DEVICES" not in env


def test_step_breakdown_explains_the_step_from_its_parts():
    sb = tool_module("bench.step_breakdown")
    ms = {"input": 1.0, "compute": 5.0, "allreduce": 4.0, "step": 8.0, "fit": 11.0,
          "fit_accuracy": 12.5}  # fmt: skip
    assert sb.derived(ms) == {
        "input": 1.0, "compute_without_input": 4.0, "exposed_allreduce": 3.0,
        "python_callbacks": 3.0, "fit": 11.0, "metrics": 1.5,
    }  # fmt: skip
    table = sb.format_table(
        {"workers": ms, "devices": {k: v / 2 for k, v in ms.items()}, "pairs": 1, "rounds": 1,
         "calls": 2, "global_batch": 128}
    )  # fmt: skip
    assert (
        "| fit | 11.00 | 5.50 | 2.00 |" in table
        and "| exposed_allreduce | 3.00 | 1.50 | +1.50 |" in table
    )


def test_logical_devices_are_timed_against_one_device_round_by_round(monkeypatch):
    # docs/benchmarks.md, "Goals not met": what tools/bench/logical_devices.py renders.
    bl = tool_module("bench.logical_devices")
    order = []

    def run_config(name, batch, steps, warmup):  # the second round runs at half the speed
        order.append(name)
        slower = 2.0 if len(order) > len(bl.CONFIGS) else 1.0
        return {"1 device": 50.0, "2 devices": 100.0}.get(name, 60.0) * slower

    monkeypatch.setattr(bl, "run_config", run_config)
    payload = bl.measure(batch=256, rounds=2, steps=20, warmup=5)
    assert order == [*bl.CONFIGS, *reversed(bl.CONFIGS)]  # alternated rounds
    text = bl.report(payload)
    assert "ms per step of 256 images (median of 15 steps" in text
    # each ratio against one device of the same round (pairing across rounds gives 1 or 4)
    assert "\n2 devices: 150.0 ms (100.0-200.0), x2.00 (2.00-2.00, n=2)" in text
    assert "\n1 device, own loop: 90.0 ms (60.0-120.0), x1.20 (1.20-1.20, n=2)" in text
    env = bl.config_env("2 devices, 1 intra-op thread", {"TFDIST_ALLREDUCE": "ring", "A": "1"})
    assert env["TFDIST_CPU_DEVICES"] == "2" and env["TF_NUM_INTRAOP_THREADS"] == "1"
    assert "TFDIST_ALLREDUCE" not in env and env["A"] == "1"
    assert bl.config_env("1 device", {})["TFDIST_CPU_DEVICES"] == "1"


def test_partial_batch_cost_alternates_fresh_runs_and_compares_their_weights(monkeypatch, tmp_path):
    # docs/benchmarks.md, "What full batches pay for the partial-batch fixes".
    import numpy as np

    pbc = tool_module("bench.partial_batch_cost")
    order = []

    def run_config(name, side, model, examples, epochs, weights):
        order.append((name, side))
        # the first pair's A of 2 outputs (after the warm-up pair and 1 output's pair)
        # trains differently: reported, not hidden
        off = 1e-3 if len(order) == 5 else 0.0
        np.savez(weights, np.full((2, 2), 0.5 + off, np.float32))
        ms = 20.0 if side == "upstream" else 21.0
        return {"ms_per_step": ms, "mean_ms_per_step": ms, "timed_steps": 237,
                "steps_per_epoch": 80,
                "replica_all_reduces_traced": {"fixes": 2.0, "upstream": 1.0}[side]}  # fmt: skip

    monkeypatch.setattr(pbc, "run_config", run_config)
    names = ("2 workers, 1 output", "2 workers, 2 outputs")
    payload = pbc.measure(pairs=2, examples=1280, epochs=2, configs=names)
    warm, a, b = ("2 workers, 1 output", "fixes"), "fixes", "upstream"
    assert order == [warm, (names[0], b)] + [(n, s) for n in names for s in (a, b)] + [
        (n, s) for n in names for s in (b, a)
    ]  # fmt: skip
    one, two = (payload["configs"][n] for n in names)
    assert one["ratios"] == [1.05, 1.05] and one["weights_equal"] is True
    assert len(one["a_mean_ms"]) == len(one["b_mean_ms"]) == 2  # not the warm-up's
    assert two["weights_equal"] is False and two["max_abs_weight_diff"] > 1e-6
    text = pbc.report(payload).splitlines()
    assert text[1] == (
        "2 workers, 1 output (1 scalar all-reduce(s) more a step): fixes on 21.0 ms, off "
        "20.0 ms: +1.0 ms a step, A/B 1.05 (1.05-1.05, n=2), A slower in 2 of 2 pairs; weights "
        "A = B (largest |A - B| 0)"
    )
    assert "**weights A != B" in text[2] and "a bug**" in text[2]
    assert pbc._env("upstream", "workers")["TFDIST_COMPAT_EXCLUDE"] == pbc.EXCLUDE
    assert "TFDIST_CPU_DEVICES" not in pbc._env("upstream", "workers")
    assert pbc._env("fixes", "devices")["TFDIST_CPU_DEVICES"] == "2"
    assert "TFDIST_COMPAT_EXCLUDE" not in pbc._env("fixes", "devices")
    with pytest.raises(ValueError, match=r"Received: .*examples=1000"):
        pbc.measure(examples=1000)  # not full batches only


@pytest.mark.slow
@pytest.mark.multiworker
def test_partial_batch_cost_sides_train_weights_equal_bit_for_bit():
    """docs/benchmarks.md: A's and B's final weights are equal bit for bit on every line.
    The benchmark's own measure() (tools/bench/partial_batch_cost.py) at small size: one
    pair of fresh processes a line (the fixes on, the three off), 2 full batches of 128,
    2 epochs, no warm-up pair. run_config checks each side applied what it should."""
    pbc = tool_module("bench.partial_batch_cost")
    payload = pbc.measure(pairs=1, examples=2 * pbc.GLOBAL_BATCH, epochs=2, warmup=False)
    assert sorted(payload["configs"]) == sorted(pbc.CONFIGS)
    for name, line in payload["configs"].items():
        assert line["max_abs_weight_diff"] == 0.0, (name, line["max_abs_weight_diff"])
        assert line["a_all_reduces_traced"] == line["b_all_reduces_traced"], (name, line)


def test_bench_comm_names_its_variants():
    bc = tool_module("bench.comm")
    with pytest.raises(ValueError, match=r"unknown variant. Received: name='x'"):
        bc.measure("x")
    assert {"ring", "pack-64k", "pack-256k"} <= set(bc.VARIANTS)


_KERAS_ITERATORS = """
import json
import keras, numpy as np, tensorflow as tf

made, seen = [], []
original = tf.data.Dataset.__iter__
def counted(self):
    made.append(1)
    return original(self)
tf.data.Dataset.__iter__ = counted

def dataset():
    ds = tf.data.Dataset.range(8).shuffle(8, seed=1)
    return ds

def record(x):
    seen.append(int(x))
    return x
ds = dataset().map(lambda x: tf.py_function(record, [x], tf.int64)).map(
    lambda x: (tf.reshape(tf.cast(x, tf.float32), (1,)), tf.reshape(tf.cast(x, tf.float32), (1,))))
model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(ds.batch(8), epochs=3, verbose=0)
fit_orders = [seen[i * 8:(i + 1) * 8] for i in range(3)]
made_by_fit = len(made)
fresh = dataset()
orders = [[int(x) for x in fresh] for _ in range(6)]
print(json.dumps({"made": made_by_fit, "fit": fit_orders, "fresh": orders}))
"""


def test_keras_makes_two_iterators_per_epoch_and_the_unused_one_takes_a_shuffle_order():
    # docs/benchmarks.md, "The first step of an epoch": what tools/bench/epoch_start.py
    # counts, and why tfdist does not remove the unused iterator.
    result = last_json_line(run_python(_KERAS_ITERATORS, timeout=240).stdout)
    assert result["made"] == 6  # 3 epochs, two each
    assert result["fit"] == [result["fresh"][0], result["fresh"][2], result["fresh"][4]]
    assert result["fresh"][1] != result["fresh"][2]  # so the unused order is skipped
