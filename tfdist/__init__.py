"""tfdist: distributed training of Keras 3 models, made real, easy and safe.

Example:
    >>> import tfdist
    >>> with tfdist.scope():                 # doctest: +SKIP
    ...     model = build_and_compile()
    >>> batch = tfdist.global_batch_size(64)  # doctest: +SKIP

``import tfdist`` is cheap and TensorFlow-free: it installs the start-up hooks
(``tfdist.startup``) and loads each name below on first use.
"""

from __future__ import annotations

import importlib

from tfdist import startup

__version__ = "0.1.0"

# public name -> module that defines it (the one list of tfdist's exports)
_EXPORTS = {
    "scope": "tfdist.distribute",
    "strategy": "tfdist.distribute",
    "num_replicas": "tfdist.distribute",
    "global_batch_size": "tfdist.distribute",
    "num_workers": "tfdist.distribute",
    "worker_index": "tfdist.distribute",
    "is_chief": "tfdist.distribute",
    "barrier": "tfdist.distribute",
    "chief_print": "tfdist.distribute",
    "configure_cpu_devices": "tfdist.backends.tensorflow",
    "ClusterInfo": "tfdist.core.cluster",
    "cluster_from_env": "tfdist.core.cluster",
    "ConfigError": "tfdist.config",
    "make_or_restore": "tfdist.checkpoint",
    "resume_state": "tfdist.checkpoint",
    "loops": "tfdist.loops",
    "save": "tfdist.saving",
    "load": "tfdist.saving",
    "describe": "tfdist.backends.layouts",
    "estimate_memory": "tfdist.backends.layouts",
    # the public submodules, each a namespace of its own: tfdist.data.pipeline, ...
    **{name: f"tfdist.{name}" for name in ("callbacks", "compat", "config", "data", "launch")},
}
# Implementation modules: importable (tests, tools), not part of the API and not listed,
# so each public name has one route (tfdist.save, never tfdist.saving.save).
_INTERNAL = {name: f"tfdist.{name}" for name in ("checkpoint", "core", "distribute", "saving")}

__all__ = ["__version__", *_EXPORTS]

startup.install()


def __getattr__(name: str):
    target = _EXPORTS.get(name) or _INTERNAL.get(name)
    if target is None:
        raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
    module = importlib.import_module(target)
    value = module if target == f"tfdist.{name}" else getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(__all__)
