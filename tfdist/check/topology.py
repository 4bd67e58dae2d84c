"""The topologies ``tfdist check`` compares, and the command that runs the script on each.

A topology is a count and a kind: ``1 device`` (the reference, ``TFDIST_CPU_DEVICES=1``),
``N devices`` (one process, ``TFDIST_CPU_DEVICES=N``), ``N workers`` (TensorFlow) or ``N
processes`` (JAX): N processes of one device each, started by ``tfdist launch -n N``,
exactly as a user would start them.

Example:
    >>> parse_topologies("1 device, 2-devices,2workers", "tensorflow")
    (Topology(count=1, kind='device'), Topology(count=2, kind='device'), Topology(count=2, kind='worker'))
    >>> str(Topology(2, "worker").named("jax"))
    '2 processes'
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from tfdist.core.config import ConfigError, launch_python

__all__ = ["DEFAULTS", "Topology", "parse_topologies", "command"]

_PATTERN = re.compile(r"(\d+)\s*[-_ ]?\s*(devices?|workers?|process(?:es)?)")


@dataclass(frozen=True)
class Topology:
    """``count`` devices of one process (``kind="device"``) or ``count`` launched processes."""

    count: int
    kind: str  # "device" or "worker"
    backend: str = "tensorflow"

    def named(self, backend: str) -> Topology:
        return Topology(self.count, self.kind, backend)

    def __str__(self) -> str:
        word = "device" if self.kind == "device" else "worker"
        if self.kind == "worker" and self.backend == "jax":
            word = "process"
        plural = {"device": "devices", "worker": "workers", "process": "processes"}[word]
        return f"{self.count} {word if self.count == 1 else plural}"

    def __repr__(self) -> str:
        return f"Topology(count={self.count}, kind={self.kind!r})"

    @property
    def is_reference(self) -> bool:
        return self.count == 1 and self.kind == "device"


DEFAULTS = "1 device,2 devices,2 workers"


def parse_topologies(text: str, backend: str) -> tuple[Topology, ...]:
    """``"1 device,2 devices,2 workers"`` as topologies; ``1 device`` always comes first."""
    found = []
    for item in (part.strip() for part in text.split(",")):
        match = _PATTERN.fullmatch(item.lower())
        if not match or int(match.group(1)) < 1:
            raise ConfigError(
                "check: --topologies must be a comma-separated list of 'N devices', "
                f"'N workers' or 'N processes' (N >= 1). Received: {item!r} in "
                f"--topologies={text!r}. Example: --topologies '1 device,2 devices,2 workers'."
            )
        kind = "device" if match.group(2).startswith("device") else "worker"
        topology = Topology(int(match.group(1)), kind, backend)
        if topology.count == 1 and kind == "worker":
            topology = Topology(1, "device", backend)  # one worker is one device
        if topology not in found:
            found.append(topology)
    reference = Topology(1, "device", backend)
    return (reference, *(t for t in found if t != reference))


def command(topology: Topology, script: str, args: tuple[str, ...]) -> tuple[list[str], dict]:
    """``(argv, environment additions)`` that run ``script`` on ``topology``.

    One process runs under the interpreter ``tfdist launch`` gives its workers
    (``TFDIST_LAUNCH_PYTHON``, else this one), so that every topology's script runs
    under the same Python.
    """
    # Every run is told its devices, one per worker: a script that picks its own when
    # none are set (os.environ.setdefault("TFDIST_CPU_DEVICES", "2"), a notebook's habit)
    # then runs on the topology's, not on its own.
    if topology.kind == "worker":
        argv = [sys.executable, "-m", "tfdist", "launch", "-n", str(topology.count)]
        return [*argv, script, *args], {"TFDIST_CPU_DEVICES": "1"}
    env = {"TFDIST_CPU_DEVICES": str(topology.count)}
    return [launch_python(), "-m", "tfdist.bootstrap", script, *args], env
