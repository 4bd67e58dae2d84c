"""A scaling model on paper: step time and efficiency of data-parallel training, N x G devices.

One step = compute(per-replica batch) + the part of the gradient all-reduce that the
backward pass does not hide. The all-reduce is a ring (Baidu's ring all-reduce, the
algorithm of NCCL and of TensorFlow's collective ops): each of P ranks sends and receives
2(P-1)/P of the gradient bytes over the slowest link, in 2(P-1) steps, and every pack of
gradients pays each step's per-hop latency once. Efficiency is the throughput on P devices
over P times the throughput on one, at the same per-replica batch: step(1) / step(P).

    python -m tools.scaling_model                        # the checks and the 8-512 GPU table
    python -m tools.scaling_model --json                 # the same figures as JSON
    python -m tools.scaling_model --measured rows.json   # this machine's rows from a file
    python -m tools.scaling_model --gpu tools/results/gpu_measured.json  # + the measured-GPU table

Every bandwidth, latency and compute figure below carries its source. Limits: the ring is
the only algorithm (NCCL switches to trees for small messages at scale, so the ring
over-states latency there); links run at their nominal rate (NCCL reaches ~80-90% of it);
compute scales linearly with the batch above a fixed per-step cost; no input pipeline,
no stragglers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path

from tfdist.core import validate  # (light: no TensorFlow)

MEASURED = Path(__file__).resolve().parent / "results" / "scaling_measured.json"
GPU_MEASURED = Path(__file__).resolve().parent / "results" / "gpu_measured.json"
NCCL_TUNING = "NCCL src/graph/tuning.cc hwLat, Ring/Simple"


@dataclass(frozen=True)
class Link:
    """One interconnect: bandwidth per direction (GB/s, 1e9 bytes) and latency per ring hop."""

    name: str
    gbytes_per_s: float
    latency_us: float
    source: str


@dataclass(frozen=True)
class Workload:
    """A model's gradients and its compute time on one device: overhead + batch x per-example."""

    name: str
    params: int
    tensors: int  # gradient tensors: the number of all-reduces without packing
    us_per_example: float
    source: str
    overhead_ms: float = 0.0  # per-step cost that does not grow with the batch
    bytes_per_param: int = 4  # fp32 gradients
    backward_fraction: float = 2 / 3  # backward ~ 2x forward: the part that can hide comm

    @property
    def gradient_bytes(self) -> int:
        return self.params * self.bytes_per_param


@dataclass(frozen=True)
class Cluster:
    """N workers x G devices; G on the intra link, the N workers on the inter link.

    ``bytes_per_pack``: 0 = all gradients in one pack (TensorFlow's default, see
    ``cross_device_utils.group_by_size``), None = one all-reduce per tensor, else packs of
    about that many bytes. ``overlap``: the fraction of the all-reduce that may run during
    the backward pass; 0 for TensorFlow's MultiWorkerMirroredStrategy, which all-reduces
    after the whole backward pass. ``host_cores``: set when every replica shares one host's
    CPU cores (this machine), so compute slows by max(1, replicas / cores).
    """

    workers: int
    devices: int
    intra: Link
    inter: Link
    hierarchical: bool = False
    bytes_per_pack: int | None = 0
    overlap: float = 0.0
    host_cores: int | None = None

    @property
    def replicas(self) -> int:
        return self.workers * self.devices


@dataclass(frozen=True)
class Prediction:
    """The model's figures for one (workload, cluster, per-replica batch)."""

    replicas: int
    per_replica_batch: int
    global_batch: int
    compute_ms: float
    allreduce_ms: float
    exposed_ms: float
    step_ms: float
    efficiency: float


def _gb(gbit: float) -> float:
    return gbit / 8


