"""Kubernetes pods on this machine, for tests/e2e/test_kubernetes.py: what each pod of a job gets.

Two halves:

* The environment an operator gives each pod, as pure functions of the job's manifest
  (``tfjob_pods``, ``trainjob_pods``), following the operators' own code (named in each
  function's docstring).
* ``Cluster``: each pod is a network namespace (a veth pair to a bridge in a "node"
  namespace, an address in 10.218.0.0/24), with its own host name (a UTS namespace) and
  an ``/etc/hosts`` that gives the job's DNS names (a mount namespace in which a
  generated file is bind-mounted over ``/etc/hosts``, as kubelet mounts its own). The pod's
  process starts with only the operator's environment (plus the venv's ``PATH``,
  ``PYTHONPATH``, ``TFDS_DATA_DIR``, ``TFDIST_CPU_DEVICES``). A pod whose process exits
  non-zero is restarted as kubelet restarts a container under ``restartPolicy:
  OnFailure``: the same pod (name, address, environment) and kubelet's back-off (a
  test may shorten it: ``Cluster``'s ``backoff_scale``).
  ``Cluster.wait_jobset`` restarts a TrainJob as JobSet does: new pods for the whole job.

Every namespace, veth, bridge, mount and process created here is removed by
``Cluster.remove()`` (the mounts live in the pods' own mount namespaces and end with
their processes); needs root and iproute2.

    with running(pods) as cluster:
        cluster.start_all()
        cluster.wait_done(timeout=300)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.218.0"  # the pods' private network; nothing outside these namespaces uses it
_IP_TIMEOUT_S = 30

# What kubelet gives every container of a pod in a namespace with the API server's
# service (enableServiceLinks, pkg/kubelet/kubelet_pods.go getServiceEnvVarMap): the
# `kubernetes` service's variables. The headless services of a job add none.
KUBERNETES_SERVICE = {
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "KUBERNETES_SERVICE_PORT": "443",
    "KUBERNETES_SERVICE_PORT_HTTPS": "443",
    "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    "KUBERNETES_PORT_443_TCP": "tcp://10.96.0.1:443",
    "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
    "KUBERNETES_PORT_443_TCP_PORT": "443",
    "KUBERNETES_PORT_443_TCP_ADDR": "10.96.0.1",
}

# kubelet's container restart back-off (pkg/kubelet/kubelet.go: backOffPeriod 10 s,
# MaxContainerBackOff 300 s; kuberuntime_manager.go doBackOff): the first restart is
# immediate, then 10 s, 20 s, 40 s ... after each further exit, at most 300 s.
BACKOFF_INITIAL_S = 10.0
BACKOFF_MAX_S = 300.0


def restart_delay(restarts_so_far: int, scale: float = 1.0) -> float:
    """kubelet's wait before restarting a container that already restarted this often,
    times ``scale`` (``Cluster``'s ``backoff_scale``: 1 is kubelet's own)."""
    if restarts_so_far <= 0:
        return 0.0
    return scale * min(BACKOFF_INITIAL_S * 2 ** (restarts_so_far - 1), BACKOFF_MAX_S)


@dataclass
class Pod:
    """One pod: its name, host name, address, the DNS names that resolve to it, its
    command and the environment its container gets."""

    name: str
    hostname: str
    address: str
    dns_names: tuple[str, ...]
    command: list[str]
    env: dict[str, str]
    restart_policy: str = "OnFailure"
    subdomain_fqdn: str | None = None  # kubelet's hosts line for a pod with a subdomain
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    exit_times: list[float] = field(default_factory=list)  # time.monotonic() of each exit
    labels: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None


# ------------------------------------------------------------------ the operators' env


def _container(template: Mapping, name: str | None) -> Mapping:
    containers = template["spec"]["containers"]
    if name is None:
        return containers[0]
    found = [c for c in containers if c["name"] == name]
    if not found:
        raise ValueError(f"no container named {name!r} in {[c['name'] for c in containers]}")
    return found[0]


def _manifest_env(container: Mapping) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def _pod(name: str, dns_name: str, container: Mapping, env: dict, restart_policy: str,
         subdomain_fqdn: str | None = None) -> Pod:  # fmt: skip
    """A pod named (and host-named, as both operators do) ``name``, running the
    container's ``command`` + ``args``; its address is given when the cluster is built."""
    command = [*container.get("command", []), *container.get("args", [])]
    return Pod(name, name, "", (dns_name,), command, env, restart_policy, subdomain_fqdn)


