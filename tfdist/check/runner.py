"""Runs the user's script on one topology, with a timeout, and reads what its processes wrote.

Each run gets its own folder, which ``tfdist.check.hook`` fills in every process:
``rank-R.json`` and ``rank-R.npz`` (the result), ``rank-R.progress`` (how far it got),
``rank-R.stack`` (every thread's stack, written just before the timeout) and
``output.log`` (the run's whole output). A run whose processes all wrote their result is
done, whatever its exit code: the hook ends them with ``os._exit`` and a JAX process may
report its peers' exit.

Example:
    >>> run = run_topology(Topology(2, "device"), "train.py", (), steps=5, timeout=120,
    ...                    backend="tensorflow", folder=Path("/tmp/check"))  # doctest: +SKIP
    >>> run.status, sorted(run.ranks)                                          # doctest: +SKIP
    ('done', [0])
"""

from __future__ import annotations

import io
import json
import linecache
import os
import re
import signal
import subprocess
import time
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tfdist.check import hook
from tfdist.check.topology import Topology, command
from tfdist.core.cluster import worker_tf_config
from tfdist.launch.environment import free_ports
from tfdist.launch.options import LOOPBACK

__all__ = ["GLOBAL_BATCH", "Rank", "Run", "VARIANTS", "excerpt", "run_topology"]

_STOP_GRACE_S = 5.0
# Variables of the caller's shell that would change what a run is (its cluster, its devices).
_CLEARED = ("TF_CONFIG", "TFDIST_CPU_DEVICES", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID")
# A re-run's variant -> the variable that asks the hook for it (a cause's evidence).
VARIANTS = {
    "sync_batchnorm": hook.SYNC_BN_ENV,  # every BatchNormalization synchronized
    "inert_random": hook.INERT_RANDOM_ENV,  # every random layer drawing nothing
}
GLOBAL_BATCH = "global_batch:"  # + N: fit's input batched at a global batch of N


@dataclass
class Rank:
    """What one process wrote: facts (steps, history, BatchNormalization layers) and weights."""

    facts: dict
    final: dict[str, np.ndarray]
    initial: dict[str, np.ndarray]
    first: dict[str, np.ndarray] = field(default_factory=dict)  # after the first step


@dataclass
class Run:
    """One topology's run: ``status`` is ``done``, ``timeout``, ``failed`` or ``no-fit``."""

    topology: Topology
    seconds: float
    status: str
    returncode: int | None
    ranks: dict[int, Rank] = field(default_factory=dict)
    progress: dict[int, dict] = field(default_factory=dict)
    waiting_at: dict[int, str] = field(default_factory=dict)  # rank -> "file:line: code"
    output: str = ""
    variant: str = ""  # "", a key of VARIANTS, or GLOBAL_BATCH + N
    one_worker: bool = False  # one process run with a TF_CONFIG of one worker

    @property
    def reads_tf_config(self) -> bool:
        """It failed on reading TF_CONFIG, which a one-process run is not given."""
        return self.status == "failed" and "KeyError: 'TF_CONFIG'" in self.output


def _environment(topology: Topology, folder: Path, steps: int, timeout: float, variant: str):
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(
        {
            "KERAS_BACKEND": topology.backend,
            "PYTHONUNBUFFERED": "1",
            # This machine's CPU for every run, GPUs or not: the same devices each time.
            "CUDA_VISIBLE_DEVICES": "",
            "JAX_PLATFORMS": "cpu",
            hook.DIR_ENV: str(folder),
            hook.STEPS_ENV: str(steps),
            # A moment before the check stops it: the stacks say where it waits.
            hook.STACK_AFTER_ENV: str(max(timeout - 3.0, 1.0)),
        }
    )
    for name in (*VARIANTS.values(), hook.GLOBAL_BATCH_ENV):
        env.pop(name, None)  # the caller's shell asks for no variant
    if variant.startswith(GLOBAL_BATCH):
        env[hook.GLOBAL_BATCH_ENV] = variant[len(GLOBAL_BATCH) :]
    elif variant:
        env[VARIANTS[variant]] = "1"
    return env


def run_topology(
    topology: Topology,
    script: str,
    args: tuple[str, ...],
    *,
    steps: int,
    timeout: float,
    folder: Path,
    variant: str = "",
    one_worker: bool = False,
) -> Run:
    """Runs ``script`` on ``topology`` until its first ``fit`` (or its custom loop) did
    ``steps`` steps.

    ``variant``: "" (the script as it is) or a key of ``VARIANTS`` (a re-run for a cause).
    ``one_worker``: a one-process topology is given a TF_CONFIG of one worker on a free
    loopback port (``Run.reads_tf_config``: a script written for workers only); the
    workers of ``N workers`` get theirs from ``tfdist launch`` whatever it is.
    """
    batch = variant[len(GLOBAL_BATCH) :] if variant.startswith(GLOBAL_BATCH) else None
    if variant and variant not in VARIANTS and not (batch and batch.isdigit() and int(batch)):
        raise ValueError(
            f"run_topology: variant must be '', one of {sorted(VARIANTS)} or "
            f"'{GLOBAL_BATCH}N' (N > 0). Received: variant={variant!r}."
        )
    folder.mkdir(parents=True, exist_ok=True)
    argv, extra = command(topology, os.path.abspath(script), args)
    env = {**_environment(topology, folder, steps, timeout, variant), **extra}
    one_worker = one_worker and topology.kind == "device"
    if one_worker:
        env["TF_CONFIG"] = worker_tf_config([f"{LOOPBACK}:{free_ports(1)[0]}"], 0)
    started = time.monotonic()
    with open(folder / "output.log", "w") as log:
        proc = subprocess.Popen(
            argv,
            cwd=_working_directory(folder / "work"),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        returncode, timed_out = _wait(proc, timeout)
    run = Run(topology, time.monotonic() - started, "done", returncode)
    run.variant, run.one_worker = variant, one_worker
    _collect(run, folder, script)
    if len(run.ranks) < _processes(topology):
        run.status = "timeout" if timed_out else _why_no_result(run)
    return run


def _working_directory(work: Path) -> Path:
    """A folder of its own for the run, with a link to every entry of the current one.

    The script reads its files by the paths it always uses; what it creates (a ``ckpt/``,
    a saved model) lands in this run's folder, so no run resumes from another's
    checkpoints. Entries that already exist are shared (the links point at them).
    """
    work.mkdir(parents=True, exist_ok=True)
    here = Path.cwd()
    for entry in here.iterdir():
        link = work / entry.name
        if work.resolve().is_relative_to(entry.resolve()):
            continue  # the check's own folder (--keep DIR under the current one)
        if not link.exists():
            link.symlink_to(entry)
    return work


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int | None, bool]:
    """The exit code and whether it timed out; a run past ``timeout`` is stopped, all of it."""
    try:
        return proc.wait(timeout), False
    except subprocess.TimeoutExpired:
        pass
    for sig, grace in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)  # the launcher and its workers: one session
        except ProcessLookupError:
            break
        try:
            proc.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue
    return proc.returncode, True