# Bandwidths are nominal, per direction; latencies per ring hop from NCCL's own cost model.
NVLINK4 = Link(
    "NVLink 4 (H100 SXM)", 450.0, 3.4,
    f"NVIDIA H100 datasheet: 900 GB/s per GPU, both directions; {NCCL_TUNING} NVLink 3.4 us",
)  # fmt: skip
PCIE3 = Link(
    "PCIe 3.0 x16", 15.75, 5.7,
    f"PCI-SIG PCIe 3.0: 8 GT/s x 16 lanes x 128/130 = 15.75 GB/s; {NCCL_TUNING} PCI 5.7 us",
)  # fmt: skip
ETH10 = Link(
    "10 GbE", _gb(10), 14.0, f"IEEE 802.3ae 10 Gb/s line rate; {NCCL_TUNING} NET 14 us (RDMA)"
)
ROCE25 = Link(
    "25 GbE RoCE", _gb(25), 14.0,
    f"IEEE 802.3by 25 Gb/s; the network of Horovod's benchmark; {NCCL_TUNING} NET 14 us",
)  # fmt: skip
IB_EDR = Link(
    "InfiniBand EDR 100 Gb/s", _gb(100), 14.0,
    f"InfiniBand Trade Association: EDR 4x = 100 Gb/s; {NCCL_TUNING} NET 14 us",
)  # fmt: skip
IB_HDR = Link(
    "InfiniBand HDR 200 Gb/s", _gb(200), 14.0,
    f"InfiniBand Trade Association: HDR 4x = 200 Gb/s; {NCCL_TUNING} NET 14 us",
)  # fmt: skip
NDR_X8 = Link(
    "8x InfiniBand NDR 400 Gb/s", 8 * _gb(400), 14.0,
    f"NVIDIA DGX H100 datasheet: 8x 400 Gb/s ConnectX-7, one per GPU; {NCCL_TUNING} NET 14 us",
)  # fmt: skip
IN_PROCESS = Link(
    "in-process (TensorFlow's local all-reduce)", 10.0, 0.0,
    "numpy add measured 6-39 GB/s (bytes read + written) on this machine, 2026-11-22; "
    "latency set to 0: a thread hand-off, not a message",
)  # fmt: skip
LINKS = {
    link.name: link for link in (NVLINK4, PCIE3, ETH10, ROCE25, IB_EDR, IB_HDR, NDR_X8, IN_PROCESS)
}

# Parameter counts from the architectures; compute times measured or cited.
MNIST_FAST_H100 = Workload(
    "MNIST fast convnet", 108_618, 8, 0.501,
    "tfdist_examples.recipes.fast_model: Conv2D(16,3)+pool+Conv2D(32,3)+pool+Dense(128)+"
    "Dense(10) = 160+4,640+102,528+1,290 params; one SGD step of the same net in JAX on one "
    "H100, 2026-11-22: 1.21 ms at batch 2048, 4.29 ms at 8192 -> 0.501 us/example + 0.19 ms",
    overhead_ms=0.19,
)  # fmt: skip
RESNET101_H100 = Workload(
    "ResNet-101", 44_549_160, 314, 57.2 / 64 * 1000,
    "torchvision resnet101: 44,549,160 params in 314 tensors; one fp32 (TF32 convolutions) "
    "SGD step at batch 64 on one H100, PyTorch 2.11, 2026-11-22: 57.2 ms",
)  # fmt: skip
# ResNet-101 is not in TensorFlow's P100 table; time per image is interpolated in FLOPs
# between ResNet-50 (3.8 GFLOPs, 219 img/s) and ResNet-152 (11.3 GFLOPs, 91.8 img/s).
_P100_MS = 1000 / 219 + (7.6 - 3.8) / (11.3 - 3.8) * (1000 / 91.8 - 1000 / 219)
RESNET101_P100 = Workload(
    "ResNet-101 on P100", 44_549_160, 314, _P100_MS * 1000,
    "tensorflow.org/performance/benchmarks (May 2017, DGX-1 P100, batch 64, synthetic): "
    "ResNet-50 219 img/s, ResNet-152 91.8 img/s; FLOPs 3.8/7.6/11.3 G from He et al. 2015 "
    f"Table 1 -> {_P100_MS:.2f} ms/image (~{1000 / _P100_MS:.0f} img/s)",
)  # fmt: skip