def tfjob_pods(tfjob: Mapping, namespace: str = "default") -> list[Pod]:
    """The pods kubeflow training-operator creates for a TFJob, with their environment.

    From ``pkg/controller.v1/tensorflow/tfjob_controller.go`` (``SetClusterSpec``:
    ``TF_CONFIG`` only in the container named ``tensorflow``, only when the job has
    more than one replica) and ``tensorflow.go`` (``genClusterSpec``: each replica's
    address is its headless service ``<job>-<type>-<index>.<namespace>.svc`` and the port
    of the container port named ``tfjob-port``, default 2222; ``genTFConfigJSONStr``:
    ``{"cluster": ..., "task": {"type": <type>, "index": i}, "environment": "cloud"}``).
    The pod is named ``<job>-<type>-<index>`` (its host name; no subdomain).
    """
    name = tfjob["metadata"]["name"]
    specs = tfjob["spec"]["tfReplicaSpecs"]
    cluster, ports = {}, {}
    for rtype, spec in specs.items():
        container = _container(spec["template"], "tensorflow")
        named = [p for p in container.get("ports", []) if p.get("name") == "tfjob-port"]
        ports[rtype] = int(named[0]["containerPort"]) if named else 2222
        rt = rtype.lower()
        cluster[rt] = [
            f"{name}-{rt}-{i}.{namespace}.svc:{ports[rtype]}" for i in range(spec["replicas"])
        ]
    distributed = sum(spec["replicas"] for spec in specs.values()) > 1
    pods = []
    for rtype, spec in specs.items():
        container = _container(spec["template"], "tensorflow")
        for i in range(spec["replicas"]):
            pod_name = f"{name}-{rtype.lower()}-{i}"
            env = {**_manifest_env(container), **KUBERNETES_SERVICE, "HOSTNAME": pod_name}
            if distributed:
                task = {"type": rtype.lower(), "index": i}
                env["TF_CONFIG"] = json.dumps(
                    {"cluster": cluster, "task": task, "environment": "cloud"}
                )
            policy = spec.get("restartPolicy", "Never")
            pods.append(_pod(pod_name, f"{pod_name}.{namespace}.svc", container, env, policy))
    return pods


# Kubeflow Trainer v2's JAX runtime (the `jax-distributed` ClusterTrainingRuntime, plugin
# pkg/runtime/framework/plugins/jax/jax.go): one JobSet whose replicated job `node` is an
# Indexed Job of numNodes pods. The port is the runtime's trainer port.
TRAINJOB_PORT = 6666


# JobSet's restarts, written from memory of JobSet (jobset.sigs.k8s.io,
# pkg/controllers/jobset_controller.go, its webhook's defaults) and of the Kubernetes Job
# controller, not checked against their source here. A TrainJob is a JobSet; its
# replicated job ``node`` is one Indexed Job. The Job fails when its failures exceed
# ``backoffLimit`` (failed pods under ``restartPolicy: Never``, container restarts under
# ``OnFailure``, JobSet's default) and then deletes its pods that still run (kubelet:
# SIGTERM, SIGKILL after the pod's grace period). A failed child Job fails the JobSet
# unless ``failurePolicy.maxRestarts`` allows a restart: JobSet deletes all its child Jobs
# and creates them again (new pods: same names, same environment, JAX_PROCESS_ID and
# JOB_COMPLETION_INDEX included), the attempt counted in this label. Not modelled: a new
# pod's new address (here it keeps its namespace and address; the job only uses the DNS
# names, which stay), the controllers' latency (here at most 0.25 s), the API objects.
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
TERMINATION_GRACE_S = 30.0  # a pod's default terminationGracePeriodSeconds


@dataclass(frozen=True)
class JobSetPolicy:
    """A JobSet's ``failurePolicy.maxRestarts`` and its child Job's ``backoffLimit``."""

    max_restarts: int
    backoff_limit: int
    restart_policy: str  # the pods'


def jobset_policy(runtime: Mapping | None, replicated_job: str = "node") -> JobSetPolicy:
    """The restart policy of a ``TrainingRuntime``'s JobSet (``None``: the defaults, no
    restart, the Job's ``backoffLimit`` 6, ``restartPolicy: OnFailure``)."""
    jobset = (runtime or {}).get("spec", {}).get("template", {}).get("spec", {})
    found = [r for r in jobset.get("replicatedJobs", []) if r["name"] == replicated_job]
    job = found[0]["template"]["spec"] if found else {}
    return JobSetPolicy(
        max_restarts=int(jobset.get("failurePolicy", {}).get("maxRestarts", 0)),
        backoff_limit=int(job.get("backoffLimit", 6)),
        restart_policy=job.get("template", {}).get("spec", {}).get("restartPolicy", "OnFailure"),
    )


