"""tools/scaling_model.py: the ring cost, packing, efficiency, the 90% batch, the checks, the CLI.

Pure arithmetic: no TensorFlow, no timing assertions.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import REPO, child_env

TOOL = REPO / "tools" / "scaling_model.py"


def _load():
    spec = importlib.util.spec_from_file_location("scaling_model", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scaling_model"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


sm = _load()


def test_ring_cost_matches_a_hand_computed_value():
    link = sm.Link("test", 10.0, 5.0, "")  # 10 GB/s, 5 us per hop
    # 4 ranks, 100 MB, 2 packs: 2*3/4 * 1e8 / 1e10 = 15 ms; 2*3 hops * 2 packs * 5 us = 60 us
    assert sm.ring_allreduce_s(1e8, 4, link, packs=2) == pytest.approx(0.015 + 60e-6)
    assert sm.ring_allreduce_s(1e8, 1, link) == 0.0


def test_packing_lowers_the_latency_cost_monotonically():
    work = sm.RESNET101_P100
    cluster = sm.Cluster(16, 4, sm.PCIE3, sm.ROCE25)
    packs = [None, 2**20, 16 * 2**20, 64 * 2**20, 0]  # per tensor ... one pack
    costs = [sm.allreduce_s(work, replace(cluster, bytes_per_pack=b)) for b in packs]
    counts = [sm.pack_count(work, b) for b in packs]
    assert counts[0] == work.tensors and counts[-1] == 1
    assert all(a > b for a, b in zip(costs, costs[1:], strict=False))


def test_efficiency_is_one_on_one_device_and_falls_with_workers():
    work = sm.RESNET101_H100
    one = sm.predict(work, sm.Cluster(1, 1, sm.NVLINK4, sm.ROCE25), 64)
    assert one.efficiency == pytest.approx(1.0) and one.allreduce_ms == 0.0
    effs = [sm.predict(work, sm.Cluster(n, 1, sm.NVLINK4, sm.ROCE25), 64).efficiency
            for n in (1, 2, 4, 8, 16)]  # fmt: skip
    assert all(a > b for a, b in zip(effs, effs[1:], strict=False))


def test_larger_per_replica_batch_raises_efficiency():
    cluster = sm.Cluster(8, 8, sm.NVLINK4, sm.IB_EDR)
    effs = [sm.predict(sm.RESNET101_H100, cluster, b).efficiency for b in (16, 64, 256, 1024)]
    assert all(a < b for a, b in zip(effs, effs[1:], strict=False))


def test_overlap_hides_at_most_the_backward_pass():
    cluster = sm.Cluster(64, 8, sm.NVLINK4, sm.ROCE25, overlap=1.0)
    pred = sm.predict(sm.RESNET101_H100, cluster, 64)
    hidden = pred.allreduce_ms - pred.exposed_ms
    assert hidden == pytest.approx(pred.compute_ms * 2 / 3) and pred.exposed_ms > 0


@pytest.mark.parametrize("inter", [sm.ROCE25, sm.IB_EDR])
def test_the_90_percent_batch_is_the_smallest_that_reaches_90_percent(inter):
    work, cluster = sm.RESNET101_H100, sm.Cluster(16, 8, sm.NVLINK4, inter)
    batch = sm.batch_for_efficiency(work, cluster)
    assert batch is not None and batch > 1
    assert sm.predict(work, cluster, batch).efficiency >= 0.9
    assert sm.predict(work, cluster, batch - 1).efficiency < 0.9


def test_the_90_percent_batch_is_none_when_out_of_reach():
    assert sm.batch_for_efficiency(sm.MNIST_FAST_H100, sm.Cluster(64, 8, sm.NVLINK4, sm.ETH10),
                                   max_batch=64) is None  # fmt: skip


def test_horovod_resnet101_lands_within_5_points_of_the_published_90_percent():
    for gpus in (128, 512):
        check = sm.horovod_check(gpus)
        assert abs(check["efficiency"] - 0.90) <= 0.05, check
        # without overlap the model says clearly less: Horovod's overlap matters
        assert check["efficiency_without_overlap"] < check["efficiency"] - 0.05


def test_the_machine_check_predicts_every_measured_row():
    check = sm.machine_check(sm.load_measured())
    assert check["link"]["latency_us"] > 0
    rows = check["rows"]
    assert {row["workers"] for row in rows} >= {1, 2, 4}
    for row in rows:
        assert row["predicted_ms"] > 0
        if row["workers"] == 1 and row["measured_ms"] is not None:
            assert row["error_pct"] == pytest.approx(0.0, abs=1e-6)  # the baseline is compute


def test_measured_rows_come_from_the_file_given(tmp_path):
    data = sm.load_measured()
    data["runs"] = [data["runs"][0]]
    data["runs"][0]["rows"][1]["ms_per_step"] = 105.4  # 2 workers: 100 ms more than 1 process
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(data))
    link, estimates = sm.fit_loopback(sm.load_measured(path))
    assert len(estimates) == 1 and link.latency_us > 40_000


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: sm.ring_allreduce_s(1e6, 0, sm.ROCE25), ValueError),
        (lambda: sm.ring_allreduce_s(1e6, 2.0, sm.ROCE25), TypeError),
        (lambda: sm.predict(sm.RESNET101_H100, sm.Cluster(2, 1, sm.PCIE3, sm.ROCE25), 0),
         ValueError),
        (lambda: sm.predict(sm.RESNET101_H100,
                            sm.Cluster(2, 1, sm.PCIE3, sm.ROCE25, overlap=1.5), 8), ValueError),
        (lambda: sm.batch_for_efficiency(sm.RESNET101_H100,
                                         sm.Cluster(2, 1, sm.PCIE3, sm.ROCE25), target=1.0),
         ValueError),
        (lambda: sm.pack_count(sm.RESNET101_H100, -1), ValueError),
        (lambda: sm.horovod_check(510), ValueError),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_with_the_project_message(call, error):
    with pytest.raises(error, match=r"must be .*Received: "):
        call()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.scaling_model", *args],
        capture_output=True, text=True, timeout=120, env=child_env(), cwd=Path(REPO),
    )  # fmt: skip


def test_cli_prints_the_three_parts_and_json_parses():
    text = _cli()
    assert text.returncode == 0, text.stderr
    for part in ("## 1. This machine", "## 2. Horovod", "## 3. 8-512 GPUs", "| 512 |"):
        assert part in text.stdout
    out = _cli("--json")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert {r["gpus"] for r in figures["table"]} == {8, 16, 32, 64, 128, 256, 512}
    assert [h["gpus"] for h in figures["horovod"]] == [128, 512]


def test_the_gpu_workload_is_a_line_through_the_measured_rows():
    data = json.loads((REPO / "tools" / "results" / "gpu_measured.json").read_text())
    work = sm.gpu_workload(data)
    assert work.us_per_example > 0 and work.overhead_ms >= 0
    for row in data["rows"]:  # a straight line describes Keras fit on one GPU
        fitted = sm.compute_s(work, row["global_batch"]) * 1000
        assert fitted == pytest.approx(row["ms"]["none"], rel=0.15)
    with pytest.raises(ValueError, match=r"rows at two or more global batches. Received: "):
        sm.gpu_workload({**data, "rows": data["rows"][:1]})


def test_cli_with_gpu_rows_adds_their_table():
    text = _cli("--gpu", str(REPO / "tools" / "results" / "gpu_measured.json"))
    assert text.returncode == 0, text.stderr
    assert "## 4. Measured on one GPU" in text.stdout and "per-replica batch 1024" in text.stdout