def ring_allreduce_s(nbytes: float, ranks: int, link: Link, packs: int = 1) -> float:
    """Seconds of one ring all-reduce of ``nbytes`` over ``ranks`` ranks on ``link``.

    2(P-1)/P x bytes / bandwidth, plus 2(P-1) hops x latency for each pack.

    Example:
        >>> round(ring_allreduce_s(1e9, 2, Link("x", 1.0, 0.0, "")), 3)
        1.0
    """
    where = "ring_allreduce_s"
    validate.number(nbytes, "nbytes", where, low=0.0, what="a non-negative number of bytes")
    validate.positive_int(ranks, "ranks", where)
    validate.instance(link, Link, "link", where, "a Link")
    validate.positive_int(packs, "packs", where)
    if ranks == 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return (
        steps / ranks * nbytes / (link.gbytes_per_s * 1e9) + steps * packs * link.latency_us / 1e6
    )


def pack_count(workload: Workload, bytes_per_pack: int | None) -> int:
    """How many all-reduces one step makes: one per pack, or one per tensor without packing.

    Example:
        >>> pack_count(RESNET101_P100, 64 * 2**20)
        3
    """
    validate.instance(workload, Workload, "workload", "pack_count", "a Workload")
    if bytes_per_pack is None:
        return workload.tensors
    validate.non_negative_int(bytes_per_pack, "bytes_per_pack", "pack_count", "0 means one pack")
    if bytes_per_pack == 0:
        return 1
    return min(workload.tensors, max(1, math.ceil(workload.gradient_bytes / bytes_per_pack)))


def allreduce_s(workload: Workload, cluster: Cluster) -> float:
    """Seconds of one step's gradient all-reduce on ``cluster`` (flat ring or hierarchical).

    Flat ring over P = N x G ranks: the bytes cross the slowest link; following NCCL's cost
    model, about 2N of the 2(P-1) hops cross the network and the rest stay in the node.
    Hierarchical: reduce-scatter in the node, a ring across nodes (the G shard rings share
    the node's one inter link, so it still carries all the bytes), all-gather in the node.

    Example:
        >>> c = Cluster(1, 2, PCIE3, ROCE25)
        >>> round(allreduce_s(RESNET101_P100, c) * 1000, 1)
        11.3
    """
    validate.instance(workload, Workload, "workload", "allreduce_s", "a Workload")
    validate.instance(cluster, Cluster, "cluster", "allreduce_s", "a Cluster")
    packs = pack_count(workload, cluster.bytes_per_pack)
    nbytes, n, g, p = workload.gradient_bytes, cluster.workers, cluster.devices, cluster.replicas
    if cluster.hierarchical:
        in_node = ring_allreduce_s(nbytes, g, cluster.intra, packs)
        return in_node + ring_allreduce_s(nbytes, n, cluster.inter, packs)
    if n == 1:
        return ring_allreduce_s(nbytes, p, cluster.intra, packs)
    inter_hops = 2 * min(n, p - 1)
    intra_hops = 2 * (p - 1) - inter_hops
    bandwidth = min(cluster.inter.gbytes_per_s, cluster.intra.gbytes_per_s) * 1e9
    latency_us = inter_hops * cluster.inter.latency_us + intra_hops * cluster.intra.latency_us
    return 2 * (p - 1) / p * nbytes / bandwidth + packs * latency_us / 1e6


def compute_s(workload: Workload, per_replica_batch: int, cluster: Cluster | None = None) -> float:
    """Seconds of one replica's forward + backward on ``per_replica_batch`` examples.

    Where all replicas share one host's cores, each gets cores / replicas of them (one
    core each at most: the measured per-example time is taken at one replica per core).

    Example:
        >>> round(compute_s(RESNET101_H100, 64) * 1000, 1)
        57.2
    """
    validate.instance(workload, Workload, "workload", "compute_s", "a Workload")
    validate.positive_int(per_replica_batch, "per_replica_batch", "compute_s")
    seconds = (workload.overhead_ms * 1000 + per_replica_batch * workload.us_per_example) / 1e6
    if cluster is not None and cluster.host_cores:
        seconds *= max(1.0, cluster.replicas / cluster.host_cores)
    return seconds


