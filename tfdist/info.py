"""``tfdist info``: everything a bug report needs, in one place (text or JSON).

System (OS, CPU model and cores, memory), versions, the framework's build (CUDA/cuDNN),
GPUs with their memory, the backend's devices and the distribution ``auto`` would pick,
the cluster and the engine that started the process (``tfdist.core.engines``: Ray, a
Kubeflow TFJob or TrainJob, SLURM, ``tfdist launch``), the environment variables that change tfdist's behaviour, which fixes apply
and are active, and whether MNIST is on disk. It plans, never creates: no server starts,
no peer is waited for.

Example:
    >>> report()["system"]["cpu_cores"] >= 1  # doctest: +SKIP
    True
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping

from tfdist import backends, compat, distribute
from tfdist.core import engines, versions
from tfdist.core.config import RENDEZVOUS_ENV

__all__ = ["report", "render", "ENV_PREFIXES"]

# Variables that change what tfdist, TensorFlow, Keras or jax do (names starting with these).
ENV_PREFIXES = (
    "TFDIST_",
    "TF_CONFIG",
    "TF_CPP_MIN_LOG_LEVEL",
    "KERAS_",
    "CUDA_VISIBLE_DEVICES",
    "TFDS_DATA_DIR",
    "XLA_FLAGS",
    "JAX_",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_PROCID",
    "SLURM_JOB_ID",
    "JOB_COMPLETION_INDEX",
    "KUBERNETES_SERVICE_HOST",
)
_PACKAGES = ("tensorflow", "keras", "jax", "jaxlib", "tensorflow-datasets", "numpy", "tfdist")
_GPU_QUERY_TIMEOUT_S = 10.0


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[dict]:
    """GPU names and memory from nvidia-smi (none without it; bounded by a timeout)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=_GPU_QUERY_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return [{"error": f"nvidia-smi failed: {err}"}]
    rows = [line.split(",", 1) for line in out.strip().splitlines() if line.strip()]
    return [{"name": name.strip(), "memory": memory.strip()} for name, memory in rows]


def _build(backend: str) -> dict:
    if backend != "tensorflow":
        import jax

        return {"jax_platform": jax.default_backend()}
    import tensorflow as tf

    info = tf.sysconfig.get_build_info()
    return {
        "cuda_build": bool(info.get("is_cuda_build")),
        "cuda": info.get("cuda_version"),
        "cudnn": info.get("cudnn_version"),
    }


def _mnist(env: Mapping[str, str]) -> dict:
    root = env.get("TFDS_DATA_DIR") or os.path.join(os.path.expanduser("~"), "tensorflow_datasets")
    return {"data_dir": root, "present": os.path.isdir(os.path.join(root, "mnist"))}


def _ray_initialized() -> bool:
    """Whether this process already joined a Ray cluster (ray is never imported here)."""
    ray = sys.modules.get("ray")
    try:
        return bool(ray is not None and ray.is_initialized())
    except Exception:  # a partly imported or stub module: not a running Ray
        return False


def _fixes() -> list[dict]:
    """Each fix: applied, skipped (a target missing or changed, and why), not needed
    (another backend), excluded, or pending (its package not imported)."""
    return compat.status()


def _fix_lines(fixes: list[dict]) -> list[str]:
    applied = [f["name"] for f in fixes if f["state"] == "applied"]
    lines = [f"fixes:         {', '.join(applied) or 'none applied in this process'}"]
    for f in fixes:
        if f["state"] == "skipped":
            lines.append(f"  SKIPPED      {f['name']}: {f['why']}")
        if f["state"] == "fixed upstream":
            lines.append(f"  not applied  {f['name']}: {f['why']}")
    others: dict[str, list[str]] = {}
    for f in fixes:
        if f["state"] not in ("applied", "skipped", "fixed upstream"):
            others.setdefault(f["state"], []).append(f["name"])
    lines += [f"  {state + ':':<13}{', '.join(names)}" for state, names in others.items()]
    return lines


