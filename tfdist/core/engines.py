"""Which engine started this process, and what it told it: a pure function of the environment.

``tfdist info`` reports it. Each engine leaves its own variables in the processes it starts:

============  =======================================================================
``launch``    ``tfdist launch``: ``TFDIST_RESTART`` (with ``RANK``, ``WORLD_SIZE``,
              ``MASTER_ADDR``...; ``tfdist/launch/environment.py``)
``ray``       Ray: ``RAY_RAYLET_PID``/``RAY_JOB_ID`` in its worker processes,
              ``RAY_ADDRESS`` to reach a cluster, or ``ray`` imported and initialised
``tfjob``     Kubeflow training operator's TFJob: ``TF_CONFIG`` in a Kubernetes pod
              (``KUBERNETES_SERVICE_HOST``)
``trainjob``  Kubeflow Trainer's TrainJob (a JobSet) on JAX: ``JAX_NUM_PROCESSES`` /
              ``JAX_PROCESS_ID`` / ``JAX_COORDINATOR_ADDRESS`` or the Indexed Job's
              ``JOB_COMPLETION_INDEX``, in a Kubernetes pod
``slurm``     SLURM: ``SLURM_JOB_ID`` (a step's tasks: ``SLURM_STEP_NUM_TASKS``...)
``kubernetes``  a Kubernetes pod with none of the above
``none``      none of these
============  =======================================================================

The innermost wins (``tfdist launch`` inside a TFJob pod is ``launch``); the others
detected are listed in ``within``.

Example:
    >>> detect({"TF_CONFIG": "{}", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}).name
    'tfjob'
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Engine", "detect", "ENGINES"]

ENGINES = ("launch", "ray", "tfjob", "trainjob", "slurm", "kubernetes", "none")
_TITLES = {
    "launch": "tfdist launch",
    "ray": "Ray",
    "tfjob": "Kubeflow TFJob",
    "trainjob": "Kubeflow TrainJob (JobSet)",
    "slurm": "SLURM",
    "kubernetes": "Kubernetes pod",
    "none": "none",
}
_READS = {
    "launch": ("TFDIST_RESTART", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"),
    "ray": ("RAY_ADDRESS", "RAY_JOB_ID", "RAY_RAYLET_PID", "RAY_NODE_ID"),
    "tfjob": ("HOSTNAME", "KUBERNETES_SERVICE_HOST"),
    "trainjob": (
        "HOSTNAME",
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "JOB_COMPLETION_INDEX",
        "KUBERNETES_SERVICE_HOST",
    ),
    "slurm": ("SLURM_JOB_ID", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_STEP_NODELIST"),
    "kubernetes": ("HOSTNAME", "KUBERNETES_SERVICE_HOST"),
    "none": (),
}
_JAX_JOB = ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS")


@dataclass(frozen=True)
class Engine:
    """The engine that started this process.

    Attributes:
        name: one of ``ENGINES``.
        read: the engine's variables that are set (``TF_CONFIG`` decoded to its task
            and cluster size).
        within: the other engines detected around it, innermost first.
    """

    name: str = "none"
    read: Mapping[str, object] = field(default_factory=dict)
    within: tuple[str, ...] = ()

    @property
    def title(self) -> str:
        return _TITLES[self.name]

    def summary(self) -> dict:
        """A JSON-friendly description, used by ``tfdist info``."""
        return {"name": self.name, "title": self.title, "read": dict(self.read),
                "within": list(self.within)}  # fmt: skip


def _present(env: Mapping[str, str], ray_initialized: bool) -> list[str]:
    """Every engine whose marks are in ``env``, innermost first."""
    k8s = bool(env.get("KUBERNETES_SERVICE_HOST"))
    found = []
    if env.get("TFDIST_RESTART", "") != "":
        found.append("launch")
    if ray_initialized or any(env.get(name) for name in _READS["ray"]):
        found.append("ray")
    # tfdist launch and Ray Train write TF_CONFIG themselves: then it is not a TFJob's.
    if k8s and env.get("TF_CONFIG", "").strip() and not found:
        found.append("tfjob")
    if k8s and any(env.get(name) for name in (*_JAX_JOB, "JOB_COMPLETION_INDEX")):
        found.append("trainjob")
    if env.get("SLURM_JOB_ID"):
        found.append("slurm")
    if k8s and not {"tfjob", "trainjob"} & set(found):
        found.append("kubernetes")
    return found


def _tf_config_summary(text: str) -> dict:
    try:
        value = json.loads(text)
        task = value.get("task") or {}
        cluster = value.get("cluster") or {}
        return {
            "task": f"{task.get('type')}:{task.get('index', 0)}",
            "workers": sum(len(cluster.get(job, ())) for job in ("chief", "worker")),
            "addresses": [a for job in ("chief", "worker") for a in cluster.get(job, ())],
        }
    except (ValueError, AttributeError, TypeError) as err:
        return {"error": f"TF_CONFIG is not a valid cluster: {err}"}


def detect(environ: Mapping[str, str] | None = None, *, ray_initialized: bool = False) -> Engine:
    """The engine that started this process, from ``environ`` (default ``os.environ``).

    Args:
        environ: the environment to read.
        ray_initialized: whether ``ray`` is imported and ``ray.is_initialized()`` (the
            caller checks; this function never imports anything).

    Example:
        >>> detect({"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_TASKS": "2"}).read["SLURM_JOB_ID"]
        '7'
    """
    env = os.environ if environ is None else environ
    if not isinstance(env, Mapping):
        raise TypeError(
            f"detect: environ must be a mapping of variable names to values. "
            f"Received: environ={env!r} of type {type(env).__name__}"
        )
    found = _present(env, bool(ray_initialized))
    name = found[0] if found else "none"
    read: dict[str, object] = {k: env[k] for k in _READS[name] if env.get(k)}
    if name == "ray":
        read["ray_initialized"] = bool(ray_initialized)
    if name in ("tfjob", "ray", "launch") and env.get("TF_CONFIG", "").strip():
        read["TF_CONFIG"] = _tf_config_summary(env["TF_CONFIG"])
    return Engine(name, read, tuple(found[1:]))