def predict(workload: Workload, cluster: Cluster, per_replica_batch: int) -> Prediction:
    """Step time and efficiency of ``workload`` on ``cluster`` at ``per_replica_batch``.

    Example:
        >>> one_node = Cluster(1, 8, NVLINK4, IB_EDR)
        >>> predict(RESNET101_H100, one_node, 64).efficiency > 0.95
        True
    """
    validate.instance(workload, Workload, "workload", "predict", "a Workload")
    validate.instance(cluster, Cluster, "cluster", "predict", "a Cluster")
    validate.positive_int(per_replica_batch, "per_replica_batch", "predict")
    validate.number(cluster.overlap, "cluster.overlap", "predict", low=0.0, what="in [0, 1]")
    if cluster.overlap > 1:
        raise ValueError(
            validate.message("predict", "cluster.overlap", "in [0, 1]", cluster.overlap)
        )
    compute = compute_s(workload, per_replica_batch, cluster)
    comm = allreduce_s(workload, cluster)
    # Only backward-pass time can hide the all-reduce: gradients do not exist before it.
    hidden = min(cluster.overlap * comm, workload.backward_fraction * compute)
    step = compute + comm - hidden
    alone = compute_s(workload, per_replica_batch)
    return Prediction(
        cluster.replicas, per_replica_batch, per_replica_batch * cluster.replicas,
        compute * 1000, comm * 1000, (comm - hidden) * 1000, step * 1000, alone / step,
    )  # fmt: skip


def batch_for_efficiency(
    workload: Workload, cluster: Cluster, target: float = 0.9, max_batch: int = 2**20
) -> int | None:
    """The smallest per-replica batch whose efficiency is >= ``target`` (None: not by ``max_batch``).

    Efficiency rises with the batch (compute grows, the all-reduce does not), so a
    bisection finds it.

    Example:
        >>> batch_for_efficiency(RESNET101_H100, Cluster(1, 8, NVLINK4, IB_EDR))
        8
    """
    where = "batch_for_efficiency"
    validate.number(target, "target", where, low=0.0, low_ok=False, what="in (0, 1)")
    if target >= 1:
        raise ValueError(validate.message(where, "target", "in (0, 1)", target))
    validate.positive_int(max_batch, "max_batch", where)
    if predict(workload, cluster, max_batch).efficiency < target:
        return None
    low, high = 0, max_batch  # efficiency(low) < target <= efficiency(high); batch 0 is "below"
    while high - low > 1:
        mid = (low + high) // 2
        if predict(workload, cluster, mid).efficiency >= target:
            high = mid
        else:
            low = mid
    return high


# --- this machine: the loopback link fitted from measured rows -------------------------


def _mean(value) -> float:
    """A figure or the middle of a [low, high] range."""
    return sum(value) / len(value) if isinstance(value, list) else float(value)


def _row_cluster(row: dict, link: Link, cores: int) -> Cluster:
    return Cluster(row["workers"], row["devices_per_worker"], IN_PROCESS, link, host_cores=cores)


def _run_workload(data: dict, run: dict) -> Workload:
    """The measured job with the per-example time of ``run``'s one-process row.

    That row (1 process, G devices, in-process all-reduce) is taken as compute plus its
    small in-process all-reduce; what it spends beyond that is counted as compute.
    """
    job, cores = data["job"], data["cores"]
    base = next(row for row in run["rows"] if row["workers"] == 1)
    work = Workload(job["name"], job["params"], job["tensors"], 1.0, job["source"])
    cluster = _row_cluster(base, IN_PROCESS, cores)
    per_replica = base["global_batch"] // cluster.replicas
    compute_ms = _mean(base["ms_per_step"]) - allreduce_s(work, cluster) * 1000
    per_example = compute_ms * 1000 / (per_replica * max(1.0, cluster.replicas / cores))
    return replace(work, us_per_example=per_example)


