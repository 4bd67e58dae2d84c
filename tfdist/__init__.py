"""tfdist: distributed training of Keras 3 models with TensorFlow, made real, easy and safe.

Example:
    >>> import tfdist
    >>> with tfdist.scope():                 # doctest: +SKIP
    ...     model = build_and_compile()
    >>> batch = tfdist.global_batch_size(64)  # doctest: +SKIP

The names below are loaded on first use, so ``import tfdist`` (and ``tfdist --help``)
does not pay TensorFlow's import time until a TensorFlow-backed name is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "scope": "tfdist.strategy",
    "num_replicas": "tfdist.strategy",
    "global_batch_size": "tfdist.strategy",
    "configure_cpu_devices": "tfdist.strategy",
    "is_chief": "tfdist.cluster",
    "ClusterInfo": "tfdist.cluster",
    "cluster_from_env": "tfdist.cluster",
    "make_or_restore": "tfdist.checkpoint",
    "save": "tfdist.saving",
    "load": "tfdist.saving",
}
# submodules reachable as attributes: tfdist.data, tfdist.callbacks, ...
# ``tfdist.strategy`` is the submodule, made callable (see strategy.py), because any
# ``import tfdist.strategy`` rebinds the package attribute to the module anyway.
_SUBMODULES = (
    "strategy",
    "cluster",
    "compat",
    "data",
    "callbacks",
    "checkpoint",
    "saving",
    "launch",
)

__all__ = ["__version__", *_EXPORTS, *_SUBMODULES]

if TYPE_CHECKING:  # for IDEs and type checkers; at run time __getattr__ loads these
    from tfdist import strategy  # noqa: F401
    from tfdist.checkpoint import make_or_restore  # noqa: F401
    from tfdist.cluster import ClusterInfo, cluster_from_env, is_chief  # noqa: F401
    from tfdist.saving import load, save  # noqa: F401
    from tfdist.strategy import (  # noqa: F401
        configure_cpu_devices,
        global_batch_size,
        num_replicas,
        scope,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = getattr(module, name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"tfdist.{name}")
    else:
        raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(__all__)
