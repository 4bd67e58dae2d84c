"""A real one-node SLURM cluster on this machine, for tests/e2e/test_slurm.py.

``start()`` finds ``munged``, ``slurmctld`` and ``slurmd`` (as root, installs the Debian
packages ``slurm-wlm munge`` when they are missing), writes a minimal ``slurm.conf`` and
a munge key into a temporary directory, starts the three daemons in the foreground (so
each is a child whose PID this module knows), and waits until ``sinfo`` shows the node
idle. ``SlurmCluster.stop()`` ends any job left behind, kills exactly those PIDs and
removes the directory. Nothing under ``/etc`` is read or written: clients find the
configuration through ``SLURM_CONF`` (``SlurmCluster.client_env()``), and the daemons
talk to this munged through the socket that ``AuthInfo`` names.

When SLURM cannot start, ``start()`` raises ``SlurmUnavailable`` with the reason and the
tail of the daemons' logs; the tests turn it into a failure, never a skip.

    cluster = start()
    try:
        print(cluster.run("sinfo").stdout)
    finally:
        cluster.stop()
"""

from __future__ import annotations

import atexit
import contextlib
import getpass
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sinfo", "srun", "sbatch", "scancel", "scontrol", "squeue")
PACKAGES = ("slurm-wlm", "munge")
# Where Debian puts the daemons; a non-root PATH often lacks the sbin directories.
_SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")


class SlurmUnavailable(RuntimeError):
    """SLURM could not be found, installed or started here; the message says why."""


@dataclass
class SlurmCluster:
    """A running one-node cluster: its files, its daemons and the clients' environment."""

    root: Path
    node: str
    cpus: int
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def client_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) for a client of this cluster: its ``SLURM_CONF``,
        the sbin directories on ``PATH``, and no ``SLURM_*`` of an enclosing job."""
        env = {
            key: value
            for key, value in (os.environ if base is None else base).items()
            if not key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))
        }
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *_SBIN])
        return env

    def run(self, *argv: str, timeout: float = 30, check: bool = True, env=None, **kwargs):
        """Runs a SLURM client command (``sinfo``, ``sbatch``, ...) against this cluster.

        ``env`` is the environment to start from (default ``os.environ``); see ``client_env``.
        """
        proc = subprocess.run(
            list(argv),
            env=self.client_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )
        if check and proc.returncode != 0:
            raise SlurmUnavailable(
                f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"
                f"{self.log_tails()}"
            )
        return proc

    def job_state(self, job_id: str) -> str:
        """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ...), '' once forgotten."""
        proc = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        match = re.search(r"\bJobState=(\S+)", proc.stdout)
        return match.group(1) if match else ""

    def job_field(self, job_id: str, name: str) -> str:
        """One ``Name=value`` field of ``scontrol show job`` ('' when absent)."""
        proc = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        match = re.search(rf"\b{name}=(\S*)", proc.stdout)
        return match.group(1) if match else ""

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float, what: str) -> str:
        """Waits until the job is in one of ``states``; fails naming ``what`` it waited for."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.25)
        raise TimeoutError(
            f"job {job_id} not {'/'.join(states)} within {timeout:.0f} s ({what}); "
            f"last state {state!r}{self.log_tails()}"
        )

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every daemon's log, for error messages."""
        parts = []
        for name in DAEMONS:
            path = self.root / "log" / f"{name}.log"
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"\n--- {path.name}\n" + "\n".join(tail))
        return "".join(parts)

    def cancel_all(self, timeout: float = 20) -> None:
        """Kills every job of this cluster and waits for their step daemons to exit.

        A step's ``slurmstepd`` outlives ``slurmd`` (SLURM lets steps survive a restart of
        the daemon), so one still there after ``timeout`` is killed by its PID.
        """
        ctld = self.daemons.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.run("scancel", "--full", "--signal=KILL", f"--user={getpass.getuser()}",
                         timeout=10, check=False)  # fmt: skip
        deadline = time.monotonic() + timeout
        while (pids := self.step_daemons()) and time.monotonic() < deadline:
            time.sleep(0.25)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Ends every job, kills the daemons this module started, removes its files (idempotent)."""
        if not self.root.exists():
            return
        self.cancel_all()
        for name in reversed(DAEMONS):  # slurmd, slurmctld, then munged
            proc = self.daemons.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.daemons.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def step_daemons(self) -> list[int]:
        """PIDs of this cluster's ``slurmstepd`` processes: those with a file under its
        directory open (a step daemon keeps the node's log open)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                # Debian's is slurmstepd-wlm
                if not os.path.basename(os.readlink(entry / "exe")).startswith("slurmstepd"):
                    continue
                fds = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
                if any(target.startswith(str(self.root)) for target in fds):
                    pids.append(int(entry.name))
        return pids


# ------------------------------------------------------------------ finding SLURM


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(_SBIN))


