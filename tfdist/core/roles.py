"""Who this process is in the job: its rank, whether it is the chief, how many take part.

Every layer asks here; nothing else decides it (``tests/project/test_structure.py`` checks).
The answer has two sources, which agree once a job has started:

* the cluster environment (``TF_CONFIG``, ``KERAS_DISTRIBUTION_*``, ``JAX_COORDINATOR_*``,
  SLURM), read by ``tfdist.core.cluster`` before any framework starts: ``from_env``. The
  chief is task 0 of the ``chief`` job, or worker 0 without one, or the only process
  without a cluster; the rank counts the training tasks, chief first.
* a running JAX job's own numbering (``jax.process_index()`` / ``jax.process_count()``),
  which ``jax.distributed`` gives each process: ``jax_process``. Process 0 is the chief.

Example:
    >>> from_env({})
    Role(is_chief=True, rank=0, count=1)
    >>> from_env({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"}).rank
    2
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tfdist.core import cluster

__all__ = ["Role", "from_env", "of_cluster", "jax_process", "is_chief"]


@dataclass(frozen=True)
class Role:
    """This process's place in the job.

    Attributes:
        is_chief: True for the one process that does the one-off work (files, logs).
        rank: this process's index among the training processes (0 for the chief).
        count: the number of training processes (1 on one machine).
    """

    is_chief: bool = True
    rank: int = 0
    count: int = 1


def of_cluster(info: cluster.ClusterInfo) -> Role:
    """The role ``info`` (a parsed cluster environment) gives this process.

    Example:
        >>> of_cluster(cluster.ClusterInfo())
        Role(is_chief=True, rank=0, count=1)
    """
    return Role(is_chief=info.is_chief, rank=info.rank, count=info.num_workers)


def from_env(environ: Mapping[str, str] | None = None) -> Role:
    """This process's role from the cluster environment (``os.environ`` by default).

    Example:
        >>> from_env({}).is_chief
        True
    """
    return of_cluster(cluster.cluster_from_env(environ))


def is_chief(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is the chief of its cluster (True without a cluster).

    Example:
        >>> is_chief({})
        True
    """
    return from_env(environ).is_chief


def jax_process() -> Role:
    """This process's role in a JAX job, as jax numbers it (one process without a job).

    Example:
        >>> jax_process()  # process 1 of 2  # doctest: +SKIP
        Role(is_chief=False, rank=1, count=2)
    """
    import jax

    rank = jax.process_index()
    return Role(is_chief=rank == 0, rank=rank, count=jax.process_count())