def _processes(topology: Topology) -> int:
    return topology.count if topology.kind == "worker" else 1


def _why_no_result(run: Run) -> str:
    if any(p.get("state") in ("fit", "loop", "done") for p in run.progress.values()):
        return "failed"  # it reached fit or its loop, and then a process died
    if run.returncode == 0:
        return "no-fit"  # it ended without a fit or a loop the hook could count
    return "failed"


def _collect(run: Run, folder: Path, script: str) -> None:
    for rank in range(_processes(run.topology)):
        progress = folder / f"rank-{rank}.progress"
        if progress.exists():
            run.progress[rank] = json.loads(progress.read_text() or "{}")
        where = _waiting_at(folder / f"rank-{rank}.stack", script)
        if where:
            run.waiting_at[rank] = where
        result = folder / f"rank-{rank}.json"
        if result.exists():
            with np.load(folder / f"rank-{rank}.npz") as arrays:
                final = {k[6:]: arrays[k] for k in arrays.files if k.startswith("final/")}
                initial = {k[8:]: arrays[k] for k in arrays.files if k.startswith("initial/")}
                first = {k[6:]: arrays[k] for k in arrays.files if k.startswith("first/")}
            run.ranks[rank] = Rank(json.loads(result.read_text()), final, initial, first)
    run.output = (folder / "output.log").read_text(errors="replace")[-4000:]


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# A Keras progress bar ("1/16 ━━━━ 0s 5ms/step - loss: 1.2") and its redraws.
_PROGRESS = re.compile(r"━|^(Epoch )?\d+/\d+(\s|$)")
# The line that names an exception: "ValueError: ...", "jax.errors.JaxRuntimeError: ...".
_ERROR = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)|Traceback)\b")


def excerpt(output: str, count: int = 3) -> list[str]:
    """The last ``count`` lines of a run's output a person needs: ANSI colour codes and
    Keras progress-bar lines left out, and the exception's own lines (its type and
    message) kept when they lie further up."""
    lines = []
    for raw in output.replace("\r", "\n").splitlines():
        line = _ANSI.sub("", raw).strip()
        if line and not _PROGRESS.search(line):
            lines.append(line)
    errors = [i for i, line in enumerate(lines) if _ERROR.match(line)]
    tail = lines[-count:]
    if errors and errors[-1] < len(lines) - count:
        tail = [lines[errors[-1]], "...", *tail] if count > 1 else [lines[errors[-1]]]
    return tail


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def _waiting_at(stack: Path, script: str) -> str | None:
    """The innermost line of the script in a faulthandler dump, with its code."""
    if not stack.exists():
        return None
    wanted = os.path.realpath(script)
    for match in _FRAME.finditer(stack.read_text(errors="replace")):
        if os.path.realpath(match["file"]) == wanted:
            line = int(match["line"])
            code = _without_comment(linecache.getline(wanted, line).strip())
            return f"{os.path.basename(script)}:{line}: {code}"
    return None


def _without_comment(code: str) -> str:
    """``code`` without its trailing ``# comment`` (a ``#`` inside a string stays)."""
    try:
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            if token.type == tokenize.COMMENT:
                return code[: token.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):
        pass  # a line that does not tokenize alone (an open bracket): shown whole
    return code
