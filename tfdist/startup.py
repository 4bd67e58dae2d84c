"""Process set-up that does not depend on the order of a script's statements.

TensorFlow fixes its devices and its collective ops when it creates its eager context,
at the first op, and refuses to change them afterwards. Scripts do not all create the
strategy first: the tutorials load data (``tfds.load``) before ``with strategy.scope()``.
So tfdist sets the process up at the one moment that works for every order:

1. ``install()`` (run by ``import tfdist`` and by ``python -m tfdist.bootstrap``) adds
   an import hook and touches nothing else: TensorFlow is not imported.
2. When ``tensorflow`` is imported, its runtime fixes are applied and the context's
   ``ensure_initialized`` is wrapped; when ``keras`` is imported, its fixes are applied.
3. Just before TensorFlow creates its context (whatever op comes first), tfdist splits
   the CPU into ``TFDIST_CPU_DEVICES`` logical devices and, in a multi-worker cluster,
   creates the process's MultiWorkerMirroredStrategy, which configures the collectives
   and starts the worker's server. A strategy built by hand later shares that server.

If TensorFlow already created its context before tfdist was imported, nothing can be
changed any more: ``tfdist.scope()`` then fails with an error that says so.

Under the JAX backend nothing here touches TensorFlow: ``TFDIST_CPU_DEVICES`` becomes
``JAX_NUM_CPU_DEVICES`` before jax is imported, and a multi-process job (TF_CONFIG or
``KERAS_DISTRIBUTION_*``, as ``tfdist launch`` sets; ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, as a Kubeflow TrainJob's pods get) calls
``jax.distributed.initialize`` right after jax is imported, once, with tfdist's timeouts (jax's own default is minutes).

Example:
    >>> from tfdist import startup
    >>> startup.install()        # idempotent; import tfdist already did it
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading

from tfdist import backends, unscoped
from tfdist.check import hook as check_hook
from tfdist.core import cluster, config, process, quiet, roles, upstream, versions

__all__ = ["install", "installed", "auto_strategy"]

logger = logging.getLogger(__name__)

_installed = False
_setting_up = threading.local()  # re-entry guard: set-up itself initialises the context


class _RunAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``callback(module)`` right after the top-level module ``name`` is executed."""

    def __init__(self, name: str, callback):
        self.name = name
        self.callback = callback
        self._finding = False
        self._loader = None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._finding:
            return None
        self._finding = True  # find the real spec through the other finders
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return None
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._loader
        module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _remove_finder(self)
        self.callback(module)


def _remove_finder(finder) -> None:
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)


def _after_import(name: str, callback) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        callback(module)
        return
    sys.meta_path.insert(0, _RunAfterImport(name, callback))


def install() -> None:
    """Sets the process up to be configured before its framework starts (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    quiet.install_defaults()
    check_hook.start()  # under `tfdist check` only
    try:
        backend = backends.name()
    except config.ConfigError:
        return  # an unsupported backend: tfdist's functions say so when called
    if backend == "tensorflow":
        _after_import("tensorflow", _on_tensorflow_import)
        _after_import("keras", _on_keras_import)
    elif backend == "jax":
        _prepare_jax_devices()
        _after_import("jax", _on_jax_import)
        _after_import("keras", _on_keras_import_jax)


def installed() -> bool:
    """Whether ``install()`` ran in this process."""
    return _installed


def _on_tensorflow_import(_module) -> None:
    from tfdist import compat
    from tfdist.core import fix_registry

    versions.check("tensorflow")

    compat.apply_all(package="tensorflow")
    reason = fix_registry.apply_fix(STARTUP)
    if reason is not None:
        logger.warning(
            "tfdist: cannot set this process up before TensorFlow starts (%s): "
            "TFDIST_CPU_DEVICES and the multi-worker strategy of a launched job are not "
            "applied; install a verified TensorFlow release (tfdist info).",
            reason,
        )


def _on_keras_import(_module) -> None:
    from tfdist import compat

    versions.check("keras")
    compat.apply_all()
    check_hook.on_keras_import(_module)
    unscoped.on_keras_import(_module)


def _wrap_ensure(original):
    def ensure_initialized(self):
        # No import here: TensorFlow calls this during interpreter shutdown too, when
        # importing is no longer possible.
        if not getattr(_setting_up, "active", False) and not upstream.tf_context_initialized(self):
            _setting_up.active = True
            try:
                _before_context(self)
            finally:
                _setting_up.active = False
        return original(self)

    return ensure_initialized


def _hook_context() -> None:
    from tfdist.core import fix_registry

    fix_registry.patch(
        upstream.tf_context_class(), "ensure_initialized", STARTUP.name, _wrap_ensure
    )


def _startup_record():
    from tfdist.core import fix_registry

    return fix_registry.Patch(
        "tfdist_startup",
        _hook_context,
        purpose="tfdist sets the process up (logical CPU devices, the multi-worker strategy) "
        "just before TensorFlow creates its context, whatever op comes first",
        package="tensorflow",
        targets=fix_registry.targets("tensorflow.python.eager.context:Context.ensure_initialized"),
    )


# tfdist's own set-up hook, applied like every fix (fix_registry.apply_fix) and guarded by
# the same checks, but no exclusion removes it: without it TFDIST_CPU_DEVICES and a
# launched job's strategy do not apply. Not in tfdist.compat.FIXES: it repairs nothing.
STARTUP = _startup_record()


def auto_strategy(enabled: bool) -> None:
    """Whether a multi-worker process joins its job when its framework starts (default
    True): TensorFlow's first op creates the strategy; ``import jax`` joins jax's
    distributed runtime.

    ``tfdist info`` turns it off: describing the process must never start a server, nor
    register with a running job's coordinator in place of the process that holds its id.
    """
    process.state().auto_strategy = bool(enabled)


def _before_context(ctx) -> None:
    """Devices, then (multi-worker) the strategy: the last moment either can be set."""
    from tfdist.backends import tensorflow as tf_backend

    wanted = config.cpu_devices()
    if wanted and wanted > 1:
        tf_backend.configure_cpu_devices(wanted)
    st = process.state()
    if (
        st.auto_strategy
        and st.distribution is None
        and cluster.cluster_from_env().is_multi_worker
        and not upstream.tf_collectives_configured(ctx)
    ):
        logger.info("tfdist: creating the multi-worker strategy before TensorFlow starts")
        tf_backend.strategy()


# --------------------------------------------------------------------------- JAX


def _prepare_jax_devices() -> None:
    """``TFDIST_CPU_DEVICES=N`` as jax's own knob, read when jax starts its CPU backend."""
    wanted = config.cpu_devices()
    if wanted and "jax" not in sys.modules:
        import os

        os.environ["JAX_NUM_CPU_DEVICES"] = str(wanted)


