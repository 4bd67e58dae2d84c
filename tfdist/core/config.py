"""Every tfdist knob in one TensorFlow-free leaf: names, defaults, and their precedence.

Precedence, everywhere: an explicit argument, then the environment variable, then the
default. Environment values are parsed here, once, with errors that name the variable
and echo its value (``ConfigError``, which the ``tfdist`` command prints as one line).

=============================  ==========  ================================================
variable                       default     meaning
=============================  ==========  ================================================
``TFDIST_CPU_DEVICES``         unset       split the CPU into N logical devices
``TFDIST_REGISTER_TIMEOUT``    300         s for every worker to start and register
``TFDIST_HEARTBEAT_TIMEOUT``   10          s without a heartbeat before a worker is dead
``TFDIST_SHUTDOWN_TIMEOUT``    60          s the chief waits for the others at exit
``TFDIST_COLLECTIVE_TIMEOUT``  none        TensorFlow: s limit per collective op (off by
                                           default; on JAX, the old name of the next)
``TFDIST_JAX_STALL_TIMEOUT``   45          JAX, several processes: s without a finished
                                           batch before ``tfdist.core.watchdog`` ends
                                           the process (0 disables)
``TFDIST_ALLREDUCE``           auto        all-reduce: ``auto``, ``ring``, ``nccl`` (and, for
                                           MirroredStrategy, ``hierarchical_copy`` or
                                           ``reduce_to_one``)
``TFDIST_BYTES_PER_PACK``      0           gradient packing: bytes per all-reduce pack
                                           (0: TensorFlow decides)
``TFDIST_COMPAT_EXCLUDE``      empty       comma-separated fixes not to apply
``TFDIST_SLURM_PORT_BASE``     from job    first port of a SLURM step's workers
``TFDIST_RESTART``             0           set by ``tfdist launch``: group restarts so far
``TFDIST_ELASTIC_EVENTS``      unset       set by an elastic ``tfdist launch``: the file
                                           its workers note their first step in
``TFDIST_RENDEZVOUS``          unset       set by an elastic ``tfdist launch``: the store,
                                           job id and round the worker belongs to
``TFDIST_SHARED_NETWORK``      0           ``1``: ``tfdist launch`` workers use this host's
                                           network instead of a private one
``TFDIST_PRIVATE_EGRESS``      1           ``0``: the private network's workers get no
                                           outbound connections (loopback only)
``TFDIST_LAUNCH_PYTHON``       launcher's  the interpreter ``tfdist launch`` starts its
                                           workers with (a path, or a name on PATH)
``TFDIST_UNSCOPED_MODELS``     job         under ``tfdist launch`` / ``python -m
                                           tfdist.bootstrap``: ``job`` trains models built
                                           outside any scope on the job's strategy;
                                           ``local``: one replica per process, as upstream
``TFDIST_DEBUG``               0           ``1``: full tracebacks where tfdist otherwise
                                           ends with one line (a lost peer, a timeout)
``KERAS_BACKEND``              keras.json  ``tensorflow`` or ``jax`` (Keras's own knob)
=============================  ==========  ================================================

Example:
    >>> cpu_devices(environ={"TFDIST_CPU_DEVICES": "2"})
    2
    >>> MultiWorkerTimeouts.from_env({"TFDIST_HEARTBEAT_TIMEOUT": "30"}).heartbeat
    30.0
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from tfdist.core import validate

# ConfigError is defined here and exported once, as tfdist.ConfigError.
__all__ = [
    "DEBUG_ENV",
    "debug",
    "RESTART_EXIT_CODE",
    "WATCHDOG_EXIT_CODE",
    "JAX_STALL_TIMEOUT_DEFAULT",
    "JAX_STALL_TIMEOUT_ENV",
    "JAX_REGISTER_TIMEOUT_DEFAULT",
    "jax_register_timeout",
    "jax_stall_timeout",
    "CPU_DEVICES_ENV",
    "COMPAT_EXCLUDE_ENV",
    "SLURM_PORT_BASE_ENV",
    "RESTART_ENV",
    "ELASTIC_EVENTS_ENV",
    "RENDEZVOUS_ENV",
    "SHARED_NETWORK_ENV",
    "PRIVATE_EGRESS_ENV",
    "private_egress",
    "MultiWorkerTimeouts",
    "Communication",
    "ALLREDUCE_ENV",
    "BYTES_PER_PACK_ENV",
    "ALLREDUCE_IMPLEMENTATIONS",
    "cpu_devices",
    "compat_exclude",
    "slurm_port_base",
    "keras_backend",
    "restart_count",
    "shared_network",
    "UNSCOPED_MODELS_ENV",
    "UNSCOPED_MODELS_CHOICES",
    "unscoped_models",
]


class ConfigError(ValueError):
    """A tfdist setting is wrong: an argument, a ``TFDIST_*`` variable, TF_CONFIG, an option.

    A ``ValueError``, so ``except ValueError`` keeps working; the ``tfdist`` command turns
    exactly this type into one line and exit code 2 (anything else keeps its traceback).
    """


# Exit code of a worker that saved its state and asks to be started again (preemption,
# SIGTERM). 75 is EX_TEMPFAIL in sysexits.h: "temporary failure, try again".
RESTART_EXIT_CODE = 75

# Exit code of a process of a multi-process JAX job that ``tfdist.core.watchdog`` ended: a peer
# (or this process) made no progress for ``TFDIST_JAX_STALL_TIMEOUT`` s, or a collective
# failed because a peer is gone. 69 is EX_UNAVAILABLE in sysexits.h: "a service is
# unavailable". ``tfdist launch`` stops the other workers, as for any non-zero exit.
WATCHDOG_EXIT_CODE = 69

# The default of TFDIST_JAX_STALL_TIMEOUT (s without a finished batch): a normal step is
# far shorter, and with the watchdog's own verdict (at most 11 s: reading the peers'
# progress, then letting a stuck peer report first) a stuck job ends within 60 s.
JAX_STALL_TIMEOUT_DEFAULT = 45.0
# How long the processes of a JAX job wait for each other at start-up, unless
# TFDIST_REGISTER_TIMEOUT says otherwise: `tfdist launch` and srun start them together,
# so a process missing after a minute never started (jax's own default is 300 s).
JAX_REGISTER_TIMEOUT_DEFAULT = 60.0

CPU_DEVICES_ENV = "TFDIST_CPU_DEVICES"
JAX_STALL_TIMEOUT_ENV = "TFDIST_JAX_STALL_TIMEOUT"
COMPAT_EXCLUDE_ENV = "TFDIST_COMPAT_EXCLUDE"
SLURM_PORT_BASE_ENV = "TFDIST_SLURM_PORT_BASE"
RESTART_ENV = "TFDIST_RESTART"
ELASTIC_EVENTS_ENV = "TFDIST_ELASTIC_EVENTS"
RENDEZVOUS_ENV = "TFDIST_RENDEZVOUS"
SHARED_NETWORK_ENV = "TFDIST_SHARED_NETWORK"
PRIVATE_EGRESS_ENV = "TFDIST_PRIVATE_EGRESS"
LAUNCH_PYTHON_ENV = "TFDIST_LAUNCH_PYTHON"
ALLREDUCE_ENV = "TFDIST_ALLREDUCE"
BYTES_PER_PACK_ENV = "TFDIST_BYTES_PER_PACK"
DEBUG_ENV = "TFDIST_DEBUG"
UNSCOPED_MODELS_ENV = "TFDIST_UNSCOPED_MODELS"
# job: a model built outside any scope trains on the job's strategy or distribution (every
# replica of every worker); local: on one replica of its own process, as plain Keras does.
UNSCOPED_MODELS_CHOICES = ("job", "local")
# auto/ring/nccl: tf.distribute.experimental.CommunicationImplementation (both strategies);
# the last two: MirroredStrategy's other cross_device_ops (one process only).
ALLREDUCE_IMPLEMENTATIONS = ("auto", "ring", "nccl", "hierarchical_copy", "reduce_to_one")
TIMEOUT_ENV = {
    "register": "TFDIST_REGISTER_TIMEOUT",
    "heartbeat": "TFDIST_HEARTBEAT_TIMEOUT",
    "shutdown": "TFDIST_SHUTDOWN_TIMEOUT",
    "collective": "TFDIST_COLLECTIVE_TIMEOUT",
}

# Waits that are not knobs, in seconds: each ends in an error that names what it waited for.
SEED_AGREEMENT_TIMEOUT_S = 300.0  # workers agreeing on a pipeline's random seed
HOST_CALL_TIMEOUT_S = 300.0  # a tf.data host-side call (reading a source into memory)
DOWNLOAD_PROBE_TIMEOUT_S = 30.0  # the MNIST download server answering
PREEMPTION_TIMEOUT_S = 60.0  # workers agreeing on the step to save at after SIGTERM
BARRIER_TIMEOUT_S = 300.0  # tfdist.barrier(): every worker arriving


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _env_text(env: Mapping[str, str], var: str) -> str:
    return env.get(var, "").strip()


def _env_int(env: Mapping[str, str], var: str, hint: str) -> int | None:
    text = _env_text(env, var)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise ConfigError(f"{var} must be a positive int. Received: {var}={text!r}. {hint}")
    return value


def cpu_devices(arg: int | None = None, *, environ: Mapping[str, str] | None = None):
    """Logical CPU devices wanted: ``arg``, else ``TFDIST_CPU_DEVICES``, else None.

    Example:
        >>> cpu_devices(4, environ={"TFDIST_CPU_DEVICES": "2"})
        4
    """
    if arg is not None:
        return validate.positive_int(
            arg, "cpu_devices", "tfdist", "Pass the number of logical CPUs wanted."
        )
    return _env_int(
        _env(environ), CPU_DEVICES_ENV, "Set it to the number of logical CPU devices, e.g. 2."
    )


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times ``tfdist launch`` restarted this worker's group (0 at first start).

    Example:
        >>> restart_count({"TFDIST_RESTART": "0"}), restart_count({})
        (0, 0)
    """
    text = _env_text(_env(environ), RESTART_ENV)
    if text in ("", "0"):  # the launcher's first start sets 0
        return 0
    return _env_int(_env(environ), RESTART_ENV, "tfdist launch sets it; do not set it.") or 0