def fit_loopback(data: dict) -> tuple[Link, list[float]]:
    """The gRPC loopback link: bandwidth as measured, per-hop latency fitted to the fit rows.

    For each run marked ``fit``, its multi-worker row minus its one-process compute minus
    the bandwidth term leaves 2(N-1) hop latencies; the link takes the median over runs.

    Example:
        >>> link, per_run = fit_loopback(load_measured())  # doctest: +SKIP
    """
    validate.instance(data, dict, "data", "fit_loopback", "a dict (scaling_measured.json)")
    bandwidth = data["loopback_gbytes_per_s"]
    probe = Link("loopback gRPC", bandwidth, 0.0, "")
    estimates = []
    for run in (run for run in data["runs"] if run.get("fit")):
        work = _run_workload(data, run)
        for row in run["rows"]:
            if row["workers"] == 1 or row.get("ms_per_step") is None:
                continue
            cluster = _row_cluster(row, probe, data["cores"])
            pred = predict(work, cluster, row["global_batch"] // cluster.replicas)
            hops = 2 * (cluster.replicas - 1) * pack_count(work, cluster.bytes_per_pack)
            estimates.append((_mean(row["ms_per_step"]) - pred.step_ms) * 1000 / hops)
    if not estimates:
        raise ValueError(
            validate.message("fit_loopback", "data['runs']", "at least one run with fit=true "
                             "and a multi-worker row", [r.get("name") for r in data["runs"]])
        )  # fmt: skip
    latency = max(0.0, sorted(estimates)[len(estimates) // 2])
    source = (
        f"bandwidth: {data['loopback_source']}; per-hop latency fitted: median of "
        f"{len(estimates)} fit row(s), {', '.join(f'{e / 1000:.2f} ms' for e in estimates)}"
    )
    return Link("loopback gRPC (this machine)", bandwidth, latency, source), estimates


def machine_check(data: dict) -> dict:
    """Predicted against measured ms/step for every row of ``data`` (one entry per row).

    Example:
        >>> machine_check(load_measured())["rows"][0]["label"]  # doctest: +SKIP
        '1 process x 2 devices'
    """
    link, estimates = fit_loopback(data)
    rows = []
    for run in data["runs"]:
        work = _run_workload(data, run)
        for row in run["rows"]:
            cluster = _row_cluster(row, link, data["cores"])
            pred = predict(work, cluster, row["global_batch"] // cluster.replicas)
            measured = row.get("ms_per_step")
            rows.append({
                "run": run["name"], "fit": bool(run.get("fit")),
                "label": f"{row['workers']} worker(s) x {row['devices_per_worker']} device(s)",
                "workers": row["workers"], "devices_per_worker": row["devices_per_worker"],
                "global_batch": row["global_batch"], "measured_ms": measured,
                "predicted_ms": pred.step_ms, "exposed_allreduce_ms": pred.exposed_ms,
                "error_pct": None if measured is None
                else 100 * (pred.step_ms - _mean(measured)) / _mean(measured),
            })  # fmt: skip
    return {"link": asdict(link), "latency_estimates_us": estimates, "rows": rows}


def load_measured(path: str | Path = MEASURED) -> dict:
    """This machine's measured rows (``tools/results/scaling_measured.json`` or a file like it).

    Example:
        >>> load_measured()["job"]["params"]  # doctest: +SKIP
        269322
    """
    text = validate.path_text(path, "path", "load_measured", "a JSON file like " + MEASURED.name)
    data = json.loads(Path(text).read_text())
    for key in ("machine", "cores", "job", "loopback_gbytes_per_s", "loopback_source", "runs"):
        if key not in data:
            raise ValueError(validate.message(
                "load_measured", "the file", f"a JSON object with key {key!r}", text,
                f"see {MEASURED} for the shape",
            ))  # fmt: skip
    return data


# --- Horovod's published figure ------------------------------------------------------

HOROVOD_SOURCE = (
    "Sergeev & Del Balso 2018, arXiv:1802.05799, and github.com/horovod/horovod "
    "docs/benchmarks.rst: 128 servers x 4 Pascal GPUs, RoCE-capable 25 Gbit/s network, "
    "tf_cnn_benchmarks --model resnet101 --batch_size 64; 90% scaling efficiency for "
    "ResNet-101 and Inception V3 on 512 GPUs (and 90% on 128 GPUs, 32 servers, earlier)"
)
HOROVOD_FUSION_BYTES = 64 * 2**20  # Tensor Fusion's default buffer (HOROVOD_FUSION_THRESHOLD)


def horovod_check(gpus: int = 512) -> dict:
    """The model against Horovod's 90% for ResNet-101 (4 Pascal GPUs per server, 25 GbE).

    Inputs: fp32 gradients of 44.5M parameters (178 MB) in 64 MB fusion packs (3), a flat
    NCCL ring, PCIe in the server (the paper does not say NVLink), and Horovod's
    overlap: it all-reduces each fused pack while the backward pass goes on, so all but
    the last pack can hide: overlap = 1 - 1/packs. The table also gives overlap 0.

    Example:
        >>> 0.85 < horovod_check()["efficiency"] < 0.95
        True
    """
    validate.positive_int(gpus, "gpus", "horovod_check")
    if gpus % 4:
        raise ValueError(validate.message("horovod_check", "gpus", "a multiple of 4", gpus))
    work = RESNET101_P100
    packs = pack_count(work, HOROVOD_FUSION_BYTES)
    cluster = Cluster(gpus // 4, 4, PCIE3, ROCE25, bytes_per_pack=HOROVOD_FUSION_BYTES,
                      overlap=1 - 1 / packs)  # fmt: skip
    pred = predict(work, cluster, 64)
    no_overlap = predict(work, replace(cluster, overlap=0.0), 64)
    return {
        "gpus": gpus, "published_efficiency": 0.90, "efficiency": pred.efficiency,
        "efficiency_without_overlap": no_overlap.efficiency, "step_ms": pred.step_ms,
        "compute_ms": pred.compute_ms, "allreduce_ms": pred.allreduce_ms,
        "exposed_ms": pred.exposed_ms, "packs": packs, "overlap": cluster.overlap,
        "gradient_mb": work.gradient_bytes / 1e6, "source": HOROVOD_SOURCE,
        "compute_source": work.source, "links": [PCIE3.source, ROCE25.source],
    }  # fmt: skip


# --- the table: 8 to 512 GPUs, 8 per node --------------------------------------------

TABLE_GPUS = (8, 16, 32, 64, 128, 256, 512)
TABLE_LINKS = (ROCE25, IB_EDR, NDR_X8)
TABLE_MODELS = ((MNIST_FAST_H100, 128), (RESNET101_H100, 64))


def scaling_table(gpus_per_node: int = 8, models=TABLE_MODELS) -> list[dict]:
    """Step time, efficiency and the 90% batch for each model x inter link x GPU count.

    TensorFlow's defaults: a flat ring, one pack, no overlap, NVLink 4 inside a node.

    Example:
        >>> len(scaling_table())
        42
    """
    validate.positive_int(gpus_per_node, "gpus_per_node", "scaling_table")
    rows = []
    for work, batch in models:
        for link in TABLE_LINKS:
            for gpus in TABLE_GPUS:
                cluster = Cluster(max(1, gpus // gpus_per_node), min(gpus, gpus_per_node),
                                  NVLINK4, link)  # fmt: skip
                pred = predict(work, cluster, batch)
                b90 = batch_for_efficiency(work, cluster)
                rows.append({
                    "model": work.name, "inter": link.name, "gpus": gpus,
                    "per_replica_batch": batch, "step_ms": pred.step_ms,
                    "allreduce_ms": pred.allreduce_ms, "efficiency": pred.efficiency,
                    "per_replica_batch_90": b90,
                    "global_batch_90": None if b90 is None else b90 * cluster.replicas,
                })  # fmt: skip
    return rows


# --- a workload measured on one GPU (tools/bench/gpu.py) -------------------------------


def gpu_workload(data: dict, variant: str = "none") -> Workload:
    """The convnet as measured by tools/bench/gpu.py: a least-squares line through its rows.

    ms/step = overhead + batch x per-example, fitted over the measured global batches
    (Keras ``fit`` on one device, so the overhead includes its per-step dispatch).

    Example:
        >>> rows = [{"global_batch": 100, "ms": {"none": 1.5}},
        ...         {"global_batch": 300, "ms": {"none": 2.5}}]
        >>> w = gpu_workload({"rows": rows, "device_kind": "X", "date": "d", "source": "s"})
        >>> round(w.us_per_example, 3), round(w.overhead_ms, 3)
        (5.0, 1.0)
    """
    validate.instance(
        data, dict, "data", "gpu_workload", "a dict (tools/results/gpu_measured.json)"
    )
    points = [(r["global_batch"], r["ms"][variant]) for r in data["rows"]]
    if len({b for b, _ in points}) < 2:
        raise ValueError(validate.message(
            "gpu_workload", "data['rows']", "rows at two or more global batches", points
        ))  # fmt: skip
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / sum(
        (b - mean_b) ** 2 for b, _ in points
    )
    base = MNIST_FAST_H100
    return replace(
        base,
        name=f"MNIST fast convnet, Keras fit on {data['device_kind']} (measured)",
        us_per_example=slope * 1000,
        overhead_ms=max(0.0, mean_t - slope * mean_b),
        source=f"{data.get('source', 'tools/bench/gpu.py')}, {data['date']}: "
        + ", ".join(f"{t:.2f} ms at {b}" for b, t in points),
    )


def gpu_report(data: dict) -> dict:
    """Measured rows, the fitted workload and its 8-512 GPU table."""
    work = gpu_workload(data)
    models = ((work, 128), (work, 1024))
    return {"workload": asdict(work), "rows": data["rows"], "table": scaling_table(models=models),
            "machine": data.get("machine", data["device_kind"])}  # fmt: skip


def format_gpu(g: dict) -> list[str]:
    work = Workload(**g["workload"])
    lines = [
        f"## 4. Measured on one GPU: {g['machine']}",
        f"fitted: {work.overhead_ms:.2f} ms + {work.us_per_example:.3f} us/example ({work.source})",
        "",
        "| global batch | no distribution ms/step | tfdist.scope ms/step | images/s | tfdist/none |",
        "|---|---|---|---|---|",
    ]
    for r in g["rows"]:
        lines.append(
            f"| {r['global_batch']} | {r['ms']['none']:.2f} | {r['ms']['tfdist']:.2f} | "
            f"{r['images_per_s']['none']:,.0f} | {r['tfdist_over_none']:.2f} |"
        )
    lines.append("")
    return lines + format_table(g["table"], ((work, 128), (work, 1024)), "### 4b.")


# --- output ----------------------------------------------------------------------------


def _ms(value) -> str:
    if value is None:
        return "not yet measured"
    return "-".join(f"{v:.1f}" for v in value) if isinstance(value, list) else f"{value:.1f}"


def format_machine(check: dict, data: dict) -> list[str]:
    link = check["link"]
    lines = [
        f"## 1. This machine: {data['machine']}; job: {data['job']['name']}",
        f"loopback gRPC link: {link['gbytes_per_s']:.2f} GB/s, {link['latency_us'] / 1000:.2f} "
        f"ms per hop ({link['source']})",
        "",
        "| run | rows | global batch | measured ms/step | predicted | error | |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in check["rows"]:
        error = "-" if row["error_pct"] is None else f"{row['error_pct']:+.0f}%"
        role = "baseline" if row["workers"] == 1 else "fit" if row["fit"] else "check"
        if row["measured_ms"] is None:
            role = "prediction"
        lines.append(
            f"| {row['run']} | {row['label']} | {row['global_batch']} | {_ms(row['measured_ms'])} "
            f"| {row['predicted_ms']:.1f} | {error} | {role} |"
        )
    return lines


def format_horovod(checks: list[dict]) -> list[str]:
    first = checks[0]
    lines = [
        "## 2. Horovod's ResNet-101 figure",
        f"inputs: {first['gradient_mb']:.0f} MB fp32 gradients in {first['packs']} packs, "
        f"compute {first['compute_ms']:.0f} ms/step at batch 64 ({first['compute_source']}); "
        f"source: {first['source']}",
        "",
        "| GPUs | all-reduce ms | exposed ms | efficiency (overlap 1-1/packs) | overlap 0 | published |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c['gpus']} | {c['allreduce_ms']:.0f} | {c['exposed_ms']:.0f} | "
            f"{c['efficiency']:.1%} | {c['efficiency_without_overlap']:.1%} | 90% |"
        )
    return lines


def format_table(rows: list[dict], models=TABLE_MODELS, title: str = "## 3.") -> list[str]:
    lines = [f"{title} 8-512 GPUs, 8 per node (NVLink 4 inside; flat ring, one pack, no overlap)"]
    for work, batch in models:
        head = " | ".join(
            f"{link.name}: eff (ms/step) | global batch at 90%" for link in TABLE_LINKS
        )
        lines += ["", f"{work.name}, per-replica batch {batch}:", "", f"| GPUs | {head} |",
                  "|---" * (1 + 2 * len(TABLE_LINKS)) + "|"]  # fmt: skip
        for gpus in TABLE_GPUS:
            cells = []
            for link in TABLE_LINKS:
                r = next(
                    r
                    for r in rows
                    if (r["model"], r["inter"], r["gpus"], r["per_replica_batch"])
                    == (work.name, link.name, gpus, batch)
                )
                b90 = (
                    "> 2^20 per GPU"
                    if r["global_batch_90"] is None
                    else f"{r['global_batch_90']:,}"
                )
                cells += [f"{r['efficiency']:.0%} ({r['step_ms']:.1f})", b90]
            lines.append(f"| {gpus} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "MNIST has 60,000 training images: a 90% batch above that means the convnet does not "
        "scale past one node (its 0.4 MB all-reduce is latency-bound: 2N network hops of 14 us "
        "against 0.25 ms of compute).",
    ]
    return lines


def report(data: dict) -> dict:
    """Everything the CLI prints, as one JSON-ready dict.

    Example:
        >>> sorted(report(load_measured()))  # doctest: +SKIP
        ['date', 'horovod', 'links', 'machine', 'table', 'workloads']
    """
    return {
        "date": date.today().isoformat(),
        "machine": machine_check(data) | {"name": data["machine"], "job": data["job"]},
        "horovod": [horovod_check(128), horovod_check(512)],
        "table": scaling_table(),
        "links": [asdict(link) for link in LINKS.values()],
        "workloads": [asdict(w) for w in (MNIST_FAST_H100, RESNET101_H100, RESNET101_P100)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--measured", metavar="FILE", default=str(MEASURED),
                        help="this machine's rows (default: %(default)s)")  # fmt: skip
    parser.add_argument("--gpu", metavar="FILE", default=None,
                        help="rows measured on one GPU by tools/bench/gpu.py (e.g. "
                        f"{GPU_MEASURED.name}): adds their fitted 8-512 GPU table")  # fmt: skip
    args = parser.parse_args(argv)
    data = load_measured(args.measured)
    result = report(data)
    if args.gpu:
        result["gpu"] = gpu_report(json.loads(Path(args.gpu).read_text()))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    lines = [f"scaling model, {result['date']}", ""]
    lines += format_machine(result["machine"], data) + [""]
    lines += format_horovod(result["horovod"]) + [""]
    lines += format_table(result["table"])
    if args.gpu:
        lines += [""] + format_gpu(result["gpu"])
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