def trainjob_pods(trainjob: Mapping, namespace: str = "default", runtime: Mapping | None = None
                  ) -> list[Pod]:  # fmt: skip
    """The pods of a Kubeflow Trainer TrainJob on the ``jax-distributed`` runtime (or
    ``runtime``, a ``TrainingRuntime`` like it: its pods' restart policy).

    JobSet (``jobset.sigs.k8s.io``, ``pkg/controllers/jobset_controller.go``) names the
    replicated job ``node``'s pods ``<trainjob>-node-0-<i>``, gives them host name = pod
    name and subdomain ``<trainjob>`` (its headless service), so each is
    ``<trainjob>-node-0-<i>.<trainjob>`` from the namespace's search path. The Indexed
    Job sets ``JOB_COMPLETION_INDEX=i``; the JAX plugin sets ``JAX_NUM_PROCESSES``
    (numNodes), ``JAX_PROCESS_ID`` (the completion index) and
    ``JAX_COORDINATOR_ADDRESS`` (pod 0 at ``TRAINJOB_PORT``).
    """
    name = trainjob["metadata"]["name"]
    trainer = trainjob["spec"]["trainer"]
    nodes = int(trainer.get("numNodes", 1))
    coordinator = f"{name}-node-0-0.{name}:{TRAINJOB_PORT}"
    pods = []
    for i in range(nodes):
        pod_name = f"{name}-node-0-{i}"
        env = {**_manifest_env(trainer), **KUBERNETES_SERVICE}
        env.update(
            HOSTNAME=pod_name,
            JOB_COMPLETION_INDEX=str(i),
            JAX_NUM_PROCESSES=str(nodes),
            JAX_PROCESS_ID=str(i),
            JAX_COORDINATOR_ADDRESS=coordinator,
        )
        fqdn = f"{pod_name}.{name}.{namespace}.svc.cluster.local"
        policy = jobset_policy(runtime).restart_policy
        pods.append(_pod(pod_name, f"{pod_name}.{name}", trainer, env, policy, fqdn))
        pods[-1].labels[RESTART_ATTEMPT] = "0"
    return pods


# ------------------------------------------------------------------ the namespaces


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


def hosts_file(pod: Pod, pods: Sequence[Pod]) -> str:
    """The pod's /etc/hosts: kubelet's (``pkg/kubelet/kubelet_pods.go``
    ``managedHostsFileContent``) plus the job's service names that cluster DNS would
    answer (headless services: the pods' own addresses)."""
    own = (
        f"{pod.address}\t{pod.subdomain_fqdn}\t{pod.hostname}"
        if pod.subdomain_fqdn
        else (f"{pod.address}\t{pod.hostname}")
    )
    lines = [
        "# Kubernetes-managed hosts file.",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        own,
        "# The job's service names, as the cluster's DNS answers them:",
        *(f"{p.address}\t{' '.join(p.dns_names)}" for p in pods),
    ]
    return "\n".join(lines) + "\n"


# Runs in the pod's new UTS and mount namespaces: its host name, its /etc/hosts, then
# the container's command (exec: the Popen's pid is the command's own).
_ENTER = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'


