"""Who is in the cluster and who is chief, read from TF_CONFIG, JAX's or SLURM's variables.

Everything here is a pure function of an environment mapping, so the command line,
the launcher and the tests can use it without paying TensorFlow's import time.

Example:
    >>> info = cluster_from_env({"TF_CONFIG": worker_tf_config(
    ...     ["127.0.0.1:2222", "127.0.0.1:2223"], index=1)})
    >>> info.num_workers, info.is_chief, info.is_multi_worker
    (2, False, True)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tfdist.core.config import ConfigError, slurm_port_base

__all__ = [
    "ClusterInfo",
    "cluster_from_env",
    "parse_tf_config",
    "worker_tf_config",
    "expand_hostlist",
    "slurm_coordinator",
]

# Jobs whose tasks train (take part in the all-reduce); "evaluator" and "ps" do not.
TRAINING_JOBS = ("chief", "worker")
_KNOWN_JOBS = ("chief", "worker", "evaluator", "ps")


@dataclass(frozen=True)
class ClusterInfo:
    """The cluster this process belongs to.

    Attributes:
        source: where it came from: ``"TF_CONFIG"``, ``"KERAS_DISTRIBUTION"``,
            ``"JAX_COORDINATOR"`` (Kubeflow Trainer's JAX runtime), ``"SLURM"`` or ``"none"``.
        cluster: job name -> task addresses (``host:port``). Empty for SLURM, whose
            addresses TensorFlow's ``SlurmClusterResolver`` resolves later.
        task_type: this process's job (``"worker"``, ``"chief"``, ...), or None.
        task_index: this process's index within its job, or None.
        num_workers: number of training tasks (chief + workers).
    """

    source: str = "none"
    cluster: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    task_type: str | None = None
    task_index: int | None = None
    num_workers: int = 1

    @property
    def is_multi_worker(self) -> bool:
        """True when more than one training task takes part."""
        return self.num_workers > 1

    @property
    def is_chief(self) -> bool:
        """True for the task that does the one-off work (logs, final files).

        That is task 0 of the ``chief`` job, or worker 0 when there is no ``chief``
        job, or the only process when there is no cluster.
        """
        if self.task_type is None:
            return True
        if self.task_type == "chief":
            return True
        if self.task_type == "worker":
            return "chief" not in self.cluster and self.task_index == 0
        return False

    @property
    def rank(self) -> int:
        """Index of this task among the training tasks (chief first), 0 without a cluster."""
        if self.task_type is None or self.task_index is None:
            return 0
        if self.task_type == "worker" and "chief" in self.cluster:
            return len(self.cluster["chief"]) + self.task_index
        return self.task_index

    @property
    def addresses(self) -> tuple[str, ...]:
        """The training tasks' ``host:port`` in rank order (chief first); empty for SLURM."""
        return tuple(a for job in TRAINING_JOBS for a in self.cluster.get(job, ()))

    def summary(self) -> dict:
        """A JSON-friendly description, used by ``tfdist info``."""
        return {
            "source": self.source,
            "num_workers": self.num_workers,
            "task_type": self.task_type,
            "task_index": self.task_index,
            "is_chief": self.is_chief,
            "cluster": {job: list(addrs) for job, addrs in self.cluster.items()},
        }


def _tf_config_error(problem: str, received: object) -> ConfigError:
    return ConfigError(
        f"TF_CONFIG: {problem}. Received: TF_CONFIG={received!r}. TF_CONFIG must be JSON like "
        '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
        '"task": {"type": "worker", "index": 0}}; unset it to train on one machine.'
    )


def parse_tf_config(value: str | Mapping) -> ClusterInfo:
    """Parses and validates a TF_CONFIG value (a JSON string or an already-decoded dict).

    Args:
        value: the TF_CONFIG JSON text, or the decoded mapping.

    Returns:
        The ClusterInfo it describes; an empty or ``{}`` value means no cluster.

    Raises:
        ValueError: when it is not valid JSON or does not describe a usable cluster;
            the message echoes what was received.

    Example:
        >>> parse_tf_config('{"cluster": {"worker": ["a:1", "b:1"]},'
        ...                 ' "task": {"type": "worker", "index": 0}}').is_chief
        True
    """
    raw = value
    if isinstance(value, str):
        if not value.strip():
            return ClusterInfo()
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise _tf_config_error(
                f"is not valid JSON ({err.msg} at char {err.pos})", raw
            ) from None
    if not isinstance(value, Mapping):
        raise _tf_config_error("must be a JSON object", raw)
    cluster = value.get("cluster") or {}
    if not isinstance(cluster, Mapping):
        raise _tf_config_error('"cluster" must map job names to lists of "host:port"', raw)
    jobs: dict[str, tuple[str, ...]] = {}
    for job, addrs in cluster.items():
        if job not in _KNOWN_JOBS:
            raise _tf_config_error(f"unknown job {job!r} (expected one of {_KNOWN_JOBS})", raw)
        if isinstance(addrs, Mapping):  # TensorFlow also accepts {index: address}
            addrs = [addrs[k] for k in sorted(addrs, key=int)]
        if isinstance(addrs, str) or not isinstance(addrs, Sequence) or not addrs:
            raise _tf_config_error(f'job {job!r} must list at least one "host:port"', raw)
        for addr in addrs:
            if not isinstance(addr, str) or ":" not in addr:
                raise _tf_config_error(f'address {addr!r} of job {job!r} is not "host:port"', raw)
        jobs[job] = tuple(addrs)
    if "chief" in jobs and len(jobs["chief"]) != 1:
        raise _tf_config_error('the "chief" job must have exactly one task', raw)
    if not jobs:
        return ClusterInfo()
    task = value.get("task") or {}
    if not isinstance(task, Mapping):
        raise _tf_config_error('"task" must be an object with "type" and "index"', raw)
    task_type = task.get("type")
    task_index = task.get("index", 0)
    if task_type not in jobs:
        raise _tf_config_error(
            f'"task.type" must name a job of the cluster {sorted(jobs)}, got {task_type!r}', raw
        )
    if isinstance(task_index, bool) or not isinstance(task_index, int):
        raise _tf_config_error(f'"task.index" must be an int, got {task_index!r}', raw)
    if not 0 <= task_index < len(jobs[task_type]):
        raise _tf_config_error(
            f'"task.index" {task_index} is out of range for job {task_type!r} '
            f"with {len(jobs[task_type])} task(s)",
            raw,
        )
    num_workers = sum(len(jobs.get(job, ())) for job in TRAINING_JOBS)
    return ClusterInfo("TF_CONFIG", jobs, task_type, task_index, max(num_workers, 1))


_SRUN = "SLURM's srun; unset it if this is not a SLURM job step"
_TRAINJOB = "Kubeflow Trainer's JAX runtime in a TrainJob's pods; unset it if this is not one"


def _positive_env_int(env: Mapping[str, str], name: str, set_by: str = _SRUN) -> int | None:
    text = (env.get(name) or "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"{name} must be an integer. Received: {name}={text!r}. It is set by {set_by}."
        ) from None


def cluster_from_env(environ: Mapping[str, str] | None = None) -> ClusterInfo:
    """The cluster described by the environment: TF_CONFIG, Keras's, JAX's, then SLURM's.

    Keras's are ``KERAS_DISTRIBUTION_JOB_ADDRESSES`` / ``_NUM_PROCESSES`` /
    ``_PROCESS_ID`` (the JAX backend's ``keras.distribution.initialize``). JAX's are
    ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` (else the
    Indexed Job's ``JOB_COMPLETION_INDEX``), which Kubeflow Trainer's JAX runtime sets in
    each pod of a TrainJob.

    SLURM counts only inside an ``srun`` step with more than one task
    (``SLURM_STEP_NUM_TASKS`` > 1): a batch script that runs one Python process is
    not a cluster, even when the allocation has several tasks.

    Example:
        >>> cluster_from_env({}).is_multi_worker
        False
    """
    env = os.environ if environ is None else environ
    tf_config = env.get("TF_CONFIG", "")
    if tf_config.strip():
        return parse_tf_config(tf_config)
    keras_processes = _positive_env_int(env, "KERAS_DISTRIBUTION_NUM_PROCESSES")
    if keras_processes and keras_processes > 1:
        return _keras_distribution(env, keras_processes)
    jax_processes = _positive_env_int(env, "JAX_NUM_PROCESSES", _TRAINJOB)
    if jax_processes and jax_processes > 1:
        return _jax_coordinator(env, jax_processes)
    ntasks = _positive_env_int(env, "SLURM_STEP_NUM_TASKS")
    if ntasks and ntasks > 1:
        procid = _positive_env_int(env, "SLURM_PROCID") or 0
        return ClusterInfo("SLURM", {}, "worker", procid, ntasks)
    return ClusterInfo()


def _keras_distribution(env: Mapping[str, str], num_processes: int) -> ClusterInfo:
    """The cluster of Keras's own variables (``keras.distribution.initialize``'s)."""
    addresses = [a for a in env.get("KERAS_DISTRIBUTION_JOB_ADDRESSES", "").split(",") if a]
    process_id = _positive_env_int(env, "KERAS_DISTRIBUTION_PROCESS_ID") or 0
    if not addresses or not 0 <= process_id < num_processes:
        raise ConfigError(
            "KERAS_DISTRIBUTION_JOB_ADDRESSES must name the coordinator (or every process) "
            "and KERAS_DISTRIBUTION_PROCESS_ID must be in [0, KERAS_DISTRIBUTION_NUM_PROCESSES)."
            f" Received: KERAS_DISTRIBUTION_JOB_ADDRESSES="
            f"{env.get('KERAS_DISTRIBUTION_JOB_ADDRESSES')!r}, KERAS_DISTRIBUTION_PROCESS_ID="
            f"{process_id}, KERAS_DISTRIBUTION_NUM_PROCESSES={num_processes}."
        )
    return ClusterInfo(
        "KERAS_DISTRIBUTION", {"worker": tuple(addresses)}, "worker", process_id, num_processes
    )


def _jax_coordinator(env: Mapping[str, str], num_processes: int) -> ClusterInfo:
    """The cluster of JAX's own variables, as a Kubeflow TrainJob on JAX gives them.

    The process id is ``JAX_PROCESS_ID``, else ``JOB_COMPLETION_INDEX`` (the pod's index in
    its Indexed Job, which Kubernetes sets in every such pod).
    """
    address = env.get("JAX_COORDINATOR_ADDRESS", "").strip()
    source = "JAX_PROCESS_ID" if env.get("JAX_PROCESS_ID", "").strip() else "JOB_COMPLETION_INDEX"
    process_id = _positive_env_int(env, source, _TRAINJOB)
    host, _, port = address.rpartition(":")
    problems = []
    if not host or not port.isdigit():
        problems.append("JAX_COORDINATOR_ADDRESS must be the coordinator's host:port")
    if process_id is None:
        problems.append("JAX_PROCESS_ID (or JOB_COMPLETION_INDEX) must give this process's id")
    elif not 0 <= process_id < num_processes:
        problems.append(f"{source} must be in [0, JAX_NUM_PROCESSES)")
    if problems:
        raise ConfigError(
            f"{'; '.join(problems)}. Received: JAX_COORDINATOR_ADDRESS={address!r}, "
            f"JAX_NUM_PROCESSES={num_processes}, JAX_PROCESS_ID={env.get('JAX_PROCESS_ID')!r}, "
            f"JOB_COMPLETION_INDEX={env.get('JOB_COMPLETION_INDEX')!r}. Set all three (a "
            "TrainJob's JAX runtime does), or unset JAX_NUM_PROCESSES to train alone."
        )
    return ClusterInfo(
        "JAX_COORDINATOR", {"worker": (address,)}, "worker", process_id, num_processes
    )


# --------------------------------------------------------------------------- SLURM

# Where srun and sbatch name the nodes: the step's own list first (a step may use part
# of the allocation), then the job's (SLURM_NODELIST is its older name).
_SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def _split_top_level(text: str) -> list[str]:
    """``a[1,2],b`` -> ``["a[1,2]", "b"]``: commas inside brackets do not split."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(item: str, text: str) -> list[str]:
    """``07-09`` -> ``["07", "08", "09"]`` (the start's padding is kept); ``3`` -> ``["3"]``."""
    low, _, high = item.partition("-")
    if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
        raise ConfigError(
            f"SLURM host list: {item!r} is not a number or a range like 01-04. Received: {text!r}"
        )
    width = len(low)
    return [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]


def _expand_host(pattern: str, text: str) -> list[str]:
    """One host pattern, possibly with several bracket groups (``r[1-2]n[1-2]``)."""
    open_at = pattern.find("[")
    if open_at < 0:
        if "]" in pattern:
            raise ConfigError(f"SLURM host list: unbalanced ']' in {pattern!r}. Received: {text!r}")
        return [pattern]
    close_at = pattern.find("]", open_at)
    if close_at < 0:
        raise ConfigError(f"SLURM host list: unbalanced '[' in {pattern!r}. Received: {text!r}")
    inner = pattern[open_at + 1 : close_at]
    numbers = [n for item in inner.split(",") for n in _expand_range(item.strip(), text)]
    tails = _expand_host(pattern[close_at + 1 :], text)
    return [f"{pattern[:open_at]}{n}{tail}" for n in numbers for tail in tails]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list (``SLURM_STEP_NODELIST``) as host names, in order.

    Example:
        >>> expand_hostlist("node[07-08,10],gpu1")
        ['node07', 'node08', 'node10', 'gpu1']
    """
    return [host for part in _split_top_level(text) for host in _expand_host(part, text)]


def slurm_coordinator(environ: Mapping[str, str] | None = None) -> str:
    """``host:port`` of task 0 of a SLURM step: jax's coordinator (and TensorFlow's worker 0).

    The host is the first node of ``SLURM_STEP_NODELIST`` (else of the job's node list):
    srun places task 0 there. The port is ``tfdist.config.slurm_port_base``, the port
    TensorFlow's ``SlurmClusterResolver`` gives task 0 in tfdist, so the two backends
    agree on where a step's first task listens.

    Raises:
        ValueError: when no node list is set (this process was not started by srun).

    Example:
        >>> slurm_coordinator({"SLURM_STEP_NODELIST": "node[07-08]", "SLURM_JOB_ID": "40123"})
        'node07:27872'
    """
    env = os.environ if environ is None else environ
    for name in _SLURM_NODELISTS:
        hosts = expand_hostlist(env.get(name, ""))
        if hosts:
            return f"{hosts[0]}:{slurm_port_base(env)}"
    received = ", ".join(f"{name}={env.get(name)!r}" for name in _SLURM_NODELISTS)
    raise ConfigError(
        "A SLURM step with several tasks needs its node list to find task 0 (the "
        f"coordinator), and none is set. Received: {received}, SLURM_STEP_NUM_TASKS="
        f"{env.get('SLURM_STEP_NUM_TASKS')!r}. Start the tasks with `srun`, or unset "
        "SLURM_STEP_NUM_TASKS and describe the job with TF_CONFIG or KERAS_DISTRIBUTION_*."
    )


def worker_tf_config(addresses: Sequence[str], index: int, *, job: str = "worker") -> str:
    """The TF_CONFIG JSON for task ``index`` of a cluster of ``addresses``.

    Example:
        >>> worker_tf_config(["127.0.0.1:2222"], 0)
        '{"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}}'
    """
    if isinstance(addresses, str) or not addresses:
        raise ValueError(
            "worker_tf_config: addresses must be a non-empty list of 'host:port'. "
            f"Received: addresses={addresses!r}"
        )
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(addresses):
        raise ValueError(
            f"worker_tf_config: index must be an int in [0, {len(addresses)}). "
            f"Received: index={index!r}"
        )
    config = {"cluster": {job: list(addresses)}, "task": {"type": job, "index": index}}
    parse_tf_config(config)  # the launcher must never hand a worker a config TF would reject
    return json.dumps(config)