def _env_flag(environ: Mapping[str, str] | None, name: str, default: bool, hint: str) -> bool:
    """A 1/0 switch: ``1``/``true``/``yes`` or ``0``/``false``/``no``; unset: ``default``."""
    text = _env_text(_env(environ), name).lower()
    if text == "":
        return default
    if text in ("0", "false", "no"):
        return False
    if text in ("1", "true", "yes"):
        return True
    raise ConfigError(f"{name} must be 1 or 0. Received: {name}={text!r}. {hint}")


def shared_network(arg: bool | None = None, *, environ: Mapping[str, str] | None = None) -> bool:
    """Whether local ``tfdist launch`` jobs skip the private network: ``arg``, else
    ``TFDIST_SHARED_NETWORK`` (``1``/``true``/``yes`` or ``0``/``false``/``no``), else False.

    Example:
        >>> shared_network(environ={"TFDIST_SHARED_NETWORK": "1"})
        True
    """
    if arg is not None:
        return validate.instance(arg, bool, "shared_network", "tfdist", "a bool")
    hint = "Set it to 1 to run local jobs on this host's network (their ports exposed)."
    return _env_flag(environ, SHARED_NETWORK_ENV, False, hint)


def private_egress(arg: bool | None = None, *, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the private network carries the workers' outbound connections: ``arg``,
    else ``TFDIST_PRIVATE_EGRESS`` (``1``/``true``/``yes`` or ``0``/``false``/``no``),
    else True.

    Example:
        >>> private_egress(environ={"TFDIST_PRIVATE_EGRESS": "0"})
        False
    """
    if arg is not None:
        return validate.instance(arg, bool, "private_egress", "launch", "a bool")
    hint = (
        "Set it to 0 to keep the private network's workers off every outside network "
        "(loopback only)."
    )
    return _env_flag(environ, PRIVATE_EGRESS_ENV, True, hint)


def unscoped_models(arg: str | None = None, *, environ: Mapping[str, str] | None = None) -> str:
    """Where a script's models built outside any scope train, under ``tfdist launch`` and
    ``python -m tfdist.bootstrap``: ``arg``, else ``TFDIST_UNSCOPED_MODELS``, else ``job``.

    Example:
        >>> unscoped_models(environ={"TFDIST_UNSCOPED_MODELS": "local"})
        'local'
    """
    hint = (
        "Use job (train on every replica of the job) or local (one replica per process, "
        "as plain Keras)."
    )
    if arg is not None:
        text = validate.instance(arg, str, "unscoped_models", "tfdist", "job or local")
        if text not in UNSCOPED_MODELS_CHOICES:
            raise ConfigError(f"unscoped_models must be job or local. Received: {arg!r}. {hint}")
        return text
    text = _env_text(_env(environ), UNSCOPED_MODELS_ENV).lower() or "job"
    if text not in UNSCOPED_MODELS_CHOICES:
        raise ConfigError(
            f"{UNSCOPED_MODELS_ENV} must be job or local. Received: "
            f"{UNSCOPED_MODELS_ENV}={text!r}. {hint}"
        )
    return text


def launch_python(arg: str | None = None, *, environ: Mapping[str, str] | None = None) -> str:
    """The interpreter ``tfdist launch`` starts workers with: ``arg``, else
    ``TFDIST_LAUNCH_PYTHON``, else the launcher's own (``sys.executable``). A wrapper that
    takes Python's arguments works too (a profiler's, a container's).

    Example:
        >>> launch_python(environ={}) == sys.executable
        True
    """
    if arg is not None:
        return validate.instance(arg, str, "python", "launch", "an interpreter's path (a str)")
    text = _env(environ).get(LAUNCH_PYTHON_ENV, "").strip()
    if not text:
        return sys.executable
    found = shutil.which(text)
    if found is None:
        raise ConfigError(
            f"{LAUNCH_PYTHON_ENV} must name an executable Python interpreter (a path, or a "
            f"name on PATH). Received: {LAUNCH_PYTHON_ENV}={text!r}. Unset it to start "
            "workers with the launcher's own interpreter."
        )
    return found


def debug(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``TFDIST_DEBUG`` asks for full tracebacks (anything but unset, "" or "0").

    Example:
        >>> debug({"TFDIST_DEBUG": "1"}), debug({})
        (True, False)
    """
    return _env(environ).get(DEBUG_ENV, "").strip() not in ("", "0")


def compat_exclude(environ: Mapping[str, str] | None = None) -> list[str]:
    """Fix names listed in ``TFDIST_COMPAT_EXCLUDE`` (comma-separated)."""
    text = _env(environ).get(COMPAT_EXCLUDE_ENV, "")
    return [name.strip() for name in text.split(",") if name.strip()]


def slurm_port_base(environ: Mapping[str, str] | None = None) -> int:
    """``TFDIST_SLURM_PORT_BASE``, else ``20000 + SLURM_JOB_ID % 625 * 64``.

    Each job gets a window of 64 ports (task ``i`` of a node listens on ``base + i``), so
    jobs sharing a node collide only when their ids are equal modulo 625, or when one
    runs more than 64 tasks on a node. (Consecutive ids with ``20000 + id % 20000``
    overlapped as soon as a node ran two tasks.)

    Example:
        >>> slurm_port_base({"SLURM_JOB_ID": "12345"})
        50080
    """
    env = _env(environ)
    text = _env_text(env, SLURM_PORT_BASE_ENV)
    if not text:
        job = env.get("SLURM_JOB_ID", "0").strip()
        return 20000 + (int(job) if job.isdigit() else 0) % 625 * 64
    port = int(text) if text.isdigit() else -1
    if not 1024 <= port <= 65000:
        raise ConfigError(
            f"{SLURM_PORT_BASE_ENV} must be a port number in [1024, 65000]. Received: "
            f"{SLURM_PORT_BASE_ENV}={text!r}"
        )
    return port


def keras_backend(environ: Mapping[str, str] | None = None) -> str:
    """The Keras backend this process will use, found the way Keras finds it, without Keras.

    ``KERAS_BACKEND``, else ``backend`` in ``$KERAS_HOME/keras.json`` (default
    ``~/.keras``), else ``tensorflow``. If Keras is already imported its answer wins.

    Example:
        >>> keras_backend({"KERAS_BACKEND": "jax"})
        'jax'
    """
    import sys

    keras = sys.modules.get("keras")
    if environ is None and keras is not None and hasattr(keras, "backend"):
        return keras.backend.backend()
    env = _env(environ)
    if env.get("KERAS_BACKEND"):
        return env["KERAS_BACKEND"]
    home = env.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            return json.load(f).get("backend", "tensorflow")
    except (OSError, ValueError):
        return "tensorflow"


def jax_register_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds the processes of a JAX job wait for each other to start.

    ``TFDIST_REGISTER_TIMEOUT`` if set, else ``JAX_REGISTER_TIMEOUT_DEFAULT`` (60).

    Example:
        >>> jax_register_timeout({}), jax_register_timeout({"TFDIST_REGISTER_TIMEOUT": "90"})
        (60.0, 90.0)
    """
    env = _env(environ)
    if _env_text(env, "TFDIST_REGISTER_TIMEOUT"):
        return MultiWorkerTimeouts.from_env(env).register
    return JAX_REGISTER_TIMEOUT_DEFAULT


def jax_stall_timeout(
    arg: float | None = None, *, environ: Mapping[str, str] | None = None
) -> float | None:
    """Seconds a multi-process JAX job may go without a finished batch, or None (off).

    ``arg``, else ``TFDIST_JAX_STALL_TIMEOUT`` (``0``/``off``/``none`` disable it), else
    ``JAX_STALL_TIMEOUT_DEFAULT`` (45). ``tfdist.core.watchdog`` ends a process that
    waits longer (jax's collectives have no timeout of their own on CPU); the first batch
    of each ``fit``/``evaluate``/``predict`` and an epoch's end get a longer allowance
    (compilation, saves). Raise it for steps or batch-end callbacks that take longer.
    ``TFDIST_COLLECTIVE_TIMEOUT``, this knob's old name on JAX, is still read when the new
    one is not set, with a ``FutureWarning`` that names the new one.

    Example:
        >>> jax_stall_timeout(environ={}), jax_stall_timeout(environ={
        ...     "TFDIST_JAX_STALL_TIMEOUT": "off"})
        (45.0, None)
    """
    if arg is not None:
        seconds = validate.number(
            arg,
            "timeout",
            "jax_stall_timeout",
            "Pass seconds, or 0 to disable it.",
            low=0.0,
            what="a non-negative number of seconds",
        )
        return seconds or None
    env = _env(environ)
    for var in (JAX_STALL_TIMEOUT_ENV, TIMEOUT_ENV["collective"]):
        text = _env_text(env, var)
        if text:
            if var != JAX_STALL_TIMEOUT_ENV:
                _warn_old_name(var, JAX_STALL_TIMEOUT_ENV, text)
            return _off_or_seconds(var, text)
    return JAX_STALL_TIMEOUT_DEFAULT


def _warn_old_name(old: str, new: str, text: str) -> None:
    import warnings

    warnings.warn(
        f"tfdist: {old} as the JAX stall watchdog's limit is deprecated; set {new}={text} "
        f"instead ({old} stays TensorFlow's limit per collective op).",
        FutureWarning,
        stacklevel=2,  # one location: warned once per process
    )


def _off_or_seconds(var: str, text: str) -> float | None:
    """``text`` (the value of ``var``) as seconds; None for ``0``, ``none`` or ``off``."""
    if text.lower() in ("0", "none", "off"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ConfigError(f"{var} must be a number of seconds. Received: {var}={text!r}") from None
    if not seconds > 0:
        raise ConfigError(f"{var} must be a positive number of seconds. Received: {var}={text!r}")
    return seconds


@dataclass(frozen=True)
class MultiWorkerTimeouts:
    """How long a multi-worker job waits before it gives up, in seconds.

    Attributes:
        register: every worker must have started and registered within this time
            (``TFDIST_REGISTER_TIMEOUT``, default 300).
        heartbeat: a worker that sends no heartbeat for this long is declared dead and
            the others' collectives fail with an error naming it
            (``TFDIST_HEARTBEAT_TIMEOUT``, default 10).
        shutdown: at a clean exit, how long the chief waits for the others to finish
            (``TFDIST_SHUTDOWN_TIMEOUT``, default 60; TensorFlow: once tfdist used the
            coordination service, see ``tfdist.core.exit_hold``; JAX: every process).
        collective: limit for each collective op, or None for none
            (``TFDIST_COLLECTIVE_TIMEOUT``, default None). TensorFlow spends one thread
            per in-flight collective on it, so keep it off unless debugging. JAX's
            stall watchdog has a knob of its own: ``jax_stall_timeout``.

    Example:
        >>> MultiWorkerTimeouts(heartbeat=20).register
        300.0
    """

    register: float = 300.0
    heartbeat: float = 10.0
    shutdown: float = 60.0
    collective: float | None = None

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "collective" and value is None:
                continue
            what = "a positive number of seconds"
            if field.name == "collective":
                what += " or None"
            try:
                value = validate.positive_number(value, field.name, "MultiWorkerTimeouts")
            except (TypeError, ValueError):  # one error type for a timeout, as before
                raise ValueError(
                    validate.message("MultiWorkerTimeouts", field.name, what, value)
                ) from None
            object.__setattr__(self, field.name, value)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MultiWorkerTimeouts:
        """The defaults, overridden by the ``TFDIST_*_TIMEOUT`` variables that are set.

        Example:
            >>> MultiWorkerTimeouts.from_env({"TFDIST_COLLECTIVE_TIMEOUT": "off"}).collective
        """
        env = _env(environ)
        values: dict[str, Any] = {}  # keyword arguments: float, or None for collective
        for name, var in TIMEOUT_ENV.items():
            text = _env_text(env, var)
            if not text:
                continue
            if name == "collective" and text.lower() in ("0", "none", "off"):
                values[name] = None
                continue
            try:
                values[name] = float(text)
            except ValueError:
                raise ConfigError(
                    f"{var} must be a number of seconds. Received: {var}={text!r}"
                ) from None
            if not values[name] > 0:
                raise ConfigError(
                    f"{var} must be a positive number of seconds. Received: {var}={text!r}"
                )
        return cls(**values)


@dataclass(frozen=True)
class Communication:
    """How gradients are all-reduced (TensorFlow backend; the JAX backend leaves it to XLA).

    Attributes:
        implementation: ``auto`` (TensorFlow's choice: ring on CPUs, NCCL on GPUs),
            ``ring``, ``nccl``; for MirroredStrategy also ``hierarchical_copy`` and
            ``reduce_to_one`` (``TFDIST_ALLREDUCE``, default ``auto``).
        bytes_per_pack: split the gradients into packs of about this many bytes, one
            all-reduce each, so the first packs can start while later ones are built;
            0 lets TensorFlow decide (``TFDIST_BYTES_PER_PACK``, default 0).
            MultiWorkerMirroredStrategy only. Neither setting changes the trained
            weights beyond float rounding (tested: 1e-5).

    The per-collective timeout is ``MultiWorkerTimeouts.collective``.

    Example:
        >>> Communication.from_env({"TFDIST_BYTES_PER_PACK": "4194304"}).bytes_per_pack
        4194304
    """

    implementation: str = "auto"
    bytes_per_pack: int = 0

    def __post_init__(self):
        validate.one_of(
            self.implementation,
            ALLREDUCE_IMPLEMENTATIONS,
            "implementation",
            "Communication",
            "Use 'auto' unless a measurement says otherwise.",
        )
        validate.non_negative_int(
            self.bytes_per_pack, "bytes_per_pack", "Communication", "0 lets TensorFlow decide."
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Communication:
        """The defaults, overridden by ``TFDIST_ALLREDUCE`` / ``TFDIST_BYTES_PER_PACK``.

        Example:
            >>> Communication.from_env({"TFDIST_ALLREDUCE": "ring"}).implementation
            'ring'
        """
        env = _env(environ)
        values: dict = {}
        text = _env_text(env, ALLREDUCE_ENV).lower()
        if text:
            if text not in ALLREDUCE_IMPLEMENTATIONS:
                raise ConfigError(
                    f"{ALLREDUCE_ENV} must be one of {ALLREDUCE_IMPLEMENTATIONS}. Received: "
                    f"{ALLREDUCE_ENV}={text!r}. Use auto unless a measurement says otherwise."
                )
            values["implementation"] = text
        text = _env_text(env, BYTES_PER_PACK_ENV)
        if text:
            if not text.isdigit():
                raise ConfigError(
                    f"{BYTES_PER_PACK_ENV} must be a non-negative int. Received: "
                    f"{BYTES_PER_PACK_ENV}={text!r}. 0 lets TensorFlow decide."
                )
            values["bytes_per_pack"] = int(text)
        return cls(**values)

    @property
    def is_default(self) -> bool:
        """Whether nothing was changed from TensorFlow's own behaviour."""
        return self == Communication()