def _on_jax_import(jax) -> None:
    versions.check("jax")
    wanted = config.cpu_devices()
    if wanted:
        try:  # jax imported before tfdist, but its backend not started yet
            jax.config.update("jax_num_cpu_devices", wanted)
        except RuntimeError:
            pass  # started already: tfdist.scope() says so with a clear error
    info = cluster.cluster_from_env()
    if info.is_multi_worker and process.state().auto_strategy:
        _initialize_jax_processes(jax, info)


def _initialize_jax_processes(jax, info: cluster.ClusterInfo) -> None:
    """``jax.distributed.initialize`` once, with tfdist's timeouts, naming what it waits for."""
    timeouts = config.MultiWorkerTimeouts.from_env()
    role = roles.of_cluster(info)
    if info.source == "SLURM":  # srun names the nodes, not the addresses: task 0's
        coordinator = cluster.slurm_coordinator()
    elif info.addresses:
        coordinator = info.addresses[0]
    else:
        raise config.ConfigError(
            f"tfdist: process {role.rank} of {role.count} ({info.source}) has no "
            f"coordinator address for jax.distributed. Received: cluster={dict(info.cluster)}. "
            "Give the job's addresses in TF_CONFIG or KERAS_DISTRIBUTION_JOB_ADDRESSES."
        )
    register = config.jax_register_timeout()
    logger.info(
        "tfdist: process %d of %d joining the job (coordinator %s, waiting up to %.0f s)",
        role.rank,
        role.count,
        coordinator,
        register,
    )
    joined = _name_the_missing_after(register, role, coordinator)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=role.count,
        process_id=role.rank,
        initialization_timeout=int(register),
        heartbeat_timeout_seconds=max(int(timeouts.heartbeat), 1),
        shutdown_timeout_seconds=int(timeouts.shutdown),
        # Every parameter is given: jax's own detection would only look again, and in a
        # Kubernetes pod (KUBERNETES_SERVICE_HOST) its K8sCluster queries the API server
        # for the pod and its Job, which needs RBAC the pod may not have.
        cluster_detection_method="deactivate",
    )
    joined.set()
    process.state().jax_initialized = True


def _name_the_missing_after(seconds: float, role: roles.Role, coordinator: str):
    """An event to set once the job gathered; if it is not set within ``seconds``, one
    line names who did not join, and the process ends (exit ``WATCHDOG_EXIT_CODE``).

    jax aborts the process from C++ at its own timeout with a stack trace that names no
    process; this speaks first, a moment before it.
    """
    import os

    joined = threading.Event()
    others = [i for i in range(role.count) if i != role.rank]
    if role.rank == 0:
        plural = "es" if len(others) > 1 else ""
        who = f"process{plural} {', '.join(map(str, others))} to join the job at {coordinator}"
    else:
        who = f"the coordinator (process 0 at {coordinator}) to start the job"
        if len(others) > 1:
            who += " (it waits for every process)"

    def give_up() -> None:
        if joined.wait(max(seconds - 1.0, 0.5)):
            return
        print(
            f"tfdist: process {role.rank} of {role.count} gave up after {seconds:.0f} s "
            f"waiting for {who}: start it, or raise TFDIST_REGISTER_TIMEOUT.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(config.WATCHDOG_EXIT_CODE)

    threading.Thread(target=give_up, name="tfdist-jax-join", daemon=True).start()
    return joined


def _on_keras_import_jax(_keras) -> None:
    from tfdist import compat

    versions.check("keras")
    compat.apply_all()
    if process.state().jax_initialized:
        # What keras.distribution.initialize() does after jax's: one random seed for every
        # process, so unseeded scripts still build the same initial weights everywhere.
        upstream.keras_jax_distribution_lib().initialize_rng()
    check_hook.on_keras_import(_keras)
    unscoped.on_keras_import(_keras)