class Cluster:
    """The pods' namespaces, their processes, and kubelet's restarts.

    ``backoff_scale`` multiplies kubelet's restart back-off (``restart_delay``): 1 waits
    as kubelet does (10 s, 20 s, ...); a test whose claim is that the pods are restarted
    and resume, not how long kubelet waits first, may shorten it (0.1: 1 s, 2 s, ...).
    The order of the restarts is kubelet's either way.
    """

    def __init__(self, pods: Sequence[Pod], workdir: Path, host_env: Mapping[str, str],
                 backoff_scale: float = 1.0):  # fmt: skip
        if backoff_scale <= 0:
            raise ValueError(
                f"backoff_scale must be positive. Received: backoff_scale={backoff_scale}"
            )
        self.backoff_scale = backoff_scale
        self.pods = list(pods)
        self.workdir = workdir
        self.host_env = dict(host_env)  # PATH, PYTHONPATH, TFDS_DATA_DIR, ...
        tag = f"k{os.getpid() % 100000}"
        self.node_ns = f"tfdist{tag}node"
        self.ns = {p.name: f"tfdist{tag}p{i}" for i, p in enumerate(self.pods)}
        self.created: list[str] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.supervisors: list[threading.Thread] = []
        self.logs = {p.name: workdir / f"{p.name}.log" for p in self.pods}
        for i, pod in enumerate(self.pods):
            pod.address = f"{SUBNET}.{i + 10}"

    def build(self) -> None:
        """The node's bridge and one namespace per pod, linked by a veth pair."""
        _ip("netns", "add", self.node_ns)
        self.created.append(self.node_ns)
        _ip("-n", self.node_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.node_ns, "link", "set", "br0", "up")
        for i, pod in enumerate(self.pods):
            ns = self.ns[pod.name]
            _ip("netns", "add", ns)
            self.created.append(ns)
            veth = f"veth{i}"
            _ip("-n", self.node_ns, "link", "add", veth, "type", "veth", "peer", "name",
                "eth0", "netns", ns)  # fmt: skip
            _ip("-n", self.node_ns, "link", "set", veth, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{pod.address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            (self.workdir / f"{pod.name}.hosts").write_text(hosts_file(pod, self.pods))

    def argv(self, pod: Pod, command: Sequence[str] | None = None) -> list[str]:
        """The host-side command line that runs ``command`` (default the pod's) in the pod."""
        hosts = str(self.workdir / f"{pod.name}.hosts")
        return [
            "ip", "netns", "exec", self.ns[pod.name],
            "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", _ENTER, "enter", pod.hostname, hosts, *(command or pod.command),
        ]  # fmt: skip

    def pod_env(self, pod: Pod) -> dict[str, str]:
        return {**self.host_env, **pod.env}

    def exec(self, pod: Pod, command: Sequence[str], timeout: float = 60):
        """``kubectl exec``: runs ``command`` in the pod (its namespaces, its environment)."""
        return subprocess.run(
            self.argv(pod, command), env=self.pod_env(pod), capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip

    def _spawn(self, pod: Pod) -> None:
        with open(self.logs[pod.name], "a") as log:
            attempt = pod.labels.get(RESTART_ATTEMPT, "")
            log.write(
                f"--- start {pod.restarts} of {pod.name} {attempt and 'attempt ' + attempt}\n"
            )
            log.flush()
            pod.proc = subprocess.Popen(
                self.argv(pod), env=self.pod_env(pod), cwd=self.workdir,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def _supervise(self, pod: Pod) -> None:
        """kubelet for one container: restart on failure (OnFailure) with its back-off."""
        while True:
            code = pod.proc.wait()
            with self.lock:
                pod.exit_codes.append(code)
                pod.exit_times.append(time.monotonic())
                if self.stopping.is_set() or code == 0 or pod.restart_policy == "Never":
                    return
            if self.stopping.wait(restart_delay(pod.restarts, self.backoff_scale)):
                return
            with self.lock:
                if self.stopping.is_set():
                    return
                pod.restarts += 1
                self._spawn(pod)

    def start_all(self) -> None:
        for pod in self.pods:
            with self.lock:
                self._spawn(pod)
            thread = threading.Thread(target=self._supervise, args=(pod,), daemon=True)
            thread.start()
            self.supervisors.append(thread)

    def pod(self, name: str) -> Pod:
        return next(p for p in self.pods if p.name == name)

    def signal(self, name: str, signum: int) -> int:
        """Sends ``signum`` to the pod's process (SIGTERM: what kubelet sends a container
        it stops, on preemption or eviction; SIGKILL: an OOM kill); returns its pid."""
        pid = self.pod(name).proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
        return pid

    def wait_done(self, timeout: float, backoff_limit: int | None = None) -> dict[str, int]:
        """Waits until every pod succeeded, or the job failed, or ``timeout``; returns each
        pod's last exit code.

        The job fails as training-operator's ``PastBackoffLimit``
        (``pkg/controller.v1/common/job.go``) decides: the restart counts of the
        containers of all its OnFailure/Always pods, summed, reach ``backoff_limit``
        (``runPolicy.backoffLimit``; any restart when it is 0). None: no limit.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                done = all(p.exit_codes and p.exit_codes[-1] == 0 for p in self.pods)
                restarts = sum(p.restarts for p in self.pods)
            if done:
                break
            if backoff_limit is not None and restarts >= max(backoff_limit, 1):
                self.stop()
                raise RuntimeError(f"the job failed: {restarts} restarts > {backoff_limit}"
                                   f"{self.log_tails()}")  # fmt: skip
            time.sleep(0.25)
        else:
            raise TimeoutError(f"the pods did not all succeed in {timeout:.0f} s{self.log_tails()}")
        for thread in self.supervisors:
            thread.join(timeout=10)
        return {p.name: p.exit_codes[-1] for p in self.pods}

    def wait_jobset(self, policy: JobSetPolicy, timeout: float,
                    grace_s: float = TERMINATION_GRACE_S) -> dict[str, int]:  # fmt: skip
        """Waits until every pod succeeded, restarting the job as JobSet does (see
        ``RESTART_ATTEMPT``); returns each pod's last exit code. Raises when the JobSet
        failed (a failure with ``max_restarts`` spent) or at ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                # the current pods' own exits (a pod of an earlier attempt may have succeeded)
                if all(p.proc.poll() == 0 and p.exit_codes[-1:] == [0] for p in self.pods):
                    break
                failures = sum(
                    p.restarts if p.restart_policy != "Never" else
                    int(p.proc is not None and p.proc.poll() not in (None, 0))
                    for p in self.pods
                )  # fmt: skip
            if failures > policy.backoff_limit:
                self.terminate(grace_s)  # the Job controller deletes the Job's running pods
                attempt = int(self.pods[0].labels.get(RESTART_ATTEMPT, "0"))
                if attempt >= policy.max_restarts:
                    raise RuntimeError(f"the JobSet failed: a Job failed after {attempt} "
                                       f"restarts (maxRestarts {policy.max_restarts})"
                                       f"{self.log_tails()}")  # fmt: skip
                self.recreate(attempt + 1)
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the JobSet did not succeed in {timeout:.0f} s"
                                   f"{self.log_tails()}")  # fmt: skip
            time.sleep(0.25)
        for thread in self.supervisors:
            thread.join(timeout=10)
        return {p.name: p.exit_codes[-1] for p in self.pods}

    def terminate(self, grace_s: float) -> None:
        """Deletes every pod as kubelet does: SIGTERM to the container's process, SIGKILL
        to all it left after ``grace_s``; nothing is restarted."""
        procs = self._signal_all(os.kill, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.stop()

    def recreate(self, attempt: int) -> None:
        """JobSet's restart: new pods (no container restarts yet) with the same names,
        addresses and environment, labelled with the restart ``attempt``."""
        self.supervisors.clear()
        self.stopping.clear()
        for pod in self.pods:
            pod.restarts = 0
            pod.labels[RESTART_ATTEMPT] = str(attempt)
        self.start_all()

    def log(self, name: str) -> str:
        path = self.logs[name]
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tails(self, chars: int = 3000) -> str:
        return "".join(f"\n--- {name}\n{self.log(name)[-chars:]}" for name in self.logs)

    def stop(self) -> None:
        """Kills every pod's process (SIGKILL to its session) and stops restarting them."""
        procs = self._signal_all(os.killpg, signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        for thread in self.supervisors:
            thread.join(timeout=10)

    def _signal_all(self, kill, signum: int) -> list[subprocess.Popen]:
        """Stops restarting the pods, sends ``signum`` with ``kill`` (``os.kill``: the
        process, ``os.killpg``: its session) to each that runs; returns their processes."""
        self.stopping.set()
        with self.lock:
            procs = [p.proc for p in self.pods if p.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    kill(proc.pid, signum)
        return procs

    def remove(self) -> None:
        """Stops the pods and deletes every namespace (with its veths and the bridge)."""
        self.stop()
        errors = []
        for ns in reversed(self.created):
            for pid in _netns_pids(ns):  # anything still in the namespace (none expected)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                _ip("netns", "del", ns)
            except RuntimeError as err:
                errors.append(str(err))
        self.created.clear()
        self.supervisors.clear()
        if errors:
            raise RuntimeError(f"could not remove the pods' namespaces: {errors}")


def _netns_pids(ns: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in proc.stdout.split()]


@contextlib.contextmanager
def running(pods: Sequence[Pod], host_env: Mapping[str, str], workdir: Path | None = None,
            backoff_scale: float = 1.0) -> Iterator[Cluster]:  # fmt: skip
    """A built ``Cluster`` of ``pods`` (``backoff_scale``: see ``Cluster``); removed on
    exit, also on failure."""
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="tfdist-pods-")) if own else workdir
    cluster = Cluster(pods, workdir, host_env, backoff_scale)
    atexit.register(cluster.remove)  # also when the session ends without this finally
    try:
        cluster.build()
        yield cluster
    finally:
        cluster.remove()
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