def find_binaries(install: bool = True) -> dict[str, str]:
    """The daemons' and clients' paths; as root, ``apt-get install`` what is missing."""
    names = DAEMONS + CLIENTS
    found = {name: _which(name) for name in names}
    missing = [name for name, path in found.items() if path is None]
    how = "install them (as root: apt-get install slurm-wlm munge)"
    if missing and install and os.geteuid() == 0 and shutil.which("apt-get"):
        _apt_install()
        found = {name: _which(name) for name in names}
        missing = [name for name, path in found.items() if path is None]
        how = f"apt-get install {' '.join(PACKAGES)} did not provide them"
    if missing:
        raise SlurmUnavailable(f"SLURM is not installed here: {missing} not found; {how}")
    return found  # type: ignore[return-value]


def _apt_install() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SlurmUnavailable(
                f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-1500:]}"
            )


# ------------------------------------------------------------------ configuration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_hardware(slurmd: str) -> tuple[int, int]:
    """(CPUs, RealMemory in MiB) as slurmd itself detects them (``slurmd -C``)."""
    proc = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30)
    cpus = re.search(r"\bCPUs=(\d+)", proc.stdout)
    memory = re.search(r"\bRealMemory=(\d+)", proc.stdout)
    if not cpus or not memory:
        raise SlurmUnavailable(f"slurmd -C printed no CPUs/RealMemory: {proc.stdout}{proc.stderr}")
    return int(cpus.group(1)), int(memory.group(1))