def report(environ: Mapping[str, str] | None = None) -> dict:
    """The whole report as a JSON-friendly dict."""
    env = os.environ if environ is None else environ
    backend = backends.name(env)
    described = distribute.topology(env)
    return {
        "system": {
            "os": platform.platform(),
            "python": platform.python_version(),
            "cpu": _cpu_model(),
            "cpu_cores": os.cpu_count(),
            "memory_gib": _memory_gib(),
        },
        "versions": {name: _version(name) for name in _PACKAGES},
        "verified": versions.verified_lines(),
        "backend": backend,
        "build": _build(backend),
        "gpus": _gpus(),
        "devices": described["devices"],
        "strategy": described["strategy"],
        "cluster": described["cluster"],
        "engine": engines.detect(env, ray_initialized=_ray_initialized()).summary(),
        "rendezvous": env.get(RENDEZVOUS_ENV) or None,
        "fixes": _fixes(),
        "environment": {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES)},
        "mnist": _mnist(env),
        "TFDS_DATA_DIR": env.get("TFDS_DATA_DIR") or None,
    }


def _device_lines(r: dict) -> list[str]:
    d, s = r["devices"], r["strategy"]
    gpus = ", ".join(f"{g.get('name')} ({g.get('memory')})" for g in r["gpus"]) or "none"
    if r["backend"] == "tensorflow":
        devices = f"{len(s['devices'])} per worker: {', '.join(s['devices'])}"
        if d.get("TFDIST_CPU_DEVICES") is None and len(d["cpus"]) == 1:
            devices += "  (the CPU is one device; TFDIST_CPU_DEVICES=N splits it into N)"
    else:
        devices = f"{d['local_devices']} local {d['platform']} device(s), mesh {s['mesh']}"
    return [f"GPUs:          {gpus}", f"devices:       {devices}"]


def _engine_line(e: dict) -> str:
    read = ", ".join(f"{k}={v}" for k, v in e["read"].items())
    within = f"  (within: {', '.join(e['within'])})" if e["within"] else ""
    return f"{e['title']}{'  ' + read if read else ''}{within}"


def render(r: dict) -> str:
    """The report as text, one fact a line."""
    v, sysinfo, c = r["versions"], r["system"], r["cluster"]
    packages = ", ".join(f"{name} {v[name]}" for name in _PACKAGES if v[name] and name != "tfdist")
    build = ", ".join(f"{k}={val}" for k, val in r["build"].items())
    cluster = "none (single process; chief)"
    if c["source"] != "none":
        cluster = (
            f"{c['source']}  {c['num_workers']} worker(s), this is {c['task_type']}:"
            f"{c['task_index']}{' (chief)' if c['is_chief'] else ''}"
        )
    s = r["strategy"]
    lines = [
        f"tfdist {v['tfdist']}  ({packages})",
        f"system:        {sysinfo['os']}, {sysinfo['cpu']}, {sysinfo['cpu_cores']} cores, "
        f"{sysinfo['memory_gib']} GiB",
        f"backend:       {r['backend']}  ({build})",
        *_device_lines(r),
        f"strategy:      {s['kind']}  replicas={s['num_replicas']}  workers={s['num_workers']}",
        f"cluster:       {cluster}",
        f"engine:        {_engine_line(r['engine'])}",
        f"rendezvous:    {r['rendezvous'] or 'none (not a worker of an elastic tfdist launch)'}",
        *_fix_lines(r["fixes"]),
        f"verified on:   {'; '.join(r['verified'])}",
        f"MNIST:         {'present' if r['mnist']['present'] else 'absent'} in {r['mnist']['data_dir']}",
        "environment:   "
        + (", ".join(f"{k}={val}" for k, val in r["environment"].items()) or "(none set)"),
    ]
    return "\n".join(lines)