def slurm_conf(root: Path, node: str, cpus: int, memory_mb: int, user: str) -> str:
    """A minimal slurm.conf: one node on loopback, no cgroups, no accounting.

    ``config_overrides`` keeps the node usable when it declares more CPUs than the
    machine has (a 1-core CI runner still gets the 2 task slots the tests use).
    """
    return "\n".join(
        [
            "ClusterName=tfdist-test",
            # Job ids whose tfdist SLURM ports (20000 + id % 625 * 64, 64 per job) stay
            # below Linux's ephemeral range (32768 up), where any outgoing connection may
            # hold one (seen: "Failed to add port ... 0.0.0.0:46368"): id % 625 from 1 to
            # 100, and 98 jobs more still end below 32768 (a module runs about 30).
            # Different from one cluster to the next.
            f"FirstJobId={625 * random.randrange(1, 16) + random.randrange(1, 101)}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: how long a requeued job is held (default 120 s) before it may run;
            # 5 is SLURM's least (slurm_cred.c), and a step's credential, valid that long,
            # reaches slurmd on this one node well within it
            f"AuthInfo=socket={root / 'munge' / 'munge.socket'},cred_expire=5",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1,bf_interval=1",  # pending jobs start at once
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "KillWait=5",  # scancel / time limit: SIGTERM, then SIGKILL 5 s later
            "MinJobAge=300",
            "InactiveLimit=0",
            f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} CPUs={cpus} "
            f"RealMemory={memory_mb} State=UNKNOWN",
            f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


# ------------------------------------------------------------------ starting


def start(timeout: float = 60, progress=print) -> SlurmCluster:
    """Starts munged, slurmctld and slurmd; returns once ``sinfo`` shows the node idle."""
    paths = find_binaries()
    node = socket.gethostname().split(".")[0]  # hostname -s
    try:  # the tasks find each other by the node's name (SLURM_STEP_NODELIST)
        socket.gethostbyname(node)
    except OSError as err:
        raise SlurmUnavailable(f"this host's name {node!r} does not resolve ({err})") from None
    cpus, memory = _node_hardware(paths["slurmd"])
    cpus = max(cpus, 2)
    root = Path(tempfile.mkdtemp(prefix="tfdist-slurm-"))
    root.chmod(0o755)  # munged wants every user able to reach its socket
    for sub in ("munge", "state", "spool", "run", "log"):
        (root / sub).mkdir(mode=0o755 if sub == "munge" else 0o700)
    (root / "slurm.conf").write_text(slurm_conf(root, node, cpus, memory, getpass.getuser()))
    cluster = SlurmCluster(root, node, cpus)
    atexit.register(cluster.stop)  # also when the test session ends without teardown
    try:
        _start_munged(cluster, paths["munged"])
        _start_daemon(cluster, "slurmctld", [paths["slurmctld"], "-D", "-i"])
        _start_daemon(cluster, "slurmd", [paths["slurmd"], "-D", "-N", node])
        _wait_idle(cluster, timeout, progress)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start_daemon(cluster: SlurmCluster, name: str, argv: list[str]) -> None:
    log = open(cluster.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - the child owns it
    with log:
        cluster.daemons[name] = subprocess.Popen(
            argv,
            env=cluster.client_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _start_munged(cluster: SlurmCluster, munged: str) -> None:
    munge = cluster.root / "munge"
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    _start_daemon(
        cluster,
        "munged",
        [
            munged,
            "--foreground",
            f"--key-file={key}",
            f"--socket={munge / 'munge.socket'}",
            f"--pid-file={cluster.root / 'run' / 'munged.pid'}",
            f"--log-file={cluster.root / 'log' / 'munged.log'}",
            f"--seed-file={munge / 'munge.seed'}",
            "--num-threads=2",
        ],
    )
    deadline = time.monotonic() + 15
    while not (munge / "munge.socket").exists():
        if cluster.daemons["munged"].poll() is not None or time.monotonic() > deadline:
            out = (cluster.root / "log" / "munged.out").read_text(errors="replace")
            raise SlurmUnavailable(f"munged did not start: {out.strip()}{cluster.log_tails()}")
        time.sleep(0.1)


def _wait_idle(cluster: SlurmCluster, timeout: float, progress) -> None:
    """Waits until the node is idle, saying what it waits for every few seconds."""
    start = time.monotonic()
    last_said = start
    state = "no answer yet"
    while time.monotonic() - start < timeout:
        for name, proc in cluster.daemons.items():
            if proc.poll() is not None:
                out = (cluster.root / "log" / f"{name}.out").read_text(errors="replace")
                raise SlurmUnavailable(
                    f"{name} exited {proc.returncode} while starting: {out.strip()[-1500:]}"
                    f"{cluster.log_tails()}"
                )
        proc = cluster.run("sinfo", "-h", "-N", "-o", "%T", timeout=10, check=False)
        state = (proc.stdout.strip() or proc.stderr.strip() or "no answer")[-300:]
        if proc.returncode == 0 and state == "idle":
            return
        if time.monotonic() - last_said >= 5:
            last_said = time.monotonic()
            progress(f"slurm: waiting for node {cluster.node} to be idle: {state}")
        time.sleep(0.25)
    raise SlurmUnavailable(
        f"node {cluster.node} not idle within {timeout:.0f} s (sinfo: {state}){cluster.log_tails()}"
    )


@contextlib.contextmanager
def running(timeout: float = 60, progress=print) -> Iterator[SlurmCluster]:
    """``start()`` ... ``stop()`` as a context manager."""
    cluster = start(timeout, progress)
    try:
        yield cluster
    finally:
        cluster.stop()
